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

ACCURACY_JSON = "accuracy.json"  # the quantize stage's record (and each GPU build's accuracy report)
ACCURACY_HTML = "accuracy.html"

SENSITIVITY_CHART_ROWS = 20


def evaluate(session, x: np.ndarray, y: np.ndarray, task=None) -> dict:
    """Predictions, the task's metric (top-1, or mIoU of a segmentation model: `task.metric` names it)
    and median single-sample latency of an onnxruntime session."""
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
    metric = task.metric if task is not None else "top1"
    score = task.score(logits, y) if task is not None else float((logits.argmax(1) == y).mean())
    return {"predictions": logits.argmax(1), "logits": logits, metric: score,
            "latency_ms_median": statistics.median(times)}


def compare(fp32_path, quant_path, fp32: dict, quant: dict, mode: str, samples: int, max_drop: float,
            task=None) -> dict:
    """The report's figures; a classification report keeps exactly its keys (top1, top1_drop_points),
    a segmentation one names its metric (miou, miou_drop_points) and says so in `metric`."""
    m = task.metric if task is not None else "top1"
    drop = (fp32[m] - quant[m]) * 100
    named = {} if m == "top1" else {"task": task.kind, "metric": m, "metric_label": task.metric_label}
    return {
        "made_by": "appliance quantize", "mode": mode, **named, "validation_samples": samples,
        "fp32": {"model": str(fp32_path), m: fp32[m], "bytes": Path(fp32_path).stat().st_size,
                 "latency_ms_median": fp32["latency_ms_median"]},
        "quantized": {"model": str(quant_path), m: quant[m], "bytes": Path(quant_path).stat().st_size,
                      "latency_ms_median": quant["latency_ms_median"]},
        f"{m}_drop_points": drop,
        "prediction_agreement": float((fp32["predictions"] == quant["predictions"]).mean()),
        "size_ratio": Path(quant_path).stat().st_size / Path(fp32_path).stat().st_size,
        "latency_ratio": quant["latency_ms_median"] / fp32["latency_ms_median"],
        "max_drop_points": max_drop, "gate_passed": bool(drop <= max_drop),
    }


def write_reports(out_dir: Path, report: dict) -> None:
    atomic_write_text(out_dir / ACCURACY_JSON, json.dumps(report, indent=2) + "\n")
    q, f, mode = report["quantized"], report["fp32"], report["mode"].upper()
    m, label = report.get("metric", "top1"), report.get("metric_label", "top-1")
    charts = "".join([
        bars_svg("Top-1 accuracy" if m == "top1" else label, "%", [("FP32", f[m] * 100), (mode, q[m] * 100)],
                 "{:.2f}"),
        bars_svg("Model size", "MB", [("FP32", f["bytes"] / 1e6), (mode, q["bytes"] / 1e6)], "{:.3f}"),
        bars_svg("Host latency (median, batch 1)", "ms", [("FP32", f["latency_ms_median"]),
                                                       (mode, q["latency_ms_median"])], "{:.3f}"),
    ])
    body = f"""<p>{label[0].upper() + label[1:]} drop {report[f'{m}_drop_points']:.2f} points (allowed {report['max_drop_points']:.2f}) on
{report['validation_samples']} validation samples; predictions agree on {report['prediction_agreement'] * 100:.2f}%{' of the pixels' * (m != 'top1')}.</p>
<table><tr><th></th><th>{label}</th><th>size</th><th>latency (median)</th><th>model</th></tr>
<tr><td>FP32</td><td>{f[m] * 100:.2f}%</td><td>{f['bytes']:,} B</td><td>{f['latency_ms_median']:.3f} ms</td><td>{html.escape(f['model'])}</td></tr>
<tr><td>{mode}</td><td>{q[m] * 100:.2f}%</td><td>{q['bytes']:,} B</td><td>{q['latency_ms_median']:.3f} ms</td><td>{html.escape(q['model'])}</td></tr>
</table>{charts}{_engines_html(report)}{_qat_html(report)}{_schemes_html(report)}{_fallback_html(report)}{_sensitivity_html(report.get("sensitivity"))}"""
    page_html = page(f"FP32 vs {mode}", "appliance quantize", ACCURACY_JSON, report["gate_passed"], body)
    atomic_write_text(out_dir / ACCURACY_HTML, page_html)


