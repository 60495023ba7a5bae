"""report.html: one self-contained page (inline CSS, SVG plots, base64 PNG thumbnails; no CDN)."""

from __future__ import annotations

import shlex
from html import escape
from pathlib import Path

from appliance.core.manifest import atomic_write_text
from data_tools.check.plots import bar_chart, histogram

_CSS = """
body{font-family:sans-serif;margin:24px;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
.pass{color:#1e7e34;font-weight:bold}.fail{color:#c0392b;font-weight:bold}
.thumbs{display:flex;flex-wrap:wrap;gap:10px}.thumb{font-size:11px;width:140px;overflow-wrap:break-word}
.thumb img{display:block;border:1px solid #999;margin-bottom:2px}.thumb img.scaled{image-rendering:pixelated}
.thumb .file{white-space:nowrap;overflow:hidden;text-overflow:ellipsis}.thumb .w{white-space:nowrap}
.group{border:1px solid #ddd;padding:6px;margin:6px 0}.shown{color:#555;font-style:italic}
.plots{display:flex;flex-wrap:wrap;gap:12px}
"""

MAX_DAMAGED_ROWS = 200
# Thumbnails are drawn at least this large (longer side), small images scaled up by a whole factor.
THUMB_DISPLAY = 96


def write_html(path: Path, report: dict, thumbs: dict) -> None:
    atomic_write_text(path, render(report, thumbs, Path(path).parent))


def remake_command(report: dict, out_dir: Path | None = None) -> str:
    """The command line that made the report, or an equivalent one built from its inputs and parameters."""
    if report.get("command"):
        return shlex.join(report["command"])
    plain = [f["path"] for f in report["files"] if not f["split"]]
    train = [f["path"] for f in report["files"] if f["split"] == "train"]
    val = [f["path"] for f in report["files"] if f["split"] == "val"]
    args = ["appliance", "data", "check", *plain]
    args += ["--train", *train] if train else []
    args += ["--val", *val] if val else []
    args += ["--out", str(out_dir or "OUT")]
    params = report.get("params", {})
    if report.get("schema_source", "").startswith("given: "):
        args += ["--schema", report["schema_source"][len("given: "):]]
    for key, option in (("fail_on", "--fail-on"), ("image_key", "--image-key"), ("label_key", "--label-key"),
                        ("max_pixels", "--max-pixels"), ("near_distance", "--near-distance"),
                        ("num_classes", "--num-classes"), ("ignore_label", "--ignore-label")):
        if params.get(key) is not None:
            args += [option, str(params[key])]
    return shlex.join(args)


def _shown(shown: int, total: int, what: str) -> str:
    """A line saying that a list was cut; nothing when everything is shown."""
    if shown >= total:
        return ""
    return f"<p class='shown'>shown {shown} of {total} {what}; every one is listed in report.json</p>"


def render(report: dict, thumbs: dict, out_dir: Path | None = None) -> str:
    out = [*_header(report, out_dir), *_files_and_checks(report), *_label_balance(report),
           *_segmentation(report, thumbs), *_statistics(report), *_outliers_and_duplicates(report, thumbs),
           *_damage_and_outputs(report), "</body></html>"]
    return "\n".join(out)


def _header(report: dict, out_dir: Path | None) -> list[str]:
    """The page head, the totals and the gate's verdict."""
    gate = report.get("gate", {"passed": True, "failed": [], "conditions": []})
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Data check report</title>"
           f"<meta name='generator' content='{escape(report['made_by'])}'><style>{_CSS}</style></head><body>",
           f"<!-- made by {escape(report['made_by'])} at {escape(report['created'])}; "
           f"remake with: {escape(remake_command(report, out_dir))} -->",
           "<h1>Data check report</h1>",
           f"<p>{report['records_total']} records read: <b>{report['records_valid']} valid</b>, "
           f"<b>{report['records_quarantined']} quarantined</b>; {len(report['damaged_ranges'])} unreadable "
           f"byte ranges ({report['damaged_bytes']} bytes). Made by {escape(report['made_by'])}, "
           f"{escape(report['created'])}.</p>"]
    if gate["conditions"]:
        verdict = "<span class='pass'>passed</span>" if gate["passed"] else "<span class='fail'>FAILED</span>"
        out.append(f"<h2>Gate: {verdict}</h2><p>Conditions: {escape(', '.join(gate['conditions']))}</p>")
        out += [f"<p class='fail'>{escape(line)}</p>" for line in gate["failed"]]
    return out


