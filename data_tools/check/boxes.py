"""The data check for detection records: each record's boxes are well formed and inside the label map.

Active when the records carry `image/object/class/label` or `image/object/bbox/*` (the Object
Detection API's convention, see data_tools.detection). Quarantined (never trained on): per-box lists
of different lengths, a coordinate that is not finite, outside [0, 1] by more than BOX_TOLERANCE,
xmin >= xmax or ymin >= ymax, a label outside the label map (1..K; K given by --num-classes or the
schema's num_classes, else inferred from the box counts of all records as classification's labels
are). Reported, not quarantined: images with no boxes (allowed: they teach the background), boxes
under TINY_BOX_PIXELS on a side of the decoded image, and images with outlying box counts. The
report gets a "detection" block: boxes per class, their balance, boxes per image.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from data_tools.check.schema import infer_num_classes
from data_tools.detection import BOX_KEYS, BOX_TOLERANCE, LABEL_KEY, PER_BOX_KEYS, TEXT_KEY, BoxProblem, read_boxes

TINY_BOX_PIXELS = 4  # a box narrower or lower than this on the decoded image is noted
OUTLIER_IQR = 3.0  # boxes per image past Q3 + OUTLIER_IQR * IQR (and past twice the median) are noted


def add_box_keys(schema: dict, num_classes: int | None) -> dict:
    """Mark a schema as detection when its records carry boxes; per-box lists may hold any count."""
    if not (schema.get("box_keys") or LABEL_KEY in schema["features"] or BOX_KEYS[0] in schema["features"]):
        return schema
    schema["box_keys"] = True
    for key in PER_BOX_KEYS:
        spec = schema["features"].get(key)
        if spec is not None:  # a sample's counts say nothing about the next image's boxes
            spec.update(min_count=0, required=False)
            spec.pop("max_count", None)
            spec.pop("min", None), spec.pop("max", None)
    if schema.get("label_key") not in schema["features"]:  # the boxes are the labels
        schema["label_key"] = None
    if num_classes is not None:
        schema["num_classes"] = int(num_classes)
    schema["num_classes_given"] = schema.get("num_classes") is not None
    return schema


def box_summary(example: dict, width: int, height: int, schema: dict) -> tuple[tuple | None, dict | None]:
    """((check, detail), None) for bad boxes, else (None, {"labels", "tiny"}) of good ones."""
    for key, size in (("image/height", height), ("image/width", width)):
        declared = example.get(key)
        if declared is not None and len(declared) == 1 and not isinstance(declared, list) and int(declared[0]) != size:
            return ("declared_size", f"{key} = {int(declared[0])}, the image is {width}x{height}"), None
    given = schema["num_classes"] if schema.get("num_classes_given") else None
    try:
        boxes, labels = read_boxes(example, given)
    except BoxProblem as err:
        return (err.check, err.detail), None
    texts = example.get(TEXT_KEY)
    names = ({int(c): t[:64].decode("utf-8", "replace") for c, t in zip(labels.tolist(), texts)}
             if isinstance(texts, list) and len(texts) == len(labels) else {})
    sides = np.minimum((boxes[:, 2] - boxes[:, 0]) * width, (boxes[:, 3] - boxes[:, 1]) * height)
    return None, {"labels": labels.astype(np.int32).tobytes(), "tiny": int((sides < TINY_BOX_PIXELS).sum()), "names": names,
                  "smallest": float(sides.min()) if len(sides) else None}


def box_notes(summary: dict) -> list[tuple[str, str]]:
    """Notes (not quarantines): an image with no boxes, tiny boxes."""
    notes = []
    if not summary["labels"]:
        notes.append(("no_boxes", "image has no boxes (allowed: counted as background)"))
    if summary["tiny"]:
        notes.append(("tiny_box", f"{summary['tiny']} box(es) under {TINY_BOX_PIXELS} pixels on a side "
                                  f"(smallest {summary['smallest']:.1f})"))
    return notes


def _labels(summary: dict) -> np.ndarray:
    return np.frombuffer(summary["labels"], dtype=np.int32)


def box_range_from_all(results, schema: dict) -> list[tuple]:
    """Late rejections ((file index, record), check, detail) for labels past the inferred label map."""
    if not schema.get("box_keys") or schema.get("num_classes_given"):
        return []
    counts: Counter = Counter()
    for r in results:
        for summary in r.boxes.values():
            counts.update((_labels(summary) - 1).tolist())  # label maps start at 1: class index label - 1
    k = infer_num_classes(counts)
    if k is None:
        return []
    schema["num_classes"] = k
    return [((r.file_index, n), "box_label_range",
             f"box label {int(_labels(s).max())} outside the label map 1..{k} (inferred from all boxes)")
            for r in results for n, s in r.boxes.items() if len(_labels(s)) and _labels(s).max() > k]


def detection_report(results, schema: dict) -> dict | None:
    """The report's "detection" block over the records that passed every check."""
    if not schema.get("box_keys"):
        return None
    k = schema.get("num_classes") or 0
    per_class = np.zeros(k + 1, dtype=np.int64)
    images_per_class = np.zeros(k + 1, dtype=np.int64)
    counts, where = [], []
    tiny = 0
    names: dict = {}
    for r in results:
        clean = set(r.clean_records)
        for number, summary in r.boxes.items():
            if number not in clean:
                continue
            labels = _labels(summary)
            labels = labels[labels <= k]
            np.add.at(per_class, labels, 1)
            images_per_class[np.unique(labels)] += 1
            counts.append(len(labels))
            where.append((r.path, number))
            tiny += summary["tiny"]
            for c, name in summary["names"].items():
                names.setdefault(c, name)
    counts_a = np.asarray(counts or [0])
    q1, median, q3 = np.percentile(counts_a, [25, 50, 75])
    limit = max(q3 + OUTLIER_IQR * (q3 - q1), 2 * median, median + 2)
    outliers = [{"file": f, "record_number": n, "boxes": c} for (f, n), c in zip(where, counts) if c > limit]
    present = per_class[1:][per_class[1:] > 0]
    return {
        "label_key": LABEL_KEY,
        "num_classes": k,
        "num_classes_source": "given" if schema.get("num_classes_given") else "inferred",
        "coordinate_tolerance": BOX_TOLERANCE,
        "images": len(counts),
        "boxes": int(per_class.sum()),
        "images_without_boxes": int(sum(1 for c in counts if c == 0)),
        "boxes_per_class": {str(c): int(per_class[c]) for c in range(1, k + 1)},
        "images_per_class": {str(c): int(images_per_class[c]) for c in range(1, k + 1)},
        "class_names": {str(c): names.get(c) for c in range(1, k + 1) if names.get(c)},
        "classes_without_boxes": [c for c in range(1, k + 1) if per_class[c] == 0],
        "imbalance": float(present.max() / present.min()) if len(present) else None,
        "boxes_per_image": {"median": float(median), "max": int(counts_a.max()), "mean": float(counts_a.mean()),
                            "outlier_above": float(limit)},
        "box_count_outliers": outliers[:100],
        "tiny_boxes": tiny,
        "tiny_box_pixels": TINY_BOX_PIXELS,
    }