def _engines_html(report: dict) -> str:
    """`--engine nncf`: our quantizer and NNCF side by side (drop, layers kept in float, time), and why one failed."""
    rows_in = report.get("engines")
    if not rows_in:
        return ""
    m, label = report.get("metric", "top1"), report.get("metric_label", "top-1")
    rows = "".join(
        f"<tr><td>{html.escape(r['engine'])}</td><td>{html.escape(r['step'])}</td><td>{r[m] * 100:.2f}%</td>"
        f"<td>{r[f'{m}_drop_points']:.2f}</td><td>{len(r['float_layers'])}"
        f"{': ' + html.escape(', '.join(r['float_layers'])) if r['float_layers'] else ''}</td><td>{r['seconds']:.1f} s</td>"
        f"<td>{r['bytes']:,} B</td><td>{r['latency_ms_median']:.3f} ms</td><td class=\"{'PASS' if r['passed'] else 'FAIL'}\">"
        f"{'PASS' if r['passed'] else 'FAIL: ' + html.escape(r.get('why', ''))}</td></tr>" for r in rows_in)
    chart = bars_svg(f"{label} drop per engine", "points", [(r["engine"], r[f"{m}_drop_points"]) for r in rows_in],
                     "{:.2f}")
    return (f"<h2>Quantizers side by side: NNCF ships</h2><p>Both engines on the same calibration and validation "
            f"samples, under the same --max-drop {report['max_drop_points']:g}.</p>"
            f"<table><tr><th>engine</th><th>made by</th><th>{label}</th><th>drop (points)</th><th>layers in float</th>"
            f"<th>time</th><th>size</th><th>latency (median)</th><th></th></tr>{rows}</table>{chart}")


def _qat_html(report: dict) -> str:
    """FP32, PTQ (with fallback if it ran) and QAT side by side, once quantization-aware training ran."""
    qat, ptq, f = report.get("qat"), report.get("ptq"), report["fp32"]
    if not qat or not ptq:
        return ""
    m, label = report.get("metric", "top1"), report.get("metric_label", "top-1")
    ptq_name = f"PTQ ({ptq.get('produced_by') or 'ptq'})"
    rows = [("FP32", f[m], 0.0, f["bytes"], f["latency_ms_median"]),
            (ptq_name, ptq[m], ptq[f"{m}_drop_points"], ptq["bytes"], ptq["latency_ms_median"]),
            ("QAT", qat[m], qat[f"{m}_drop_points"], qat["bytes"], qat["latency_ms_median"])]
    table = "".join(f"<tr><td>{html.escape(name)}</td><td>{top1 * 100:.2f}%</td><td>{drop:.2f}</td><td>{size:,} B</td>"
                    f"<td>{ms:.3f} ms</td></tr>" for name, top1, drop, size, ms in rows)
    chart = bars_svg(f"{label}: FP32, PTQ, QAT", "%", [(name, top1 * 100) for name, top1, *_ in rows], "{:.2f}")
    return (f"<h2>FP32, PTQ and QAT side by side</h2><p>The edge model is the {html.escape(report.get('produced_by', ''))}"
            f" one. QAT: fine-tuned with fake quantization in {html.escape(str(qat.get('run_dir')))}, exported as QDQ "
            f"with the scales training learnt; evaluated on the same {qat['validation_samples']} validation samples.</p>"
            f"<table><tr><th></th><th>{label}</th><th>drop (points)</th><th>size</th><th>latency (median)</th></tr>"
            f"{table}</table>{chart}")


def _schemes_html(report: dict) -> str:
    """FP32 / INT8 symmetric / INT8 asymmetric side by side (segmentation), as the source document's table."""
    rows_in = report.get("schemes")
    if not rows_in:
        return ""
    m, label = report["metric"], report["metric_label"]
    rows = "".join(
        f"<tr><td>{html.escape(r['scheme'])}</td><td>{r[m] * 100:.2f}%</td>"
        f"<td>{'' if r['scheme'] == 'FP32' else format(r[f'{m}_drop_points'], '.2f')}</td><td>{r['bytes']:,} B</td>"
        f"<td>{r['latency_ms_median']:.3f} ms</td></tr>" for r in rows_in)
    charts = "".join([
        bars_svg(f"{label} per scheme", "%", [(r["scheme"], r[m] * 100) for r in rows_in], "{:.2f}"),
        bars_svg("Host latency per scheme (median, batch 1)", "ms",
                 [(r["scheme"], r["latency_ms_median"]) for r in rows_in], "{:.3f}")])
    return (f"<h2>Activation schemes: kept {html.escape(report.get('activation_scheme', ''))}</h2>"
            f"<p>Both all-INT8 models measured on the same validation set; the one with the higher {label} is kept "
            "(a tie keeps asymmetric, onnxruntime's default).</p>"
            f"<table><tr><th>model</th><th>{label}</th><th>drop (points)</th><th>size</th><th>latency (median)</th></tr>"
            f"{rows}</table>{charts}")


