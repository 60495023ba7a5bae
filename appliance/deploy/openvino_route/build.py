"""`appliance compile --target openvino`: an FP32 or QDQ INT8 ONNX model -> OpenVINO IR (model.xml and
model.bin), checked against onnxruntime as the TVM host build is, timed on this host under OpenVINO's
LATENCY and THROUGHPUT hints beside onnxruntime; compile.json and the manifest, read back by the one
compile stage result (appliance.deploy.compile.CompileResult).

The check is the TVM build's: onnxruntime with its graph optimisations off (QDQ nodes as written) on
the same tensors, the model's tolerance times max(1, max |logit|), a QDQ model's output steps
(appliance.deploy.tolerance.qdq_allowance), a segmentation model's per-pixel class agreement.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from appliance.deploy.compiler.driver import fixed_dim
from appliance.deploy.compiled import COMPILE_JSON
from appliance.core.errors import DataError
from appliance.core.manifest import atomic_write_text, write_manifest
from appliance.deploy.compiler.passes.int8_arith import output_scale
from appliance.deploy.onnx_model import (default_tolerance, image_input, load_onnx, metadata, ort_session, precision,
                                         run_ort)
from appliance.deploy.openvino_route import COMPILE_TARGET, IR_BIN, IR_XML, RUNTIME, require_openvino
from appliance.deploy.openvino_route.run import INFERENCE_PRECISION, compile_ir, infer, latency, throughput
from appliance.deploy.samples import check_input_shape, load_samples
from appliance.deploy.tolerance import qdq_allowance
from appliance.tasks import task_of_metadata

CHECK_SAMPLES = 32


def compile_openvino(model_path, out_dir, *, sample_files=None, tolerance=None, batch: int = 1,
                     timing_s: float = 1.0, log=print, **_tvm_options) -> dict:
    """Write out_dir/model.xml, model.bin, model.onnx (the reference), compile.json and the manifest;
    returns compile.json's content. DataError (after compile.json is written) when the IR's outputs
    are further from onnxruntime's than allowed. _tvm_options: the TVM route's (device_estimate, ...),
    which mean nothing here."""
    ov = require_openvino(f"{model_path}: --target {COMPILE_TARGET}")
    model_path, out_dir = Path(model_path), Path(out_dir)
    model = load_onnx(model_path)
    inp, meta = image_input(model, model_path), metadata(model)
    tolerance = default_tolerance(precision(model)) if tolerance is None else tolerance
    shape = [batch, *[fixed_dim(d, meta, model_path, inp) for d in inp.shape[1:]]]
    out_dir.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    ir = ov.convert_model(str(model_path))
    ir.reshape({ir.inputs[0].get_any_name(): shape})  # a fixed shape, as the TVM builds have
    ov.save_model(ir, str(out_dir / ".model.xml.tmp.xml"), compress_to_fp16=False)  # float32 weights stay float32
    (out_dir / ".model.xml.tmp.bin").replace(out_dir / IR_BIN)
    (out_dir / ".model.xml.tmp.xml").replace(out_dir / IR_XML)
    seconds = time.perf_counter() - start
    shutil.copyfile(model_path, out_dir / ".model.onnx.tmp")
    (out_dir / ".model.onnx.tmp").replace(out_dir / "model.onnx")  # the reference package and verify compare with

    compiled = compile_ir(out_dir / IR_XML, "LATENCY")
    info = {"made_by": "appliance compile", "source_model": str(model_path.resolve()), "target": COMPILE_TARGET,
            "runtime": RUNTIME, "openvino_version": ov.get_version(), "device": _device_name(ov),
            "input": {"name": inp.name, "shape": shape, "dtype": "float32"}, "precision": precision(model),
            "inference_precision": INFERENCE_PRECISION, "layers": _layers(compiled),
            "library": str(out_dir / IR_XML), "weights": str(out_dir / IR_BIN),
            "library_bytes": (out_dir / IR_XML).stat().st_size + (out_dir / IR_BIN).stat().st_size,
            "compile_seconds": round(seconds, 2), **meta}
    info["check"] = check_against_ort(compiled, model_path, shape, sample_files, meta, tolerance, inp.name)
    log(f"timing the IR under the LATENCY and THROUGHPUT hints and onnxruntime (about {3 * timing_s:.0f} s)")
    info.update(host_figures(out_dir / IR_XML, model_path, shape, timing_s))
    atomic_write_text(out_dir / COMPILE_JSON, json.dumps(info, indent=2) + "\n")
    write_manifest(out_dir, "compile", [model_path, *(Path(f) for f in sample_files or [])],
                   {"target": COMPILE_TARGET, "runtime": RUNTIME, "openvino_version": info["openvino_version"],
                    "input_shape": shape, "tolerance": tolerance, "inference_precision": INFERENCE_PRECISION})
    c = info["check"]
    if not c["passed"]:
        pixels = (f", class maps agree on {c['pixel_agreement'] * 100:.2f}% of the pixels (need "
                  f"{c['min_pixel_agreement'] * 100:.1f}%)" if "pixel_agreement" in c else "")
        raise DataError(f"{out_dir / IR_XML}: OpenVINO output differs from onnxruntime by {c['max_abs_diff']:.3g} "
                        f"(allowed {c['allowed']:.3g}){pixels}; see {out_dir / COMPILE_JSON}")
    return info


def check_against_ort(compiled, model_path: Path, shape: list, sample_files, meta: dict, tolerance: float,
                      input_name: str) -> dict:
    """The IR's outputs against onnxruntime's (optimisations off) on the validation samples (else 8
    seeded random tensors): the figures and gate of the TVM host build's check (compiler/check.py)."""
    if sample_files:
        samples = load_samples(sample_files, meta.get("preprocessing", {}), limit=CHECK_SAMPLES)
        check_input_shape(samples, shape, input_name, model_path)
        x = samples.x
    else:
        x = np.random.default_rng(0).standard_normal((8, *shape[1:])).astype(np.float32)
    got = infer(compiled, x)
    expected = run_ort(ort_session(model_path, optimize=False), x)
    diff = float(np.abs(got.astype(np.float64) - expected).max())
    allowed = max(tolerance * max(1.0, float(np.abs(expected).max())), qdq_allowance(model_path))
    step = output_scale(load_onnx(model_path))
    result = {"samples": int(len(x)), "max_abs_diff": diff, "allowed": allowed,
              "max_quantized_units": diff / step if step else None, "reference": "onnxruntime (optimisations off)",
              "top1_agreement": float((got.argmax(1) == expected.argmax(1)).mean()), "passed": diff <= allowed}
    task = task_of_metadata(meta)
    if task.kind == "segmentation":
        agreement = task.agreement(got, expected)
        result.update({"task": task.kind, "pixel_agreement": agreement, "min_pixel_agreement": task.min_agreement,
                       "passed": result["passed"] and agreement >= task.min_agreement})
    return result