def _files_and_checks(report: dict) -> list[str]:
    """Per file: records, valid, quarantined; then the checks' counts."""
    out = []
    out.append("<h2>Files</h2><table><tr><th>file</th><th>split</th><th>records</th><th>valid</th>"
               "<th>quarantined</th><th>unreadable ranges</th><th>problem</th></tr>")
    for f in report["files"]:
        out.append(f"<tr><td>{escape(f['path'])}</td><td>{escape(f['split'] or '')}</td><td>{f['records']}</td>"
                   f"<td>{f['valid']}</td><td>{f['quarantined']}</td><td>{f['damaged_ranges']}</td>"
                   f"<td>{escape(f['error'] or '')}</td></tr>")
    out.append("</table><h2>Checks</h2>")
    if report["checks"]:
        out.append("<table id='checks'><tr><th>check</th><th>records</th></tr>")
        out += [f"<tr><td>{escape(k)}</td><td>{v}</td></tr>" for k, v in report["checks"].items()]
        out.append("</table>")
    else:
        out.append(f"<p id='checks'>No record failed a check: all {report['records_total']} records read "
                   "passed framing, parse, schema, image and duplicate checks.</p>")
    return out


def _label_balance(report: dict) -> list[str]:
    """Records per class and the imbalance."""
    out = []
    labels = report["labels"]
    out.append("<h2>Label balance</h2>")
    if labels["histogram"]:
        names = labels.get("class_names", {})
        keys = list(labels["histogram"])
        # Class names that are just the label again ("0" for label 0) are not repeated.
        out.append(bar_chart([f"{k} {names[k]}" if names.get(k, k) != k else k for k in keys],
                             list(labels["histogram"].values()), "records per class (valid records)",
                             "plot-label-balance"))
        imbalance = labels["imbalance"]
        out.append(f"<p>Imbalance (largest / smallest class): "
                   f"{'undefined (empty classes: ' + str(labels['empty_classes']) + ')' if imbalance is None else f'{imbalance:.2f}'}"
                   "</p>")
    elif report.get("segmentation"):
        out.append("<p>The masks are the labels: pixels and images per class are under Masks below.</p>")
    else:
        out.append("<p>No labels found.</p>")
    return out


def _statistics(report: dict) -> list[str]:
    """The image statistics' histograms with their outlier bounds."""
    out = []
    out.append("<h2>Statistics</h2><p>Red dashed: 3-sigma bounds; orange dotted: median/MAD bounds "
               "(modified z-score 3.5). A value outside either is an outlier.</p><div class='plots'>")
    for name, stat in report["statistics"].items():
        if "histogram" in stat:
            out.append(histogram(stat["histogram"]["counts"], stat["histogram"]["edges"], stat,
                                 f"{name}", f"plot-stat-{name.replace('/', '-')}"))
    out.append("</div>")
    return out


def _outliers_and_duplicates(report: dict, thumbs: dict) -> list[str]:
    """Outlier thumbnails and the duplicate groups."""
    out = []
    outliers = report["metrics"]["outliers"]
    out.append(f"<h2>Outliers ({outliers} records)</h2>")
    out.append(_shown(len(thumbs["outliers"]), outliers, "outlier records"))
    out.append("<div class='thumbs' id='outliers'>")
    out += [_thumb(item) for item in thumbs["outliers"]]
    out.append("</div>")
    exact, near = report["duplicates"]["exact_groups"], report["duplicates"]["near_groups"]
    out.append(f"<h2>Duplicates</h2><p>{len(exact)} exact groups, {len(near)} near-duplicate groups "
               f"({report['duplicates']['near_groups_across_splits']} across train and val).</p>")
    for kind, groups, what in (("exact duplicates", exact, "exact-duplicate groups"),
                               ("near duplicates", near, "near-duplicate groups")):
        out.append(_shown(sum(1 for g in thumbs["groups"] if g["kind"] == kind), len(groups), what))
    out.append("<div id='duplicate-groups'>")
    for group in thumbs["groups"]:
        size, members = group.get("size", len(group["members"])), len(group["members"])
        cut = f" (shown {members})" if members < size else ""
        out.append(f"<div class='group'><b>{escape(group['kind'])}</b>, {size} records{cut}<div class='thumbs'>")
        out += [_thumb(m) for m in group["members"]]
        out.append("</div></div>")
    out.append("</div>")
    return out


