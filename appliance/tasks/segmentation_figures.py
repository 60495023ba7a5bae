"""Segmentation's figures from per-pixel confusion[true][predicted] counts (no torch here).

IoU of class c = TP / (TP + FP + FN); mIoU is the mean over the classes that occur (in the truth
or the prediction: union > 0), as torchmetrics' and mmseg's nan-mean do. Pixel accuracy counts
every labelled pixel (ignored pixels are never counted).

The quality gate compares with the cheapest model, "the most common class everywhere": its IoU
is that class's share of the pixels for that class and 0 for every other class present, so its mIoU
is share / classes present. The model must close `baseline_margin` of the gap from that to 1.
"""

from __future__ import annotations

from dataclasses import asdict

from appliance.tasks.classification_figures import class_names, pct
from appliance.tasks.thresholds import Thresholds


def iou_figures(confusion, names=()) -> dict:
    """{"miou", "pixel_acc", "iou": {class: IoU or None}, "recall": {class: ...}} of confusion counts."""
    rows = [[int(c) for c in row] for row in confusion]
    n = len(rows)
    labels = class_names(n, names)
    true = [sum(row) for row in rows]
    predicted = [sum(rows[t][p] for t in range(n)) for p in range(n)]
    pixels = sum(true)
    iou = {}
    for c in range(n):
        union = true[c] + predicted[c] - rows[c][c]
        iou[labels[c]] = rows[c][c] / union if union else None  # a class seen nowhere has no IoU
    scored = [v for v in iou.values() if v is not None]
    return {"miou": sum(scored) / len(scored) if scored else 0.0,
            "pixel_acc": sum(rows[c][c] for c in range(n)) / pixels if pixels else 0.0,
            "iou": iou, "recall": {labels[c]: rows[c][c] / true[c] if true[c] else None for c in range(n)},
            "pixels": pixels, "class_pixels": dict(zip(labels, true)), "predicted_pixels": dict(zip(labels, predicted))}


def segmentation_quality(confusion, names=(), thresholds: Thresholds | None = None) -> dict:
    """The gate's figures: mIoU against the most-common-class baseline; `passed`, `failures`, `verdict`."""
    thresholds = thresholds or Thresholds()
    f = iou_figures(confusion, names)
    labels = list(f["iou"])
    if f["pixels"] == 0:
        return {"pixels": 0, "passed": False, "failures": ["the validation pass saw no labelled pixel"],
                "verdict": "quality gate failed: the validation pass saw no labelled pixel",
                "thresholds": asdict(thresholds)}
    common = max(labels, key=lambda c: f["class_pixels"][c])
    share = f["class_pixels"][common] / f["pixels"]
    present = sum(1 for c in labels if f["class_pixels"][c])
    baseline = share / present
    required = baseline + thresholds.baseline_margin * (1 - baseline)
    top = max(labels, key=lambda c: f["predicted_pixels"][c])
    top_share = f["predicted_pixels"][top] / f["pixels"]
    failures = []
    if f["miou"] < required:
        failures.append(f"val mIoU {pct(f['miou'])} is below the {pct(required)} required (predicting class "
                        f"{common!r} everywhere: mIoU {pct(baseline)}, pixel accuracy {pct(share)})")
    if f["pixel_acc"] < thresholds.min_val_acc:
        failures.append(f"pixel accuracy {pct(f['pixel_acc'])} is below min_val_acc {pct(thresholds.min_val_acc)}")
    if top_share >= thresholds.max_predicted_share and f["class_pixels"][top] / f["pixels"] < thresholds.max_predicted_share:
        failures.append(f"it predicts class {top!r} for {pct(top_share)} of the pixels "
                        f"({pct(f['class_pixels'][top] / f['pixels'])} are that class)")
    low = {c: r for c, r in f["recall"].items() if r is not None and r < thresholds.min_class_recall}
    if low:
        failures.append(f"class recall below min_class_recall {pct(thresholds.min_class_recall)}: "
                        + ", ".join(f"{c!r} {pct(r)}" for c, r in low.items()))
    head = (f"val mIoU {pct(f['miou'])}, pixel accuracy {pct(f['pixel_acc'])} vs most-common-class baseline "
            f"mIoU {pct(baseline)} (needs {pct(required)})")
    verdict = f"{head}: quality gate passed" if not failures else f"{head}: quality gate failed: {'; '.join(failures)}"
    return {"pixels": f["pixels"], "val_miou": f["miou"], "val_pixel_acc": f["pixel_acc"], "val_iou": f["iou"],
            "baseline_class": common, "baseline_miou": baseline, "baseline_pixel_acc": share,
            "required_miou": required, "top_predicted_class": top, "top_predicted_share": top_share,
            "class_recall": f["recall"], "class_pixels": f["class_pixels"], "confusion": confusion_rows(confusion),
            "passed": not failures, "failures": failures, "verdict": verdict, "thresholds": asdict(thresholds)}


def confusion_rows(confusion) -> list[list[int]]:
    return [[int(c) for c in row] for row in confusion]
