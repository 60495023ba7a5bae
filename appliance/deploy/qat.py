"""The QDQ model of a quantization-aware run, and its place in the quantize report.

A QAT run (training's [qat] section, appliance.tasks.fake_quant) exports through torch.onnx as
QuantizeLinear/DequantizeLinear pairs whose scales came from training, but the weights' pairs
start from the float weights and a few ops computing their scales. `fold_constant_quantization`
evaluates every node whose inputs are all constants (with onnx's reference evaluator), so each
weight becomes an int8 initializer read by one DequantizeLinear: the form onnxruntime's PTQ writes,
which `appliance compile` turns into int8 arithmetic, and which package and verify take unchanged.

`add_qat` evaluates that model on the quantize stage's validation set next to FP32 and PTQ, records
it in accuracy.json/.html, and ships it as model.int8.onnx when PTQ (and fallback) failed the
gate and QAT passed it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from appliance.core.errors import DataError
from appliance.core.manifest import read_manifest, write_manifest
from appliance.deploy.accuracy_report import ACCURACY_JSON, evaluate, write_reports
from appliance.deploy.onnx_model import image_input, load_onnx, metadata, ort_session
from appliance.deploy.samples import check_input_shape, load_samples
from appliance.core.stage import read_result_json
from appliance.tasks import task_of_metadata

QAT_MODEL = "model.qat.onnx"


def fold_constant_quantization(proto):
    """proto with every node whose inputs are all constants replaced by its values (initializers),
    in place; returns the number of nodes folded. Weight QuantizeLinear nodes become int8 initializers."""
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    graph = proto.graph
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    kept, folded = [], 0
    for node in graph.node:
        if node.op_type == "Constant" or (node.input and all(i in consts for i in node.input if i)):
            values = _run_node(node, consts, proto, ReferenceEvaluator)
            if values is not None:
                consts.update(zip(node.output, values))
                folded += 1
                continue
        kept.append(node)
    used = {i for n in kept for i in n.input} | {o.name for o in graph.output}
    del graph.node[:]
    graph.node.extend(kept)
    names = {t.name for t in graph.initializer}
    new = [numpy_helper.from_array(np.asarray(v), name) for name, v in consts.items()
           if name in used and name not in names]
    graph.initializer.extend(new)
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    inputs = [i for i in graph.input if i.name not in names or i.name in used]
    del graph.input[:]
    graph.input.extend(inputs)
    return folded


def _run_node(node, consts: dict, proto, evaluator) -> list | None:
    from onnx import helper

    inputs = [i for i in node.input if i]
    feeds = {name: consts[name] for name in inputs}
    try:
        graph = helper.make_graph([node], "fold", [helper.make_tensor_value_info(n, _elem(consts[n]), None)
                                                   for n in inputs],
                                  [helper.make_tensor_value_info(o, 0, None) for o in node.output])
        model = helper.make_model(graph, opset_imports=proto.opset_import)
        return list(evaluator(model).run(None, feeds))
    except Exception:  # an op the reference evaluator lacks: left to the runtime
        return None


def _elem(array) -> int:
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(np.asarray(array).dtype)


def add_qat(quantize_dir: Path, qat_model: Path, val_files, calib_files, *, val_samples: int = 1_000_000,
            run_dir: Path | None = None) -> dict:
    """The QAT model evaluated next to the quantize report's FP32 and INT8 models; accuracy.json/.html
    rewritten with a "qat" section and the shipped model chosen (see the module docstring)."""
    quantize_dir = Path(quantize_dir)
    report = read_result_json(quantize_dir / ACCURACY_JSON)
    fp32_path = Path(report["fp32"]["model"])
    qat_model = Path(qat_model)
    model = load_onnx(qat_model)
    if not any(n.op_type == "DequantizeLinear" for n in model.graph.node):
        raise DataError(f"{qat_model}: not a QDQ model (no DequantizeLinear): was it exported from a [qat] run?")
    fp32_proto = load_onnx(fp32_path)
    inp = image_input(fp32_proto, fp32_path)
    val = load_samples(list(val_files or calib_files), metadata(fp32_proto).get("preprocessing", {}),
                       limit=val_samples)
    check_input_shape(val, inp.shape, inp.name, qat_model)
    task = task_of_metadata(metadata(fp32_proto))
    m = task.metric  # top1, or miou for a segmentation model: the report's own keys
    fp32 = evaluate(ort_session(fp32_path), val.x, val.y, task)
    qat = evaluate(ort_session(qat_model), val.x, val.y, task)
    drop = (fp32[m] - qat[m]) * 100
    local = quantize_dir / QAT_MODEL
    if qat_model.resolve() != local.resolve():
        shutil.copyfile(qat_model, local)
    section = {"model": str(local), m: qat[m], f"{m}_drop_points": drop, "bytes": local.stat().st_size,
               "latency_ms_median": qat["latency_ms_median"], "passed": bool(drop <= report["max_drop_points"]),
               "prediction_agreement": float((fp32["predictions"] == qat["predictions"]).mean()),
               "run_dir": str(run_dir) if run_dir else None, "validation_samples": int(len(val.x))}
    report["qat"] = section
    report["ptq"] = {k: report["quantized"][k] for k in ("model", m, "bytes", "latency_ms_median")}
    report["ptq"].update({f"{m}_drop_points": report[f"{m}_drop_points"], "produced_by": report.get("produced_by")})
    if not report["gate_passed"] and section["passed"]:
        shipped = Path(report["quantized"]["model"])
        shutil.copyfile(local, shipped)
        report["quantized"].update({m: qat[m], "bytes": shipped.stat().st_size,
                                    "latency_ms_median": qat["latency_ms_median"]})
        report.update({f"{m}_drop_points": drop, "gate_passed": True, "produced_by": "qat",
                       "prediction_agreement": section["prediction_agreement"], "float_layers": [],
                       "size_ratio": shipped.stat().st_size / report["fp32"]["bytes"],
                       "latency_ratio": qat["latency_ms_median"] / fp32["latency_ms_median"]})
    write_reports(quantize_dir, report)
    before = read_manifest(quantize_dir)  # PTQ's inputs and parameters, with QAT's added
    inputs = list(dict.fromkeys([*(i["path"] for i in before["inputs"]), str(qat_model), *map(str, val.files)]))
    write_manifest(quantize_dir, "quantize", inputs,
                   {**before["params"], "produced_by": report.get("produced_by"), "qat": True,
                    "float_layers": report.get("float_layers", []), "gate_passed": report["gate_passed"]})
    return report
