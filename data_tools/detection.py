"""Detection records in the TensorFlow Object Detection API's convention, and the boxes inside them.

A record (tf.train.Example, as the API's create_*_tf_record.py scripts write it):
  image/encoded, image/format, image/height, image/width, image/filename, image/source_id
  image/object/bbox/xmin|ymin|xmax|ymax   floats, normalised to [0, 1] by the image's width / height
  image/object/class/label                 int64, one per box; label maps start at 1 (0 is background)
  image/object/class/text                  bytes, the class's name, one per box
  image/object/difficult, image/object/is_crowd   optional int64, one per box
An image with no object holds empty lists (or none of the box keys): it is allowed, and counted.

Coordinates may stray past [0, 1] by BOX_TOLERANCE (rounding in the tools that wrote them: a box
ending on the last pixel column, computed in float32, can be 1.0000001); they are clipped into
[0, 1] when read for training. Further outside is a wrong box, quarantined by the data check.
"""

from __future__ import annotations

import math

import numpy as np

from data_tools.example import decode_example, encode_example

IMAGE_KEY = "image/encoded"
BOX_KEYS = ("image/object/bbox/xmin", "image/object/bbox/ymin", "image/object/bbox/xmax", "image/object/bbox/ymax")
LABEL_KEY = "image/object/class/label"
TEXT_KEY = "image/object/class/text"
DIFFICULT_KEY = "image/object/difficult"
CROWD_KEY = "image/object/is_crowd"
# Every per-box list; all must be as long as the labels when present.
PER_BOX_KEYS = (*BOX_KEYS, LABEL_KEY, TEXT_KEY, DIFFICULT_KEY, CROWD_KEY)
BOX_TOLERANCE = 1e-3  # normalised units past [0, 1] still taken as on the border (then clipped)


class BoxProblem(Exception):
    """A record whose boxes cannot be trained on; .check is one of box_lengths, box_nonfinite,
    box_outside, box_inverted, box_label_range."""

    def __init__(self, check: str, detail: str):
        super().__init__(detail)
        self.check, self.detail = check, detail


def is_detection_example(example: dict) -> bool:
    return LABEL_KEY in example or BOX_KEYS[0] in example


def encode_detection_example(image: bytes, image_format: str, height: int, width: int, boxes, labels,
                             texts=None, filename: str | None = None, source_id: str | None = None,
                             difficult=None, is_crowd=None) -> bytes:
    """One Object Detection API record. boxes: (N, 4) xmin, ymin, xmax, ymax normalised; labels: N ints from 1."""
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    features = {IMAGE_KEY: image, "image/format": image_format, "image/height": int(height),
                "image/width": int(width)}
    if filename is not None:
        features["image/filename"] = filename
    if source_id is not None:
        features["image/source_id"] = source_id
    for i, key in enumerate(BOX_KEYS):
        features[key] = boxes[:, i].copy()
    features[LABEL_KEY] = np.asarray(labels, dtype=np.int64).reshape(-1)
    if texts is not None:
        features[TEXT_KEY] = np.asarray([t.encode() if isinstance(t, str) else t for t in texts], dtype=object)
    if difficult is not None:
        features[DIFFICULT_KEY] = np.asarray(difficult, dtype=np.int64).reshape(-1)
    if is_crowd is not None:
        features[CROWD_KEY] = np.asarray(is_crowd, dtype=np.int64).reshape(-1)
    return encode_example(features)


def read_boxes(example: dict, num_classes: int | None = None, tolerance: float = BOX_TOLERANCE):
    """((N, 4) float32 boxes clipped into [0, 1], (N,) int64 labels from 1) of a decoded example, or
    BoxProblem naming the first thing wrong. num_classes (the label map's size) bounds the labels."""
    lists = {key: example.get(key) for key in PER_BOX_KEYS}
    lengths = {key: len(v) for key, v in lists.items() if v is not None}
    if len(set(lengths.values())) > 1:
        raise BoxProblem("box_lengths", "per-box lists differ in length: "
                         + ", ".join(f"{k.rsplit('/', 1)[-1]} {n}" for k, n in lengths.items()))
    n = next(iter(lengths.values()), 0)
    if n and any(k not in lengths for k in (*BOX_KEYS, LABEL_KEY)):
        missing = next(k for k in (*BOX_KEYS, LABEL_KEY) if k not in lengths)
        raise BoxProblem("box_lengths", f"{n} boxes but no {missing}")
    for key in (*BOX_KEYS, LABEL_KEY):
        value = lists[key]
        if n and (isinstance(value, list) or (key in BOX_KEYS) != (value.dtype.kind == "f")):
            raise BoxProblem("box_lengths", f"{key} holds {'bytes' if isinstance(value, list) else value.dtype}, "
                             f"expected {'floats' if key in BOX_KEYS else 'int64'}")
    if not n:
        return np.zeros((0, 4), np.float32), np.zeros(0, np.int64)
    boxes = np.stack([np.asarray(lists[k], np.float32) for k in BOX_KEYS], 1)
    labels = np.asarray(lists[LABEL_KEY], np.int64)
    bad = ~np.isfinite(boxes).all(1)
    if bad.any():
        i = int(np.argmax(bad))
        raise BoxProblem("box_nonfinite", f"box {i} has a coordinate that is not finite: {_shown(boxes[i])}")
    bad = ((boxes < -tolerance) | (boxes > 1 + tolerance)).any(1)
    if bad.any():
        i = int(np.argmax(bad))
        raise BoxProblem("box_outside", f"box {i} {_shown(boxes[i])} is outside [0, 1] "
                         f"(tolerance {tolerance:g})")
    boxes = boxes.clip(0, 1)
    bad = (boxes[:, 0] >= boxes[:, 2]) | (boxes[:, 1] >= boxes[:, 3])
    if bad.any():
        i = int(np.argmax(bad))
        raise BoxProblem("box_inverted", f"box {i} {_shown(boxes[i])} has xmin >= xmax or ymin >= ymax")
    bad = (labels < 1) | ((labels > num_classes) if num_classes else False)
    if np.any(bad):
        i = int(np.argmax(bad))
        where = f"1..{num_classes}" if num_classes else "1.. (0 is background)"
        raise BoxProblem("box_label_range", f"box {i} has label {int(labels[i])} outside the label map {where}")
    return boxes, labels


def _shown(box) -> str:
    return "(" + ", ".join("nan" if math.isnan(v) else f"{v:.4g}" for v in box.tolist()) + ")"


def read_detection_example(data: bytes, num_classes: int | None = None):
    """(image bytes, (N, 4) boxes, (N,) labels) of one record's bytes; BoxProblem if its boxes are bad."""
    example = decode_example(data)
    return example[IMAGE_KEY][0], *read_boxes(example, num_classes)
