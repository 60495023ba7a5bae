"""Per-layer INT8 sensitivity: which quantized layers cost the accuracy.

For every quantized layer two real QDQ models are built: only that layer quantized (what the
layer costs on its own) and every layer but that one quantized (what keeping it in float wins
back). The time is bounded twice: the output error (SQNR of the logits against FP32, in dB) is
measured for every layer on a fixed subset of the validation data (the first
`error_samples`), and only the `top_k` layers by error get accuracy runs, on the first
`accuracy_samples`. On 2 cores that is about 1.5 s per layer for MobileNetV2 at 96 px.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from appliance.core.progress import Progress
from appliance.deploy.int8_builder import Int8Builder, Layer, Recipe
from appliance.deploy.onnx_model import ort_session, run_ort
from appliance.deploy.options import ERROR_SAMPLES

ACCURACY_SAMPLES, TOP_K = 256, 8
SQNR_CAP_DB = 150.0  # identical outputs: a finite number JSON can hold


def sqnr_db(reference: np.ndarray, quantized: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio of quantized against reference, in dB (higher is better)."""
    signal = float(np.sum(reference.astype(np.float64) ** 2))
    noise = float(np.sum((reference.astype(np.float64) - quantized) ** 2))
    if noise <= signal * 10 ** (-SQNR_CAP_DB / 10):
        return SQNR_CAP_DB
    return 10 * float(np.log10(max(signal, 1e-30) / noise))


def measure_sensitivity(builder: Int8Builder, recipe: Recipe, layers: list[Layer], fp32_logits: np.ndarray,
                        x: np.ndarray, y: np.ndarray, work: Path, *, error_samples: int = ERROR_SAMPLES,
                        accuracy_samples: int = ACCURACY_SAMPLES, top_k: int = TOP_K, score=None) -> dict:
    """The sensitivity section of accuracy.json: every layer ranked, most harmful first.

    fp32_logits: the FP32 model's logits on x (the validation tensors, y their labels). score(outputs, y):
    the task's metric (default top-1; a detector's mAP@.5), what the "top1_*" figures then hold."""
    score = score or (lambda outputs, labels: float((outputs.argmax(1) == labels).mean()))
    start = time.monotonic()
    ex, ref = x[:error_samples], fp32_logits[:error_samples]
    ax, ay = x[:accuracy_samples], y[:accuracy_samples]
    path = work / "sensitivity.onnx"
    rows = []
    with Progress(total=len(layers), desc="sensitivity: output error per layer", unit="layer") as bar:
        for layer in layers:
            alone = _logits(builder.build(path, recipe, only=(layer.name,)), ex)
            floated = _logits(builder.build(path, replace(recipe, float_layers=(layer.name,))), ex)
            rows.append({"layer": layer.name, "op_type": layer.op_type, "weight_elements": layer.weight_elements,
                         "sqnr_db_only_this_quantized": sqnr_db(ref, alone),
                         "sqnr_db_all_but_this_quantized": sqnr_db(ref, floated)})
            bar.update()
    every = _logits(builder.build(path, recipe), ex)
    all_sqnr = sqnr_db(ref, every)
    for row in rows:
        row["sqnr_gain_db_in_float"] = row["sqnr_db_all_but_this_quantized"] - all_sqnr
    # Most harmful first: the error the layer makes on its own (telling even when the whole model is
    # broken by several layers at once, where no single float layer wins much back), then what
    # keeping it in float wins back.
    rows.sort(key=lambda r: (r["sqnr_db_only_this_quantized"], -r["sqnr_gain_db_in_float"]))
    error_seconds = time.monotonic() - start
    with Progress(total=min(top_k, len(rows)), desc="sensitivity: accuracy of the top layers", unit="layer") as bar:
        for row in rows[:top_k]:
            row["top1_only_this_quantized"] = score(_logits(builder.build(path, recipe, only=(row["layer"],)), ax), ay)
            row["top1_all_but_this_quantized"] = score(
                _logits(builder.build(path, replace(recipe, float_layers=(row["layer"],))), ax), ay)
            bar.update()
    all_top1 = score(_logits(builder.build(path, recipe), ax), ay)
    path.unlink(missing_ok=True)
    for rank, row in enumerate(rows, 1):
        row["rank"] = rank
        row["error_percent_only_this_quantized"] = 100 * 10 ** (-row["sqnr_db_only_this_quantized"] / 10)
    return {"recipe": recipe.label(), "layers": len(rows), "error_samples": int(len(ex)),
            "bound": f"{2 * len(rows)} models run on {len(ex)} samples, then {2 * min(top_k, len(rows))} on {len(ax)}",
            "accuracy_samples": int(len(ax)), "top_k": min(top_k, len(rows)),
            "sqnr_db_all_quantized": all_sqnr, "top1_all_quantized": all_top1,
            "top1_fp32": score(fp32_logits[:accuracy_samples], ay),
            "error_seconds": round(error_seconds, 2), "seconds": round(time.monotonic() - start, 2),
            "ranking": rows}


def float_order(sensitivity: dict) -> list[str]:
    """Layers in the order fallback keeps them in float: the top-k by the accuracy they cost on their
    own, then by what keeping them in float wins back; then the rest by output error."""
    ranked = sensitivity["ranking"]
    measured = [r for r in ranked if "top1_all_but_this_quantized" in r]
    measured.sort(key=lambda r: (r["top1_only_this_quantized"], -r["top1_all_but_this_quantized"],
                                 r["sqnr_db_only_this_quantized"]))
    return [r["layer"] for r in measured] + [r["layer"] for r in ranked if "top1_all_but_this_quantized" not in r]


def _logits(model_path: Path, x: np.ndarray) -> np.ndarray:
    return run_ort(ort_session(model_path), x, batch=64)

