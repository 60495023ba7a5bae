"""`appliance quantize --engine nncf`: NNCF (OpenVINO's quantizer) as a second opinion beside ours.

NNCF's post-training quantization of the ONNX model (`nncf.quantize` over an `nncf.Dataset` of our
calibration samples: min-max ranges, per-channel weights, fast bias correction) writes a QDQ ONNX
model, which every later stage takes as it takes ours (TVM and OpenVINO compiles included). When it
drops more than --max-drop and --fallback is auto, NNCF's accuracy-control mode
(`nncf.quantize_with_accuracy_control`) reverts the quantizers that cost the most, ranked on our
validation samples with the task's own metric, until the drop is within max_drop (absolute, in the
metric's units: points / 100), at most max_float_layers of them.

The report puts the engines side by side (`engines`: drop, layers kept in float, seconds, size,
latency), each row saying why it failed the gate when it did; quantize.py runs ours for that row.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path

import numpy as np

from appliance.core.errors import EnvironmentProblem
from appliance.deploy.accuracy_report import evaluate
from appliance.deploy.int8_builder import quantized_layers
from appliance.deploy.onnx_model import load_onnx, ort_session


def require_nncf(what: str):
    try:
        import nncf
    except ImportError:
        raise EnvironmentProblem(f"{what}: --engine nncf needs the nncf wheel, which is not installed in this "
                                 "environment (install the bundle's `openvino` profile, or `pip install nncf`)") from None
    return nncf


@contextlib.contextmanager
def _quiet_nncf():
    """NNCF's progress bars and INFO lines go to stderr at warning level: stdout is ours (`--json`)."""
    logger = logging.getLogger("nncf")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        logger.setLevel(level)


def nncf_int8(model_path: Path, out_path: Path, calib_x, val, input_name: str, fp32: dict, task, max_drop: float,
              fallback: str, max_float_layers: int) -> dict:
    """Write NNCF's QDQ model to out_path; returns its row of the report's `engines`."""
    import onnx

    nncf = require_nncf(str(model_path))
    model = onnx.load(str(model_path))
    calibration = nncf.Dataset(list(range(len(calib_x))), lambda i: {input_name: calib_x[i:i + 1]})
    metric, start = task.metric, time.perf_counter()
    with _quiet_nncf():
        ptq = nncf.quantize(model, calibration, subset_size=len(calib_x))
    onnx.save(ptq, str(out_path))
    row = _row(out_path, "nncf", "ptq", [], time.perf_counter() - start, fp32, val, task, max_drop)
    if row["passed"]:
        return row
    if fallback != "auto":
        return {**row, "why": f"PTQ dropped {row[f'{metric}_drop_points']:.2f} points, more than {max_drop:g}; "
                "accuracy control not tried (--fallback none)"}
    with _quiet_nncf():
        controlled = nncf.quantize_with_accuracy_control(
            model, calibration, nncf.Dataset(list(range(len(val.x))), lambda i: {input_name: val.x[i:i + 1]}),
            _validation_fn(input_name, val, task), max_drop=max_drop / 100, drop_type=nncf.DropType.ABSOLUTE,
            subset_size=len(calib_x), advanced_accuracy_restorer_parameters=
            nncf.quantization.advanced_parameters.AdvancedAccuracyRestorerParameters(
                max_num_iterations=max_float_layers))
    onnx.save(controlled, str(out_path))
    kept = {layer.name for layer in quantized_layers(controlled)}
    floats = [layer.name for layer in quantized_layers(ptq) if layer.name not in kept]
    row = _row(out_path, "nncf", "accuracy control", floats, time.perf_counter() - start, fp32, val, task, max_drop)
    if not row["passed"]:
        row["why"] = (f"accuracy control kept {len(floats)} layer(s) in float (at most {max_float_layers}) and still "
                      f"dropped {row[f'{metric}_drop_points']:.2f} points, more than {max_drop:g}")
    return row


def ours_row(model_path: Path, report_extra: dict, seconds: float, fp32: dict, val, task, max_drop: float) -> dict:
    """Our engine's row, from the model our fallback chose (model_path) and its report sections."""
    row = _row(model_path, "ours", report_extra["produced_by"], report_extra["float_layers"], seconds, fp32, val,
               task, max_drop)
    if not row["passed"]:
        attempts = report_extra["fallback"]["attempts"]
        row["why"] = (f"no INT8 model within {max_drop:g} points among {len(attempts)} attempt(s) "
                      f"(--fallback {report_extra['fallback']['mode']}); best dropped "
                      f"{row[f'{task.metric}_drop_points']:.2f}")
    return row


def _row(path: Path, engine: str, step: str, floats: list, seconds: float, fp32: dict, val, task,
         max_drop: float) -> dict:
    result = evaluate(ort_session(path), val.x, val.y, task)
    metric = task.metric
    drop = (fp32[metric] - result[metric]) * 100
    return {"engine": engine, "step": step, metric: result[metric], f"{metric}_drop_points": drop,
            "passed": bool(drop <= max_drop), "float_layers": list(floats), "seconds": round(seconds, 2),
            "bytes": Path(path).stat().st_size, "latency_ms_median": result["latency_ms_median"],
            "quantized_layers": len(quantized_layers(load_onnx(path)))}


def _validation_fn(input_name: str, val, task):
    """NNCF's validation function: the task's metric of an ONNX model on validation items (indices),
    and per item, which NNCF ranks the quantizers with."""
    import onnxruntime as ort

    def validate(model, items):
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        index = [int(i) for i in items]
        logits = np.concatenate([session.run(None, {input_name: val.x[i:i + 1]})[0] for i in index])
        labels = val.y[index]
        per_item = [float(task.score(logits[k:k + 1], labels[k:k + 1])) for k in range(len(index))]
        return float(task.score(logits, labels)), per_item

    return validate
