"""The choices and defaults of the deploy verbs, shared by their stage functions and the CLI.

Light on purpose (no numpy, onnx or tvm): `appliance --help` reads these while it registers the
verbs, and the stage modules that do the work import them from here.
"""

from __future__ import annotations

from appliance.core.values import Range

DEFAULT_MAX_REL_ERROR = 1e-5  # export parity: max|torch-onnx| / max|torch|
METHODS = ("minmax", "entropy", "percentile")  # INT8 calibration methods
SCHEMES = ("s8s8", "u8s8")  # INT8 activation/weight types
BENCH_RUNS = 20  # timed `bin/run --bench` runs under qemu in `edge verify`
GPU_TARGETS = ("cuda-ort", "tensorrt")  # the GPU routes of `appliance compile` (appliance.deploy.gpu.routes)
ENGINES = ("ours", "nncf")  # who makes the INT8 model: onnxruntime's quantizer with our fallback, or NNCF
FALLBACKS = ("auto", "none")  # what `quantize` does when INT8 fails its gate (appliance.deploy.fallback)
MAX_FLOAT_LAYERS = 10  # layers --fallback auto may keep in float
# The opsets torch's TorchScript exporter writes (torch.onnx._constants: ONNX_MIN_OPSET and
# ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET, the same on torch 2.11 and 2.14); 999 fails deep in torch.
OPSETS = Range(ge=7, le=20)
ERROR_SAMPLES = 32  # validation samples the per-layer sensitivity error is measured on (appliance.deploy.sensitivity)
