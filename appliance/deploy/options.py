"""The choices and defaults of the deploy verbs, shared by their stage functions and the CLI.

Light on purpose (no numpy, onnx or tvm): `appliance --help` reads these while it registers the
verbs, and the stage modules that do the work import them from here.
"""

from __future__ import annotations

from appliance.core.values import Range, shown
from appliance.models import TORCHVISION_ARCHITECTURES
from data_tools.labels import MAX_CLASSES

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

# `appliance edge estimate` (and the pipeline's latency budget): what it builds, at which sizes. The
# names are checked against this list before any path is made from them; the bounds keep the untrained
# model, its random calibration set and the two compiles within a few GB (a 100,000 px side was a 27.9 GiB
# array, 10^9 classes a 512 GB final layer; at 1 px small_cnn has nothing left to pool).
ESTIMATE_ARCHITECTURES = ("small_cnn", *TORCHVISION_ARCHITECTURES)  # "onnx" needs a graph: nothing to build untrained
ESTIMATE_SIZES = Range(ge=16, le=1024)  # pixels per side of the input
ESTIMATE_CLASSES = Range(ge=1, le=MAX_CLASSES)


def estimate_problem(archs, size: int, classes: int, *, names=("--architectures", "--size", "--classes")) -> str | None:
    """Why an estimate request cannot be built (one line naming the flag or key), or None."""
    arch_key, size_key, classes_key = names
    if not archs:
        return f"{arch_key}: names no architecture; choose from {', '.join(ESTIMATE_ARCHITECTURES)}"
    for arch in archs:
        if arch not in ESTIMATE_ARCHITECTURES:
            return (f"{arch_key}: {shown(arch, 60)} is not an architecture the estimate builds; choose from "
                    f"{', '.join(ESTIMATE_ARCHITECTURES)}")
    repeated = sorted({a for a in archs if archs.count(a) > 1})
    if repeated:
        return f"{arch_key}: {', '.join(repeated)} named more than once"
    for key, value, allowed in ((size_key, size, ESTIMATE_SIZES), (classes_key, classes, ESTIMATE_CLASSES)):
        problem = allowed.problem(value)
        if problem:
            return f"{key} {problem}"
    return None
