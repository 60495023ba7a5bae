"""`appliance quantize`: FP32 ONNX -> INT8 (onnxruntime static QDQ) or FP16, gated on top-1 drop.

INT8 is S8S8 QDQ by default: onnxruntime's U8S8 kernels saturate on AVX2 CPUs without VNNI
(measured up to 7.7 % output error) unless weights use 7 bits (`--scheme u8s8`, reduce_range),
and QDQ is the form TVM can import. Calibration and evaluation tensors go
through the same preprocessing as export and the edge runner.

When the INT8 model drops more than --max-drop, `--fallback auto` (the default) looks for one that
does not (appliance.deploy.fallback): per-channel weights and other calibrations first, then the
most sensitive layers kept in float. Per-layer sensitivity (appliance.deploy.sensitivity) goes
into the report either way unless switched off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from appliance.core.errors import DataError, GateFailed
from appliance.core.manifest import write_manifest
from appliance.deploy.accuracy_report import ACCURACY_HTML, ACCURACY_JSON, compare, evaluate, write_reports
from appliance.deploy.fallback import Attempt, find_passing
from appliance.deploy.int8_builder import METHODS, CalibrationSet, Int8Builder, Recipe, quantized_layers
from appliance.deploy.onnx_model import image_input, load_onnx, metadata, ort_session, quantize_fp16
from appliance.deploy.nncf_engine import nncf_int8, ours_row, require_nncf
from appliance.deploy.options import ENGINES, FALLBACKS, MAX_FLOAT_LAYERS, SCHEMES
from appliance.deploy.samples import check_input_shape, load_samples
from appliance.deploy.sensitivity import ERROR_SAMPLES, measure_sensitivity
from appliance.core.stage import Figures, flat_figures, read_result_json
from appliance.tasks import task_of_metadata


__all__ = ["METHODS", "SCHEMES", "FALLBACKS", "MAX_FLOAT_LAYERS", "ERROR_SAMPLES", "CalibrationSet", "quantize_model", "quantize_int8", "quantize_fp16"]


def quantize_int8(model_path: Path, out_path: Path, calib_x, input_name: str, method: str, per_channel: bool,
                  scheme: str = "s8s8", float_layers: tuple[str, ...] = ()):
    """One INT8 QDQ model; float_layers: node names kept in float."""
    with Int8Builder(Path(model_path), calib_x, input_name, scheme) as builder:
        builder.build(Path(out_path), Recipe(method, per_channel, tuple(float_layers)))


def quantize_model(model_path, calib_files, out_dir, *, val_files=None, mode="int8", method="minmax",
                   per_channel=False, scheme="s8s8", calib_samples=128, val_samples=1000, max_drop=1.0,
                   fallback="auto", max_float_layers=MAX_FLOAT_LAYERS, sensitivity=True,
                   sensitivity_samples=ERROR_SAMPLES, engine="ours") -> dict:
    """Quantize, evaluate, write accuracy.json/.html and the manifest; the report says whether the gate passed.

    The gate counts the model's task metric (its ONNX model card): top-1 points for classification,
    mIoU points for segmentation, where the symmetric and asymmetric activation schemes are both
    built and the better one is kept. engine "nncf": NNCF's INT8 ships (nncf_engine.py), ours is run
    beside it for the report's `engines` rows."""
    import onnx

    if engine not in ENGINES:
        raise DataError(f"{model_path}: --engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    if engine == "nncf" and mode == "int8":
        require_nncf(str(model_path))  # before minutes of calibration
    model_path, out_dir = Path(model_path), Path(out_dir)
    model = load_onnx(model_path)
    inp = image_input(model, model_path)
    task = task_of_metadata(metadata(model))
    preprocessing = metadata(model).get("preprocessing", {})
    calib = load_samples(calib_files, preprocessing, limit=calib_samples)
    check_input_shape(calib, inp.shape, inp.name, model_path)
    val = load_samples(val_files or calib_files, preprocessing, limit=val_samples)
    check_input_shape(val, inp.shape, inp.name, model_path)
    if val.y is None:
        raise DataError(f"{val.files[0]}: validation data has no labels (need image/class/label, or 'y' in the .npz)")

    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / f"model.{mode}.onnx"
    tmp = out_dir / f".model.{mode}.onnx.tmp"
    fp32 = evaluate(ort_session(model_path), val.x, val.y, task)
    clamped, extra = 0, {}
    if mode == "int8":
        start = time.perf_counter()
        chosen, extra = _int8(model_path, tmp, calib.x, val, inp.name, fp32, scheme, Recipe(method, per_channel),
                              max_drop, fallback, max_float_layers, sensitivity, sensitivity_samples, task)
        method, per_channel = chosen.recipe.method, chosen.recipe.per_channel
        if engine == "nncf":  # ours measured, then NNCF's model written over it: NNCF's ships
            ours = ours_row(tmp, extra, time.perf_counter() - start, fp32, val, task, max_drop)
            theirs = nncf_int8(model_path, tmp, calib.x, val, inp.name, fp32, task, max_drop, fallback,
                               max_float_layers)
            extra = {"engine": "nncf", "engines": [ours, theirs], "ours": extra,
                     "produced_by": f"nncf {theirs['step']}" if theirs["passed"] else "none (gate failed)",
                     "float_layers": theirs["float_layers"]}
            method, per_channel, scheme = "nncf", True, "nncf"
    else:
        clamped = quantize_fp16(model, tmp)
    quantized = onnx.load(str(tmp))
    del quantized.metadata_props[:]
    quantized.metadata_props.extend(model.metadata_props)  # preprocessing and class names travel on
    quantized.producer_name = f"appliance quantize --mode {mode}"
    onnx.save(quantized, str(tmp))
    tmp.replace(out_path)

    report = compare(model_path, out_path, fp32, evaluate(ort_session(out_path), val.x, val.y, task), mode,
                     len(val.x), max_drop, task)
    report.update({"method": method if mode == "int8" else None, "per_channel": per_channel,
                   "format": _format(mode, scheme),
                   "calibration_samples": int(len(calib.x)), "fp16_clamped_weight_warnings": clamped,
                   "validation_source": "calibration data (no --val given)" if not val_files else "--val", **extra})
    if mode == "int8" and task.compare_schemes and engine == "ours":
        report["activation_scheme"] = "symmetric" if chosen.recipe.symmetric_activations else "asymmetric"
    write_reports(out_dir, report)
    write_manifest(out_dir, "quantize", [model_path, *calib.files, *(val.files if val_files else [])],
                   {"mode": mode, "method": method, "per_channel": per_channel, "scheme": scheme, "calib_samples": calib_samples,
                    "max_drop": max_drop, "fallback": fallback if mode == "int8" else None,
                    "float_layers": extra.get("float_layers", []), "produced_by": extra.get("produced_by"),
                    "gate_passed": report["gate_passed"], **({"engine": engine} if engine != "ours" else {})})
    return report


def _format(mode: str, scheme: str) -> str:
    if mode != "int8":
        return "float16, float32 inputs/outputs"
    if scheme == "nncf":
        return "QDQ (NNCF: int8 weights per channel, int8/uint8 activations)"
    return f"QDQ {scheme.upper()}{' reduce_range' if scheme == 'u8s8' else ''}"


def _int8(model_path, out_path, calib_x, val, input_name, fp32, scheme, asked: Recipe, max_drop, fallback,
          max_float_layers, sensitivity, sensitivity_samples, task) -> tuple[Attempt, dict]:
    """(the attempt written to out_path, the report's INT8 sections: path taken, attempts, sensitivity).

    An Attempt's `top1` holds the task's metric (mIoU for segmentation); the report's rows name it."""
    candidate = out_path.with_name(".candidate.onnx")
    metric = task.metric

    def attempt(recipe: Recipe, step: str) -> Attempt:
        builder.build(candidate, recipe)
        result = evaluate(ort_session(candidate), val.x, val.y, task)
        drop = (fp32[metric] - result[metric]) * 100
        return Attempt(recipe, step, result[metric], drop, drop <= max_drop, candidate.stat().st_size,
                       result["latency_ms_median"], result)

    def measure(recipe: Recipe) -> dict:
        builder.build(candidate, recipe)
        layers = quantized_layers(load_onnx(candidate))
        return measure_sensitivity(builder, recipe, layers, fp32["logits"], val.x, val.y, out_path.parent,
                                   error_samples=sensitivity_samples,
                                   score=task.score if task.kind == "detection" else None)

    with Int8Builder(model_path, calib_x, input_name, scheme) as builder:
        try:
            first, schemes = attempt(asked, "ptq"), []
            if task.compare_schemes:  # the source's table: FP32, INT8 symmetric, INT8 asymmetric side by side
                symmetric = attempt(replace(asked, symmetric_activations=True), "ptq")
                schemes = [symmetric, first]
                first = max(schemes, key=lambda a: (a.top1, a is first))  # a tie keeps the default (asymmetric)
            chosen, attempts, sens = first, schemes or [first], None
            if not first.passed and fallback == "auto":
                chosen, attempts, sens = find_passing(first, attempt, measure, max_float_layers)
            elif sensitivity:
                sens = measure(first.recipe)
            builder.build(out_path, chosen.recipe)
        finally:
            candidate.unlink(missing_ok=True)
    extra = {"produced_by": chosen.step if chosen.passed else "none (gate failed)",
             "fallback": {"mode": fallback, "max_float_layers": max_float_layers,
                          "attempts": [_named(a.row(), metric) for a in attempts]},
             "float_layers": list(chosen.recipe.float_layers)}
    if schemes:
        extra["schemes"] = scheme_rows(fp32, schemes, model_path, metric)
    if chosen.recipe.float_layers:
        base = next(a for a in attempts if a.recipe == replace_floats(chosen.recipe))
        ranking = {r["layer"]: r for r in sens["ranking"]}
        extra["fallback"]["cost"] = {
            "all_int8_bytes": base.bytes, "bytes": chosen.bytes, "extra_bytes": chosen.bytes - base.bytes,
            "all_int8_latency_ms_median": base.latency_ms_median, "latency_ms_median": chosen.latency_ms_median,
            "latency_ratio": chosen.latency_ms_median / base.latency_ms_median,
            "layers": [{"layer": name, "op_type": ranking[name]["op_type"],
                        "extra_weight_bytes": 3 * ranking[name]["weight_elements"]}
                       for name in chosen.recipe.float_layers]}
    if sens is not None:
        extra["sensitivity"] = sens
    return chosen, extra


def replace_floats(recipe: Recipe) -> Recipe:
    return replace(recipe, float_layers=())


def _named(row: dict, metric: str) -> dict:
    """An attempt's row with its metric under the metric's name (top1 stays top1)."""
    return row if metric == "top1" else {k.replace("top1", metric): v for k, v in row.items()}


def scheme_rows(fp32: dict, schemes: list[Attempt], model_path: Path, metric: str) -> list[dict]:
    """FP32 and the all-INT8 model per activation scheme: metric, size, host latency (batch 1)."""
    rows = [{"scheme": "FP32", metric: fp32[metric], "bytes": Path(model_path).stat().st_size,
             "latency_ms_median": fp32["latency_ms_median"]}]
    for a in schemes:
        rows.append({"scheme": f"INT8 {'symmetric' if a.recipe.symmetric_activations else 'asymmetric'}",
                     metric: a.top1, f"{metric}_drop_points": a.drop_points, "passed": a.passed, "bytes": a.bytes,
                     "latency_ms_median": a.latency_ms_median, "recipe": a.recipe.label()})
    return rows


@dataclass(frozen=True)
class QuantizeResult:
    out_dir: Path
    model: Path
    mode: str
    report: dict

    @property
    def gate_passed(self) -> bool:
        return bool(self.report["gate_passed"])

    @classmethod
    def load(cls, out_dir: Path) -> "QuantizeResult":
        out_dir = Path(out_dir)
        report = read_result_json(out_dir / ACCURACY_JSON)
        return cls(out_dir, Path(report["quantized"]["model"]), report["mode"], report)

    @property
    def html(self) -> Path:
        return self.out_dir / ACCURACY_HTML

    def figures(self) -> Figures:
        """The model the edge gets and accuracy.json flat ("fp32.top1", "quantized.top1", "top1_drop_points", ...)."""
        return {"model": str(self.model), **flat_figures(self.report)}


def quantize_stage(model: Path, calib_files, val_files, out_dir: Path, *, mode: str, method: str,
                   per_channel: bool, calib_samples: int, max_drop: float, scheme: str = "s8s8",
                   val_samples: int = 1_000_000, on_result=None, fallback: str = "auto",
                   max_float_layers: int = 10, **options) -> QuantizeResult:
    """Quantize, then measure on val_files (default: calib_files); GateFailed when the task's metric (top-1,
    or mIoU for segmentation) drops more than max_drop points (after --fallback auto found no INT8 model
    within it). on_result(result) is called before the gate is applied (the CLI prints it)."""
    quantize_model(model, list(calib_files), out_dir, val_files=list(val_files) if val_files else None, mode=mode,
                   method=method, per_channel=per_channel, scheme=scheme, calib_samples=calib_samples,
                   val_samples=val_samples, max_drop=max_drop, fallback=fallback, max_float_layers=max_float_layers,
                   **options)
    result = QuantizeResult.load(out_dir)
    if on_result is not None:
        on_result(result)
    if not result.gate_passed:
        metric = result.report.get("metric", "top1")
        raise GateFailed(f"{result.model}: {mode} {result.report.get('metric_label', 'top-1')} dropped "
                         f"{result.report[f'{metric}_drop_points']:.2f} points, "
                         f"more than --max-drop {max_drop:g} (see {result.html})")
    return result
