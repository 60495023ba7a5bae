"""Detection's figures: COCO mAP@[.5:.95], mAP@.5 and per-class AP by faster-coco-eval (numpy).

COCO's evaluation (faster-coco-eval's COCOeval_faster, a maintained re-implementation of
pycocotools' COCOeval, cross-checked against pycocotools in tests) over pixel boxes on the
model's image_size grid: all areas, at most 100 detections per image. Per-class AP is the mean
of COCO's precision table over IoU thresholds and recall points for that class; mAP is the mean over
classes with ground truth, which is what COCOeval's stats[0] / stats[1] are.

The quality gate's trivial baseline is the box prior: for each class its mean ground-truth box
(over the validation images), predicted on every image with score 1. It knows where objects of each
class usually are and nothing about the image; the model must close `baseline_margin` of the gap
from its mAP@.5 to 1.

The rows training keeps (metrics.jsonl's val_confusion for a detection run), one per class:
[AP@[.5:.95], AP@.5, ground-truth boxes, detections, baseline AP@[.5:.95], baseline AP@.5]
(AP is -1 for a class without ground truth, as COCOeval writes it).
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import asdict

import numpy as np
from faster_coco_eval import COCO, COCOeval_faster

from appliance.tasks.classification_figures import class_names, pct
from appliance.tasks.thresholds import Thresholds

ROW = ("ap", "ap50", "gt_boxes", "detections", "baseline_ap", "baseline_ap50")


def coco_dicts(truths, detections, num_classes: int, size: int) -> tuple[dict, list]:
    """COCO ground truth and result lists of per-image (boxes xyxy, labels) and (boxes, scores, labels)."""
    gt = {"images": [{"id": i, "width": size, "height": size} for i in range(len(truths))],
          "categories": [{"id": c} for c in range(1, num_classes + 1)], "annotations": []}
    for i, (boxes, labels) in enumerate(truths):
        for b, c in zip(np.asarray(boxes, float).reshape(-1, 4), labels):
            w, h = b[2] - b[0], b[3] - b[1]
            gt["annotations"].append({"id": len(gt["annotations"]) + 1, "image_id": i, "category_id": int(c),
                                      "bbox": [b[0], b[1], w, h], "area": w * h, "iscrowd": 0})
    results = [{"image_id": i, "category_id": int(c), "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]], "score": float(s)}
               for i, (boxes, scores, labels) in enumerate(detections)
               for b, s, c in zip(np.asarray(boxes, float).reshape(-1, 4), scores, labels)]
    return gt, results


def per_class_ap(truths, detections, num_classes: int, size: int, coco=(COCO, COCOeval_faster)) -> np.ndarray:
    """(K, 2) AP@[.5:.95] and AP@.5 per class (-1: no ground truth); coco: the (COCO, COCOeval) pair used."""
    gt, results = coco_dicts(truths, detections, num_classes, size)
    out = np.full((num_classes, 2), -1.0)
    if not gt["annotations"]:
        return out
    if not results:
        has = {a["category_id"] for a in gt["annotations"]}
        out[[c - 1 for c in has]] = 0.0
        return out
    with contextlib.redirect_stdout(io.StringIO()):  # both print their progress
        truth = COCO_of(coco[0], gt)
        evaluator = coco[1](truth, truth.loadRes(results), "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
    precision = np.asarray(evaluator.eval["precision"])[:, :, :, 0, -1]  # [T, R, K] at area all, 100 dets
    for k in range(num_classes):
        p = precision[:, :, k]
        if (p > -1).any():
            out[k, 0] = p[p > -1].mean()
            p50 = p[0]
            out[k, 1] = p50[p50 > -1].mean() if (p50 > -1).any() else 0.0
    return out


def COCO_of(cls, dataset: dict):
    coco = cls()
    coco.dataset = dataset
    coco.createIndex()
    return coco


def prior_boxes(truths, num_classes: int) -> list[tuple]:
    """The baseline's detections: each class's mean ground-truth box on every image, score 1."""
    boxes = {c: [] for c in range(1, num_classes + 1)}
    for b, labels in truths:
        for box, c in zip(np.asarray(b, float).reshape(-1, 4), labels):
            boxes[int(c)].append(box)
    classes = [c for c in boxes if boxes[c]]
    prior = np.array([np.mean(boxes[c], 0) for c in classes]).reshape(-1, 4)
    return [(prior, np.ones(len(classes)), np.array(classes)) for _ in truths]


def detection_rows(truths, detections, num_classes: int, size: int) -> list[list[float]]:
    """The rows training keeps (ROW per class) of one validation pass."""
    model = per_class_ap(truths, detections, num_classes, size)
    baseline = per_class_ap(truths, prior_boxes(truths, num_classes), num_classes, size)
    gt = np.bincount(np.concatenate([np.asarray(l, np.int64) for _, l in truths] or [np.zeros(0, np.int64)]),
                     minlength=num_classes + 1)[1:]
    dets = np.bincount(np.concatenate([np.asarray(d[2], np.int64) for d in detections] or [np.zeros(0, np.int64)]),
                       minlength=num_classes + 1)[1:]
    return [[float(model[k, 0]), float(model[k, 1]), int(gt[k]), int(dets[k]), float(baseline[k, 0]),
             float(baseline[k, 1])] for k in range(num_classes)]


def map_figures(rows, names=()) -> dict:
    """mAP, mAP@.5, per-class AP and the baseline's, from the rows (classes without ground truth left out)."""
    labels = class_names(len(rows), names)
    scored = [r for r in rows if r[0] >= 0]

    def mean(i):
        return sum(r[i] for r in scored) / len(scored) if scored else 0.0

    return {"map": mean(0), "map50": mean(1), "baseline_map": mean(4), "baseline_map50": mean(5),
            "ap": {labels[k]: (r[0] if r[0] >= 0 else None) for k, r in enumerate(rows)},
            "ap50": {labels[k]: (r[1] if r[1] >= 0 else None) for k, r in enumerate(rows)},
            "gt_boxes": sum(int(r[2]) for r in rows), "detections": sum(int(r[3]) for r in rows)}