def _fallback_html(report: dict) -> str:
    fallback = report.get("fallback")
    if not fallback:
        return ""
    m = report.get("metric", "top1")
    rows = "".join(
        f"<tr><td>{html.escape(a['step'])}</td><td>{html.escape(a['recipe'])}</td><td>{a[m] * 100:.2f}%</td>"
        f"<td>{a[f'{m}_drop_points']:.2f}</td><td>{'yes' if a['passed'] else 'no'}</td><td>{a['bytes']:,} B</td>"
        f"<td>{a['latency_ms_median']:.3f} ms</td></tr>" for a in fallback["attempts"])
    floats = report.get("float_layers") or []
    cost = fallback.get("cost")
    kept = ""
    if floats and cost:
        kept = (f"<p>Kept in float ({len(floats)}): " + ", ".join(f"<code>{html.escape(n)}</code>" for n in floats)
                + f". They cost {cost['extra_bytes']:,} B more than the all-INT8 model ({cost['all_int8_bytes']:,} B) "
                f"and host latency x{cost['latency_ratio']:.2f} ({cost['all_int8_latency_ms_median']:.3f} -> "
                f"{cost['latency_ms_median']:.3f} ms).</p>")
    return (f"<h2>How the INT8 model was made: {html.escape(report.get('produced_by', ''))}</h2>{kept}"
            f"<p>--fallback {html.escape(fallback['mode'])}, at most {fallback['max_float_layers']} float layers; "
            "every attempt, in order, on the whole validation set:</p>"
            f"<table><tr><th>step</th><th>recipe</th><th>{report.get('metric_label', 'top-1')}</th><th>drop</th>"
            "<th>passed</th><th>size</th>"
            f"<th>latency</th></tr>{rows}</table>")


def _sensitivity_html(sens: dict | None) -> str:
    if not sens:
        return ""
    ranking = sens["ranking"]
    rows = "".join(
        f"<tr><td>{r['rank']}</td><td><code>{html.escape(r['layer'])}</code></td><td>{html.escape(r['op_type'])}</td>"
        f"<td>{r['sqnr_db_only_this_quantized']:.1f}</td><td>{r['sqnr_db_all_but_this_quantized']:.1f}</td>"
        f"<td>{r['sqnr_gain_db_in_float']:+.2f}</td>"
        f"<td>{_pct(r.get('top1_only_this_quantized'))}</td><td>{_pct(r.get('top1_all_but_this_quantized'))}</td></tr>"
        for r in ranking)
    chart = ranked_bars_svg(f"Output error with only this layer quantized, % of the signal (top {SENSITIVITY_CHART_ROWS})",
                            "%", [(r["layer"], r["error_percent_only_this_quantized"])
                                  for r in ranking[:SENSITIVITY_CHART_ROWS]])
    return f"""<h2>Per-layer sensitivity ({sens['layers']} quantized layers, {html.escape(sens['recipe'])})</h2>
<p>Output error (SQNR of the logits against FP32, higher is better) on the first {sens['error_samples']} validation
samples for every layer; top-1 on the first {sens['accuracy_samples']} for the {sens['top_k']} most harmful.
All layers quantized: SQNR {sens['sqnr_db_all_quantized']:.1f} dB, top-1 {sens['top1_all_quantized'] * 100:.2f}%
(FP32 {sens['top1_fp32'] * 100:.2f}%). Measured in {sens['seconds']:.1f} s.</p>{chart}
<table class="num"><tr><th>rank</th><th>layer</th><th>op</th><th>SQNR only this quantized (dB)</th>
<th>SQNR all but this (dB)</th><th>gain in float (dB)</th><th>top-1 only this</th><th>top-1 all but this</th></tr>
{rows}</table>"""


def _pct(value) -> str:
    return "" if value is None else f"{value * 100:.2f}%"


def ranked_bars_svg(title: str, unit: str, values: list[tuple[str, float]]) -> str:
    """Horizontal bars with long labels (layer names, whole), zero at the left edge."""
    return bars_svg(title, unit, values, "{:.3g}", font=11, bar=16, cls="sensitivity")
