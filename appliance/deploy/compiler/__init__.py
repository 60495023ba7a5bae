"""The TVM compiler for edge CPUs: `compile_model` (frontend -> pipeline -> build -> check -> compile.json).

Laid out as docs/dev/compiler.md describes: targets.py (the targets and the CPU description),
frontend.py, pipeline.py (the ordered passes), passes/ (one pass a file), kernels/ (the kernel
conventions, the registry, kernels per instruction set), tuning/, check.py, runtime.py.

This package's top stays light (the CLI reads the targets and choices below while registering its
verbs, `appliance --help` included): `compile_model` is in driver.py, which the compile stage
(appliance.deploy.compile) imports.
"""

from appliance.deploy.compiler.options import FP32_KERNELS, INT8_COMPUTE, INT8_KERNELS, RUNTIMES
from appliance.deploy.compiler.targets import CROSS_COMPILER, TARGETS

__all__ = ["CROSS_COMPILER", "TARGETS", "INT8_COMPUTE", "INT8_KERNELS", "FP32_KERNELS", "RUNTIMES"]

