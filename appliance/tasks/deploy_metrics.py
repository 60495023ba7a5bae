"""What the deploy stages ask a task: its accuracy metric on model outputs (numpy, no torch).

Classification scores top-1 of (N, K) logits against (N,) labels; segmentation scores mIoU of
(N, K, H, W) logits against (N, H, W) masks (the ignore label counts for nothing), with the
same IoU arithmetic as training (segmentation_figures.iou_figures). Agreement between two
runtimes is the share of equal argmaxes over axis 1 either way: per image, or per pixel.
"""

from __future__ import annotations

from appliance.tasks.segmentation_figures import iou_figures


def argmax_agreement(a, b) -> float:
    """Share of equal argmax over axis 1 (top-1 per image, or the class per pixel)."""
    return float((a.argmax(1) == b.argmax(1)).mean())


def top1(logits, labels) -> float:
    return float((logits.argmax(1) == labels).mean())


def confusion(predicted, masks, num_classes: int, ignore_label: int):
    """(K, K) counts of [true][predicted] over the labelled pixels."""
    import numpy as np  # late: the tasks package is read where numpy is not wanted

    valid = (masks != ignore_label) & (masks >= 0) & (masks < num_classes)
    pairs = masks[valid].astype(np.int64) * num_classes + predicted[valid].astype(np.int64)
    return np.bincount(pairs, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def miou_of_maps(predicted, masks, num_classes: int, ignore_label: int) -> dict:
    """mIoU, pixel accuracy and per-class IoU of class maps (N, H, W) against masks (N, H, W)."""
    f = iou_figures(confusion(predicted, masks, num_classes, ignore_label))
    return {"miou": f["miou"], "pixel_acc": f["pixel_acc"], "iou": list(f["iou"].values())}
