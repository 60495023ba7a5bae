"""How far an edge build may be from onnxruntime's float reference, shared by `appliance package`
(the device's self-test bounds) and `appliance edge verify`; and the quantize gate a compile honours."""

from __future__ import annotations

import json
from pathlib import Path

from appliance.core.errors import DataError
from appliance.deploy.accuracy_report import ACCURACY_HTML

from appliance.deploy.compiler.check import QDQ_UNITS
from appliance.deploy.compiler.passes.int8_arith import output_scale


def qdq_allowance(reference) -> float:
    """For a QDQ model, the output steps `appliance compile` allows between its int8 build and
    onnxruntime's float reference (float rounding carried through the layers); 0 otherwise."""
    import onnx

    step = output_scale(onnx.load(str(reference)))
    return QDQ_UNITS * step * (1 + 1e-5) if step else 0.0


def refuse_failed_gate(model_path) -> None:
    """A model from a quantize run whose top-1 drop exceeded --max-drop does not go to devices by accident."""
    manifest = Path(model_path).parent / "manifest.json"
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return
    if data.get("stage") == "quantize" and data.get("params", {}).get("gate_passed") is False:
        raise DataError(f"{model_path}: failed the accuracy gate of `appliance quantize` (see "
                        f"{manifest.parent / ACCURACY_HTML}); re-quantize, or pass --allow-failed-gate")
