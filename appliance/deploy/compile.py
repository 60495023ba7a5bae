"""`appliance compile` for CPU targets: the stage around appliance.deploy.compiler.

The compiler itself (ONNX -> TVM library, checked) is appliance.deploy.compiler; this stage adds
what a stage owes the pipeline: a quantized model that failed its accuracy gate is refused unless
asked for, and the result is compile.json in the output folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from appliance.core.errors import DataError
from appliance.deploy import compiler
from appliance.deploy.compiler import CROSS_COMPILER, FP32_KERNELS, INT8_COMPUTE, INT8_KERNELS, TARGETS

__all__ = ["compile_model", "refuse_failed_gate", "CROSS_COMPILER", "TARGETS", "INT8_COMPUTE", "INT8_KERNELS",
           "FP32_KERNELS"]


def compile_model(model_path, target_name: str, out_dir, **options) -> dict:
    """The stage: appliance.deploy.compiler.compile_model (its options, its compile.json content)."""
    return compiler.compile_model(model_path, target_name, out_dir, **options)


def refuse_failed_gate(model_path) -> None:
    """A model from a quantize run whose top-1 drop exceeded --max-drop does not go to devices by accident."""
    manifest = Path(model_path).parent / "manifest.json"
    try:
        params = json.loads(manifest.read_text()).get("params", {})
        stage = json.loads(manifest.read_text()).get("stage")
    except (OSError, json.JSONDecodeError):
        return
    if stage == "quantize" and params.get("gate_passed") is False:
        raise DataError(f"{model_path}: failed the accuracy gate of `appliance quantize` (see "
                        f"{manifest.parent / 'accuracy.html'}); re-quantize, or pass --allow-failed-gate")