def _damage_and_outputs(report: dict) -> list[str]:
    """Unreadable byte ranges (the first MAX_DAMAGED_ROWS) and where the outputs went."""
    out = []
    if report["damaged_ranges"]:
        out.append("<h2>Unreadable byte ranges</h2><table><tr><th>file</th><th>bytes</th><th>reason</th></tr>")
        out += [f"<tr><td>{escape(d['file'])}</td><td>{d['start']}-{d['end']}</td><td>{escape(d['reason'])}</td></tr>"
                for d in report["damaged_ranges"][:MAX_DAMAGED_ROWS]]
        out.append("</table>")
        out.append(_shown(min(len(report["damaged_ranges"]), MAX_DAMAGED_ROWS), len(report["damaged_ranges"]),
                          "unreadable byte ranges"))
    out.append(f"<h2>Outputs</h2><p>{escape(report['clean_output'])}. Quarantined records: "
               f"quarantine/ (reasons in {escape(report['quarantine']['reasons'])}).</p>")
    return out


def _segmentation(report: dict, thumbs: dict) -> list[str]:
    """Masks: pixel share and images per class, empty masks, overlays of valid and quarantined masks."""
    seg = report.get("segmentation")
    if not seg:
        return []
    names = seg.get("class_names", {})
    classes = list(seg["pixel_share"])
    labels = [f"{c} {names[c]}" if names.get(c, c) != c else c for c in classes]
    out = [f"<h2>Masks</h2><p>{seg['masks']} valid masks, {seg['num_classes']} classes "
           f"({escape(seg['num_classes_source'])}), ignore label {seg['ignore_label']} "
           f"({100 * seg['ignored_pixel_share']:.2f} % of pixels); {seg['empty_masks']} masks with no "
           f"foreground class; classes in no image: {seg['classes_in_no_image'] or 'none'}.</p><div class='plots'>",
           bar_chart(labels, [round(1000 * seg["pixel_share"][c]) for c in classes],
                     "labelled pixels per class (per mille)", "plot-pixel-share"),
           bar_chart(labels, [seg["images_per_class"][c] for c in classes], "images per class",
                     "plot-images-per-class"), "</div>"]
    overlays = thumbs.get("overlays") or {}
    legend = " ".join(f"<span style='background:{colour};padding:0 6px'>&nbsp;</span> class {escape(c)}"
                      + (f" {escape(names[c])}" if names.get(c, c) != c else "")
                      for c, colour in overlays.get("colours", {}).items())
    out.append(f"<h3>Mask overlays</h3><p>{legend}; ignored pixels white.</p><div class='thumbs' id='overlays'>")
    out += [_thumb(item) for item in overlays.get("valid", [])]
    out.append("</div>")
    if overlays.get("bad"):
        out.append("<h3>Quarantined masks</h3><div class='thumbs' id='bad-masks'>")
        out += [_thumb(item) for item in overlays["bad"]]
        out.append("</div>")
    return out


def _thumb(item: dict) -> str:
    image = "<div>(no image)</div>"
    if item.get("png"):
        width, height = item.get("width", THUMB_DISPLAY), item.get("height", THUMB_DISPLAY)
        scale = max(1, THUMB_DISPLAY // max(width, height, 1))  # whole factors keep pixels square
        image = (f"<img{' class=scaled' if scale > 1 else ''} alt='record {item['record_number']}' "
                 f"width='{width * scale}' height='{height * scale}' src='data:image/png;base64,{item['png']}'>")
    # Captions break only between words: "(3-sigma)" is one word, not "(3-" and "sigma)".
    words = " ".join(f"<span class='w'>{escape(w)}</span>" for w in item.get("caption", "").split())
    caption = f"<div class='caption'>{words}</div>" if words else ""
    return (f"<div class='thumb'>{image}<div class='record'>record {item['record_number']}</div>"
            f"<div class='file' title='{escape(item['file'])}'>{escape(Path(item['file']).name)}</div>"
            f"{caption}</div>")
