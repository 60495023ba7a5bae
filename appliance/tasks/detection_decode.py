"""Detection post-processing, defined once: raw head outputs -> boxes (numpy, no torch).

The network ends at its raw outputs, `raw [N, P, 5 + K]` per image: for each of the P = G x G
points of a stride-`stride` grid (row-major; point (i, j) sits at x = (j + 0.5) * stride,
y = (i + 0.5) * stride pixels), the distances l, t, r, b, a centerness logit and K class logits.
`decoding_spec` writes every constant of what follows into the model card; this module is the
host's implementation and appliance/deploy/edge/detection_decode.h the device's, tested equal:

1. box = (x - d_l, y - d_t, x + d_r, y + d_b), d = stride * exp(min(raw, MAX_LOG_DISTANCE)),
   clipped to [0, image_size]; score of class c = sqrt(sigmoid(class c) * sigmoid(centerness)) (FCOS);
2. keep (point, class) pairs with score > score_threshold; of those the pre_nms_top_k best
   (score descending, then point, then class ascending);
3. per class, greedy NMS in that order: a box is dropped when its IoU with a kept box of its class
   is > iou_threshold;
4. the max_detections best kept boxes (same order). Arithmetic in float32.
"""

from __future__ import annotations

import numpy as np

MAX_LOG_DISTANCE = 10.0  # exp(10) * stride: far past any image; keeps exp finite on every runtime
DEFAULTS = {"score_threshold": 0.05, "iou_threshold": 0.5, "max_detections": 100, "pre_nms_top_k": 1000}


def decoding_spec(image_size: int, stride: int, num_classes: int, score_threshold: float = 0.05,
                  iou_threshold: float = 0.5, max_detections: int = 100, pre_nms_top_k: int = 1000) -> dict:
    """The model card's "detection" block: every constant the host and the device decode with."""
    grid = image_size // stride
    return {"head": "anchor-free points (FCOS)", "output": f"raw [N, {grid * grid}, {5 + num_classes}]: "
            "l, t, r, b, centerness logit, then one logit per class",
            "image_size": int(image_size), "stride": int(stride), "grid": int(grid), "num_classes": int(num_classes),
            "points": "row-major, point (i, j) at x = (j + 0.5) * stride, y = (i + 0.5) * stride",
            "box": f"(x - d_l, y - d_t, x + d_r, y + d_b), d = stride * exp(min(raw, {MAX_LOG_DISTANCE})), "
                   "clipped to [0, image_size]",
            "score": "sqrt(sigmoid(class logit) * sigmoid(centerness logit))",
            "score_threshold": float(score_threshold), "iou_threshold": float(iou_threshold),
            "nms": "per class, greedy, score descending (ties: point, then class ascending), drop IoU > iou_threshold",
            "max_detections": int(max_detections), "pre_nms_top_k": int(pre_nms_top_k),
            "max_log_distance": MAX_LOG_DISTANCE, "label_offset": 1}


def points(image_size: int, stride: int) -> np.ndarray:
    """(P, 2) float32 point centres (x, y) in pixels, row-major."""
    grid = image_size // stride
    c = (np.arange(grid, dtype=np.float32) + np.float32(0.5)) * np.float32(stride)
    ys, xs = np.meshgrid(c, c, indexing="ij")
    return np.stack([xs.reshape(-1), ys.reshape(-1)], 1)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (np.float32(1) / (np.float32(1) + np.exp(-x))).astype(np.float32)


def decode_image(raw: np.ndarray, spec: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(boxes (D, 4) pixels, scores (D,), labels (D,) from 1) of one image's raw [P, 5 + K] outputs."""
    raw = np.asarray(raw, dtype=np.float32)
    stride, size = np.float32(spec["stride"]), np.float32(spec["image_size"])
    p = points(int(spec["image_size"]), int(spec["stride"]))
    d = stride * np.exp(np.minimum(raw[:, :4], np.float32(spec["max_log_distance"])))
    boxes = np.stack([p[:, 0] - d[:, 0], p[:, 1] - d[:, 1], p[:, 0] + d[:, 2], p[:, 1] + d[:, 3]], 1)
    boxes = np.clip(boxes, np.float32(0), size).astype(np.float32)
    scores = np.sqrt(_sigmoid(raw[:, 5:]) * _sigmoid(raw[:, 4:5])).astype(np.float32)  # (P, K)
    point, cls = np.nonzero(scores > np.float32(spec["score_threshold"]))  # row-major: point, then class
    s = scores[point, cls]
    order = np.argsort(-s, kind="stable")[: int(spec["pre_nms_top_k"])]
    point, cls, s = point[order], cls[order], s[order]
    keep = []
    kept_by_class: dict[int, list[int]] = {}
    for i in range(len(order)):
        box = boxes[point[i]]
        if any(iou(box, boxes[point[j]]) > spec["iou_threshold"] for j in kept_by_class.get(int(cls[i]), ())):
            continue
        kept_by_class.setdefault(int(cls[i]), []).append(i)
        keep.append(i)
        if len(keep) == int(spec["max_detections"]):
            break
    keep = np.asarray(keep, dtype=np.int64)
    return boxes[point[keep]].reshape(-1, 4), s[keep], cls[keep].astype(np.int64) + 1


def iou(a: np.ndarray, b: np.ndarray) -> float:
    """IoU of two (4,) float32 boxes, in float32 as the device computes it."""
    w = max(np.float32(0), min(a[2], b[2]) - max(a[0], b[0]))
    h = max(np.float32(0), min(a[3], b[3]) - max(a[1], b[1]))
    inter = np.float32(w * h)
    union = np.float32((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)
    return float(inter / union) if union > 0 else 0.0


def decode(raw: np.ndarray, spec: dict) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """decode_image of each image of raw [N, P, 5 + K]."""
    return [decode_image(r, spec) for r in np.asarray(raw)]


def match_share(a: tuple, b: tuple, min_iou: float = 0.9) -> tuple[int, int]:
    """(boxes of a matched one to one in b with the same class and IoU >= min_iou, the larger count)
    of two decode_image results, greedily in a's score order."""
    used = set()
    matched = 0
    for box, label in zip(a[0], a[2]):
        for j, (other, other_label) in enumerate(zip(b[0], b[2])):
            if j not in used and other_label == label and iou(box, other) >= min_iou:
                used.add(j)
                matched += 1
                break
    return matched, max(len(a[0]), len(b[0]))


def spec_of_raw(raw: np.ndarray, stride: int, constants: dict) -> dict:
    """The decoding spec of raw [N, P, 5 + K] outputs of a square stride-`stride` grid."""
    grid = int(round(np.sqrt(raw.shape[1])))
    return decoding_spec(grid * stride, stride, raw.shape[2] - 5, **constants)


def box_agreement(a: np.ndarray, b: np.ndarray, stride: int = 8, constants: dict | None = None) -> float:
    """Share of boxes that agree between two runtimes' raw outputs (same class, IoU >= 0.9); 1 when neither has any."""
    spec = spec_of_raw(np.asarray(a), stride, constants or {})
    matched = total = 0
    for x, y in zip(decode(a, spec), decode(b, spec)):
        m, n = match_share(x, y)
        matched, total = matched + m, total + n
    return matched / total if total else 1.0