def detection_quality(rows, names=(), thresholds: Thresholds | None = None) -> dict:
    """The gate: mAP@.5 against the box-prior baseline; `passed`, `failures`, `verdict`."""
    thresholds = thresholds or Thresholds()
    f = map_figures(rows, names)
    if f["gt_boxes"] == 0:
        return {"gt_boxes": 0, "passed": False, "failures": ["the validation pass saw no ground-truth box"],
                "verdict": "quality gate failed: the validation pass saw no ground-truth box",
                "thresholds": asdict(thresholds)}
    required = f["baseline_map50"] + thresholds.baseline_margin * (1 - f["baseline_map50"])
    failures = []
    if f["map50"] < required:
        failures.append(f"val mAP@.5 {pct(f['map50'])} is below the {pct(required)} required (each class's mean "
                        f"box on every image: mAP@.5 {pct(f['baseline_map50'])})")
    if f["map50"] < thresholds.min_val_acc:
        failures.append(f"val mAP@.5 {pct(f['map50'])} is below min_val_acc {pct(thresholds.min_val_acc)}")
    head = (f"val mAP@.5 {pct(f['map50'])}, mAP@[.5:.95] {pct(f['map'])} vs box-prior baseline mAP@.5 "
            f"{pct(f['baseline_map50'])} (needs {pct(required)})")
    verdict = f"{head}: quality gate passed" if not failures else f"{head}: quality gate failed: {'; '.join(failures)}"
    return {"gt_boxes": f["gt_boxes"], "detections": f["detections"], "val_map": f["map"], "val_map50": f["map50"],
            "val_ap": f["ap"], "val_ap50": f["ap50"], "baseline_map": f["baseline_map"],
            "baseline_map50": f["baseline_map50"], "required_map50": required, "rows": [list(r) for r in rows],
            "passed": not failures, "failures": failures, "verdict": verdict, "thresholds": asdict(thresholds)}
