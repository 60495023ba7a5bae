"""The choices and defaults of the deploy verbs, shared by their stage functions and the CLI.

Light on purpose (no numpy, onnx or tvm): `appliance --help` reads these while it registers the
verbs, and the stage modules that do the work import them from here.
"""

from __future__ import annotations

DEFAULT_MAX_REL_ERROR = 1e-5  # export parity: max|torch-onnx| / max|torch|
METHODS = ("minmax", "entropy", "percentile")  # INT8 calibration methods
SCHEMES = ("s8s8", "u8s8")  # INT8 activation/weight types
BENCH_RUNS = 20  # timed `bin/run --bench` runs under qemu in `edge verify`
GPU_TARGETS = ("cuda-ort", "tensorrt")  # the GPU routes of `appliance compile` (appliance.deploy.gpu.routes)
