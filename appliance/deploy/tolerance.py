"""How far an edge build may be from onnxruntime's float reference, shared by `appliance package`
(the device's self-test bounds) and `appliance edge verify`."""

from __future__ import annotations

from appliance.deploy.compiler.driver import QDQ_UNITS
from appliance.deploy.compiler.passes.int8_arith import output_scale


def qdq_allowance(reference) -> float:
    """For a QDQ model, the output steps `appliance compile` allows between its int8 build and
    onnxruntime's float reference (float rounding carried through the layers); 0 otherwise."""
    import onnx

    step = output_scale(onnx.load(str(reference)))
    return QDQ_UNITS * step * (1 + 1e-5) if step else 0.0