def host_figures(xml: Path, model_path: Path, shape: list, timing_s: float) -> dict:
    """host_latency_ms (LATENCY hint), `hints` (both hints' figures) and onnxruntime's latency on the
    same input, so compile.json says whether the IR is the faster runtime on this host."""
    hints = {"LATENCY": latency(compile_ir(xml, "LATENCY"), runs=50, budget_s=timing_s)}
    tp = compile_ir(xml, "THROUGHPUT")
    hints["THROUGHPUT"] = {**latency(tp, runs=50, budget_s=timing_s / 2), "throughput": throughput(tp, timing_s / 2)}
    session, x = ort_session(model_path), np.zeros(shape, np.float32)
    name = session.get_inputs()[0].name
    session.run(None, {name: x})
    times, start = [], time.perf_counter()
    while len(times) < 50 and (len(times) < 3 or time.perf_counter() - start < timing_s):
        t = time.perf_counter()
        session.run(None, {name: x})
        times.append((time.perf_counter() - t) * 1000)
    ort_ms = round(float(np.median(times)), 4)
    ov_ms = hints["LATENCY"]["median_ms"]
    return {"host_latency_ms": ov_ms, "hints": hints, "onnxruntime_latency_ms": ort_ms,
            "faster_on_this_host": "openvino" if ov_ms <= ort_ms else "onnxruntime"}


def _layers(compiled) -> dict:
    """How the CPU plugin runs the graph: operations by runtime precision (i8/u8: int8 arithmetic)."""
    counts: dict = {}
    for op in compiled.get_runtime_model().get_ops():
        rt = op.get_rt_info()
        if "runtimePrecision" in rt and op.get_type_name() not in ("Parameter", "Result", "Constant"):
            key = str(rt["runtimePrecision"].astype(str))
            counts[key] = counts.get(key, 0) + 1
    return {"by_runtime_precision": dict(sorted(counts.items())),
            "int8": counts.get("i8", 0) + counts.get("u8", 0), "fp32": counts.get("f32", 0)}


def _device_name(ov) -> str:
    try:
        return str(ov.Core().get_property("CPU", "FULL_DEVICE_NAME"))
    except RuntimeError:
        return "CPU"



def summary_line(info: dict) -> str:
    """What `appliance compile --target openvino` prints."""
    c, hints = info["check"], info["hints"]
    agreement = (f"pixel agreement {c['pixel_agreement']:.4f}" if "pixel_agreement" in c
                 else f"top-1 agreement {c['top1_agreement']:.4f}")
    steps = f" ({c['max_quantized_units']:.2f} output steps)" if c.get("max_quantized_units") is not None else ""
    return (f"wrote {info['library']} (OpenVINO {info['openvino_version'].split('-')[0]} IR, "
            f"{info['library_bytes'] / 1e6:.2f} MB, {info['layers']['int8']} int8 / {info['layers']['fp32']} fp32 "
            f"operations) in {info['compile_seconds']:.1f} s; vs onnxruntime on {c['samples']} samples: max abs diff "
            f"{c['max_abs_diff']:.3g}{steps}, {agreement}; on {info['device']}: LATENCY hint "
            f"{hints['LATENCY']['median_ms']:.3f} ms, THROUGHPUT hint {hints['THROUGHPUT']['throughput']['inferences_per_s']:.1f}"
            f" inferences/s ({hints['THROUGHPUT']['throughput']['streams']} streams), onnxruntime "
            f"{info['onnxruntime_latency_ms']:.3f} ms")
