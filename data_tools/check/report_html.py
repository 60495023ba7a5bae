"""report.html: one self-contained page (inline CSS, SVG plots, base64 PNG thumbnails; no CDN)."""

from __future__ import annotations

from html import escape
from pathlib import Path

from appliance.manifest import atomic_write_text
from data_tools.check.plots import bar_chart, histogram

_CSS = """
body{font-family:sans-serif;margin:24px;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
.pass{color:#1e7e34;font-weight:bold}.fail{color:#c0392b;font-weight:bold}
.thumbs{display:flex;flex-wrap:wrap;gap:10px}.thumb{font-size:11px;width:120px;word-break:break-all}
.thumb img{display:block;max-width:110px;border:1px solid #999}.group{border:1px solid #ddd;padding:6px;margin:6px 0}
.plots{display:flex;flex-wrap:wrap;gap:12px}
"""


def write_html(path: Path, report: dict, thumbs: dict) -> None:
    atomic_write_text(path, render(report, thumbs))


def render(report: dict, thumbs: dict) -> str:
    gate = report.get("gate", {"passed": True, "failed": [], "conditions": []})
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Data check report</title>"
           f"<meta name='generator' content='{escape(report['made_by'])}'><style>{_CSS}</style></head><body>",
           f"<!-- made by {escape(report['made_by'])} at {escape(report['created'])}; "
           f"remake with: {escape(' '.join(report.get('command') or []))} -->",
           "<h1>Data check report</h1>",
           f"<p>{report['records_total']} records read: <b>{report['records_valid']} valid</b>, "
           f"<b>{report['records_quarantined']} quarantined</b>; {len(report['damaged_ranges'])} unreadable "
           f"byte ranges ({report['damaged_bytes']} bytes). Made by {escape(report['made_by'])}, "
           f"{escape(report['created'])}.</p>"]
    if gate["conditions"]:
        verdict = "<span class='pass'>passed</span>" if gate["passed"] else "<span class='fail'>FAILED</span>"
        out.append(f"<h2>Gate: {verdict}</h2><p>Conditions: {escape(', '.join(gate['conditions']))}</p>")
        out += [f"<p class='fail'>{escape(line)}</p>" for line in gate["failed"]]

    out.append("<h2>Files</h2><table><tr><th>file</th><th>split</th><th>records</th><th>valid</th>"
               "<th>quarantined</th><th>unreadable ranges</th><th>problem</th></tr>")
    for f in report["files"]:
        out.append(f"<tr><td>{escape(f['path'])}</td><td>{escape(f['split'] or '')}</td><td>{f['records']}</td>"
                   f"<td>{f['valid']}</td><td>{f['quarantined']}</td><td>{f['damaged_ranges']}</td>"
                   f"<td>{escape(f['error'] or '')}</td></tr>")
    out.append("</table><h2>Checks</h2><table><tr><th>check</th><th>records</th></tr>")
    out += [f"<tr><td>{escape(k)}</td><td>{v}</td></tr>" for k, v in report["checks"].items()]
    out.append("</table>")

    labels = report["labels"]
    out.append("<h2>Label balance</h2>")
    if labels["histogram"]:
        names = labels.get("class_names", {})
        keys = list(labels["histogram"])
        out.append(bar_chart([f"{k} {names[k]}" if k in names else k for k in keys],
                             list(labels["histogram"].values()), "records per class (valid records)",
                             "plot-label-balance"))
        imbalance = labels["imbalance"]
        out.append(f"<p>Imbalance (largest / smallest class): "
                   f"{'undefined (empty classes: ' + str(labels['empty_classes']) + ')' if imbalance is None else f'{imbalance:.2f}'}"
                   "</p>")
    else:
        out.append("<p>No labels found.</p>")

    out.append("<h2>Statistics</h2><p>Red dashed: 3-sigma bounds; orange dotted: median/MAD bounds "
               "(modified z-score 3.5). A value outside either is an outlier.</p><div class='plots'>")
    for name, stat in report["statistics"].items():
        if "histogram" in stat:
            out.append(histogram(stat["histogram"]["counts"], stat["histogram"]["edges"], stat,
                                 f"{name}", f"plot-stat-{name.replace('/', '-')}"))
    out.append("</div>")

    out.append(f"<h2>Outliers ({report['metrics']['outliers']} records)</h2><div class='thumbs' id='outliers'>")
    out += [_thumb(item) for item in thumbs["outliers"]]
    out.append("</div>")
    out.append(f"<h2>Duplicates</h2><p>{len(report['duplicates']['exact_groups'])} exact groups, "
               f"{len(report['duplicates']['near_groups'])} near-duplicate groups "
               f"({report['duplicates']['near_groups_across_splits']} across train and val).</p>"
               "<div id='duplicate-groups'>")
    for group in thumbs["groups"]:
        out.append(f"<div class='group'><b>{escape(group['kind'])}</b><div class='thumbs'>")
        out += [_thumb(m) for m in group["members"]]
        out.append("</div></div>")
    out.append("</div>")

    if report["damaged_ranges"]:
        out.append("<h2>Unreadable byte ranges</h2><table><tr><th>file</th><th>bytes</th><th>reason</th></tr>")
        out += [f"<tr><td>{escape(d['file'])}</td><td>{d['start']}-{d['end']}</td><td>{escape(d['reason'])}</td></tr>"
                for d in report["damaged_ranges"][:200]]
        out.append("</table>")
    out.append(f"<h2>Outputs</h2><p>{escape(report['clean_output'])}. Quarantined records: "
               f"quarantine/ (reasons in {escape(report['quarantine']['reasons'])}).</p>")
    out.append("</body></html>")
    return "\n".join(out)


def _thumb(item: dict) -> str:
    image = (f"<img alt='record {item['record_number']}' src='data:image/png;base64,{item['png']}'>"
             if item.get("png") else "<div>(no image)</div>")
    return (f"<div class='thumb'>{image}{escape(Path(item['file']).name)} #{item['record_number']}<br>"
            f"{escape(item['caption'])}</div>")
