"""FP32 vs quantized on the validation set: accuracy.json and a self-contained accuracy.html."""

from __future__ import annotations

import html
import json
import statistics
import time
from pathlib import Path

import numpy as np

from appliance.deploy.onnx_model import run_ort
from appliance.core.html_report import bars_svg, page
from appliance.core.manifest import atomic_write_text


def evaluate(session, x: np.ndarray, y: np.ndarray) -> dict:
    """Predictions, top-1 and median single-sample latency of an onnxruntime session."""
    logits = run_ort(session, x, batch=64)
    name = session.get_inputs()[0].name
    dtype = np.float16 if "float16" in session.get_inputs()[0].type else np.float32
    one = {name: x[:1].astype(dtype)}
    for _ in range(3):
        session.run(None, one)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        session.run(None, one)
        times.append((time.perf_counter() - start) * 1000)
    return {"predictions": logits.argmax(1), "top1": float((logits.argmax(1) == y).mean()),
            "latency_ms_median": statistics.median(times)}


def compare(fp32_path, quant_path, fp32: dict, quant: dict, mode: str, samples: int, max_drop: float) -> dict:
    drop = (fp32["top1"] - quant["top1"]) * 100
    return {
        "made_by": "appliance quantize", "mode": mode, "validation_samples": samples,
        "fp32": {"model": str(fp32_path), "top1": fp32["top1"], "bytes": Path(fp32_path).stat().st_size,
                 "latency_ms_median": fp32["latency_ms_median"]},
        "quantized": {"model": str(quant_path), "top1": quant["top1"], "bytes": Path(quant_path).stat().st_size,
                      "latency_ms_median": quant["latency_ms_median"]},
        "top1_drop_points": drop,
        "prediction_agreement": float((fp32["predictions"] == quant["predictions"]).mean()),
        "size_ratio": Path(quant_path).stat().st_size / Path(fp32_path).stat().st_size,
        "latency_ratio": quant["latency_ms_median"] / fp32["latency_ms_median"],
        "max_drop_points": max_drop, "gate_passed": bool(drop <= max_drop),
    }


def write_reports(out_dir: Path, report: dict) -> None:
    atomic_write_text(out_dir / "accuracy.json", json.dumps(report, indent=2) + "\n")
    q, f, mode = report["quantized"], report["fp32"], report["mode"].upper()
    charts = "".join([
        bars_svg("Top-1 accuracy", "%", [("FP32", f["top1"] * 100), (mode, q["top1"] * 100)], "{:.2f}"),
        bars_svg("Model size", "MB", [("FP32", f["bytes"] / 1e6), (mode, q["bytes"] / 1e6)], "{:.3f}"),
        bars_svg("Host latency (median, batch 1)", "ms", [("FP32", f["latency_ms_median"]),
                                                       (mode, q["latency_ms_median"])], "{:.3f}"),
    ])
    body = f"""<p>Top-1 drop {report['top1_drop_points']:.2f} points (allowed {report['max_drop_points']:.2f}) on
{report['validation_samples']} validation samples; predictions agree on {report['prediction_agreement'] * 100:.2f}%.</p>
<table><tr><th></th><th>top-1</th><th>size</th><th>latency (median)</th><th>model</th></tr>
<tr><td>FP32</td><td>{f['top1'] * 100:.2f}%</td><td>{f['bytes']:,} B</td><td>{f['latency_ms_median']:.3f} ms</td><td>{html.escape(f['model'])}</td></tr>
<tr><td>{mode}</td><td>{q['top1'] * 100:.2f}%</td><td>{q['bytes']:,} B</td><td>{q['latency_ms_median']:.3f} ms</td><td>{html.escape(q['model'])}</td></tr>
</table>{charts}"""
    page_html = page(f"FP32 vs {mode}", "appliance quantize", "accuracy.json", report["gate_passed"], body)
    atomic_write_text(out_dir / "accuracy.html", page_html)
