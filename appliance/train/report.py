"""RUN_DIR/report.html and its JSON twin report.json: the training curves and the last
validation's confusion matrix, written by rank 0 at the end of a run.

Everything comes from metrics.jsonl, so a resumed run's report covers the whole run: a step
logged twice (by a lost attempt and by the attempt that resumed it) counts once, the later line.
Plain HTML with inline SVG, no script, so it opens offline in any browser.
"""

from __future__ import annotations

import html
import json
import math
from datetime import datetime, timezone
from pathlib import Path

from appliance.train.metrics import class_names, per_class
from appliance.core.html_report import page
from appliance.train.result import METRICS_NAME

REPORT_HTML, REPORT_JSON = "report.html", "report.json"
MADE_BY = "appliance train (appliance/train/report.py); remake with a finished run's metrics.jsonl"
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")
TRAIN_CURVES = ("loss", "lr", "train_acc", "grad_norm", "clipped_fraction", "samples_per_s", "data_wait_pct")
VAL_CURVES = ("val_loss", "val_acc")


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(train window lines, validation lines) of metrics.jsonl, each by step, a repeated step's later line."""
    train, val = {}, {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "val_loss" in record:
            val[record["step"]] = record
        elif "loss" in record:
            train[record["step"]] = record
    return [train[s] for s in sorted(train)], [val[s] for s in sorted(val)]


def training_report(metrics_path: Path, names=()) -> dict:
    """The report's figures (report.json): curves by step, and the last validation's per-class figures."""
    train, val = read_metrics(metrics_path)
    report = {"made_by": MADE_BY, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "metrics": str(metrics_path.name), "steps": train[-1]["step"] if train else 0,
              "train": {"step": [r["step"] for r in train],
                        **{key: [r.get(key) for r in train] for key in TRAIN_CURVES}},
              "val": {"step": [r["step"] for r in val], "epoch": [r.get("epoch") for r in val],
                      **{key: [r.get(key) for r in val] for key in VAL_CURVES}},
              "confusion": None}
    last = val[-1] if val else None
    if last is not None and "val_map50" in last:  # detection: mAP by epoch, AP per class at the end (no confusion)
        report["detection"] = {"val_map": [r.get("val_map") for r in val], "val_map50": [r.get("val_map50") for r in val],
                               "ap": last.get("val_ap"), "ap50": last.get("val_ap50")}
    elif last is not None and last.get("val_confusion"):
        confusion = last["val_confusion"]
        report["confusion"] = {"step": last["step"], "epoch": last.get("epoch"),
                               "classes": class_names(len(confusion), names), "counts": confusion,
                               **per_class(confusion, names)}
    if last is not None and "val_miou" in last:  # segmentation: mIoU by epoch, IoU per class at the end
        report["segmentation"] = {"val_miou": [r.get("val_miou") for r in val],
                                  "val_pixel_acc": [r.get("val_pixel_acc") for r in val], "iou": last.get("val_iou")}
    return report


def write_training_report(run_dir: Path, names=()) -> tuple[Path, Path]:
    """Write run_dir/report.json and run_dir/report.html from run_dir/metrics.jsonl."""
    report = training_report(run_dir / METRICS_NAME, names)
    json_path, html_path = run_dir / REPORT_JSON, run_dir / REPORT_HTML
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    html_path.write_text(render_html(report, run_dir.name))
    return json_path, html_path


# ---- HTML ---------------------------------------------------------------------------------------

def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    return f"{v:.2e}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3g}"


def line_chart_svg(title: str, series: list[tuple[str, list, list]], chart_id: str,
                   width: int = 560, height: int = 200) -> str:
    """One chart of (name, steps, values) lines sharing a y axis; values that are None or not finite are left out."""
    clean = [(name, [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]) for name, xs, ys in series]
    points = [p for _, pts in clean for p in pts]
    if not points:
        return f'<p class="empty">{html.escape(title)}: nothing logged.</p>'
    left, top, right, bottom = 70, 30, 20, 40
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.05 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x):
        return left + (x - x0) / (x1 - x0) * plot_w

    def sy(y):
        return top + (1 - (y - y0) / (y1 - y0)) * plot_h

    parts = [f'<text x="0" y="16" font-size="14" font-weight="bold">{html.escape(title)}</text>',
             f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#888"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#888"/>']
    for y in (y0, (y0 + y1) / 2, y1):
        parts.append(f'<text class="tick" x="{left - 6}" y="{sy(y) + 4:.1f}" font-size="11" '
                     f'text-anchor="end">{_fmt(y)}</text>')
    for x in (x0, x1):
        parts.append(f'<text class="tick" x="{sx(x):.1f}" y="{top + plot_h + 16}" font-size="11" '
                     f'text-anchor="{"start" if x == x0 else "end"}">{_fmt(x)}</text>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{height - 4}" font-size="11" text-anchor="middle">step</text>')
    legend_x = left + plot_w
    for i, (name, pts) in enumerate(clean):
        if not pts:
            continue
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(f'<polyline class="series" data-name="{html.escape(name)}" data-points="{len(pts)}" '
                     f'fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        for x, y in pts if len(pts) <= 40 else ():
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}"/>')
    if len(clean) > 1:  # in the title row, clear of the lines
        spans = " ".join(f'<tspan fill="{COLORS[i % len(COLORS)]}">\u25a0 {html.escape(name)}</tspan>'
                         for i, (name, pts) in enumerate(clean) if pts)
        parts.append(f'<text x="{legend_x}" y="16" font-size="11" text-anchor="end">{spans}</text>')
    return (f'<svg id="{chart_id}" class="curve" xmlns="http://www.w3.org/2000/svg" width="{width}" '
            f'height="{height}" role="img">{"".join(parts)}</svg>')


def confusion_table(confusion: dict) -> str:
    """The confusion matrix (rows: true class, columns: predicted), cells shaded by their share of the row."""
    names, counts = confusion["classes"], confusion["counts"]
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    rows = []
    for name, row in zip(names, counts):
        total = sum(row) or 1
        cells = "".join(f'<td style="background:rgba(76,114,176,{c / total:.2f})">{c}</td>' for c in row)
        rows.append(f"<tr><th>{html.escape(name)}</th>{cells}<td>{confusion['recall'][name]:.1%}</td></tr>")
    precision = "".join(f"<td>{confusion['precision'][n]:.1%}</td>" for n in names)
    return (f'<table id="confusion"><tr><th>true \\ predicted</th>{head}<th>recall</th></tr>{"".join(rows)}'
            f"<tr><th>precision</th>{precision}<td></td></tr></table>")


def _segmentation_html(report: dict) -> list[str]:
    """Segmentation runs: validation mIoU and pixel accuracy by step, and the last IoU per class."""
    seg = report.get("segmentation")
    if not seg:
        return []
    steps = report["val"]["step"]
    rows = "".join(f"<tr><th>{html.escape(name)}</th><td>{'n/a' if iou is None else f'{iou:.1%}'}</td></tr>"
                   for name, iou in (seg["iou"] or {}).items())
    return ["<h2>Segmentation (validation)</h2>",
            line_chart_svg("mIoU and pixel accuracy", [("mIoU", steps, seg["val_miou"]),
                                                       ("pixel accuracy", steps, seg["val_pixel_acc"])], "chart-miou"),
            f'<table id="iou"><tr><th>class</th><th>IoU</th></tr>{rows}</table>']


def _detection_html(report: dict) -> list[str]:
    """Detection runs: validation mAP@[.5:.95] and mAP@.5 by step, and the last AP per class."""
    det = report.get("detection")
    if not det:
        return []
    steps = report["val"]["step"]

    def shown(v):
        return "n/a" if v is None else f"{v:.1%}"

    rows = "".join(f"<tr><th>{html.escape(name)}</th><td>{shown(ap)}</td><td>{shown((det['ap50'] or {}).get(name))}</td></tr>"
                   for name, ap in (det["ap"] or {}).items())
    return ["<h2>Detection (validation, COCO)</h2>",
            line_chart_svg("mAP", [("mAP@[.5:.95]", steps, det["val_map"]), ("mAP@.5", steps, det["val_map50"])],
                           "chart-map"),
            f'<table id="ap"><tr><th>class</th><th>AP@[.5:.95]</th><th>AP@.5</th></tr>{rows}</table>']


def render_html(report: dict, run_name: str) -> str:
    t, v = report["train"], report["val"]
    acc_series = [("train", t["step"], t["train_acc"])] + ([("validation", v["step"], v["val_acc"])] if v["step"] else [])
    loss_series = [("train", t["step"], t["loss"])] + ([("validation", v["step"], v["val_loss"])] if v["step"] else [])
    charts = [line_chart_svg("Loss", loss_series, "chart-loss"),
              line_chart_svg("Top-1 accuracy", acc_series, "chart-acc"),
              line_chart_svg("Learning rate", [("lr", t["step"], t["lr"])], "chart-lr"),
              line_chart_svg("Gradient norm before clipping (window mean)", [("grad_norm", t["step"], t["grad_norm"])],
                             "chart-grad-norm"),
              line_chart_svg("Share of steps clipped", [("clipped", t["step"], t["clipped_fraction"])],
                             "chart-clipped")]
    body = [f"<p>{report['steps']} steps; curves per logging window from {html.escape(report['metrics'])}.</p>",
            "<h2>Training curves</h2>", *charts]
    body += _segmentation_html(report) + _detection_html(report)
    confusion = report["confusion"]
    if report.get("detection"):
        pass
    elif confusion is not None:
        body += [f"<h2>Confusion matrix (validation after epoch {confusion['epoch']}, step {confusion['step']})</h2>",
                 confusion_table(confusion)]
    else:
        body.append("<p>No validation ran ([data] val is empty), so there is no confusion matrix.</p>")
    title = f"Training report: {run_name}"

    return page(title, MADE_BY, REPORT_JSON, None, "\n".join(body), style="td,th{text-align:right}")
