"""The TVM compiler for edge CPUs: `compile_model` (frontend -> pipeline -> build -> check -> compile.json).

Laid out as docs/dev/compiler.md describes: targets.py (the targets and the CPU description),
frontend.py, pipeline.py (the ordered passes), passes/ (one pass a file), kernels/ (the kernel
conventions, the registry, kernels per instruction set), tuning/, check.py, runtime.py.

This package's top stays light (the CLI reads the targets and choices below while registering its
verbs, `appliance --help` included): `compile_model` is imported from driver.py on first use.
"""

from appliance.deploy.compiler.options import FP32_KERNELS, INT8_COMPUTE, INT8_KERNELS
from appliance.deploy.compiler.targets import CROSS_COMPILER, TARGETS

__all__ = ["compile_model", "CROSS_COMPILER", "TARGETS", "INT8_COMPUTE", "INT8_KERNELS", "FP32_KERNELS"]


def __getattr__(name: str):
    if name == "compile_model":
        # lazy: the driver imports numpy, onnx helpers and every pass, which `appliance --help` does not need
        from appliance.deploy.compiler.driver import compile_model

        return compile_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
