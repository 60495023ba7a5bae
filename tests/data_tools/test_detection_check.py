"""`appliance data check` on detection records: every bad box kind quarantined with file, record and
reason; images without boxes, tiny boxes and box-count outliers reported; boxes per class counted."""

import io
import json

import numpy as np
from PIL import Image

from data_tools.check.run import run_check
from data_tools.detection import encode_detection_example, read_detection_example
from data_tools.tfrecord import TFRecordWriter, read_records

H, W = 40, 50


def png(rng) -> bytes:
    out = io.BytesIO()
    Image.fromarray((rng.random((H, W, 3)) * 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def write_records(path, num_bad_label=9):
    """40 records: 5 bad (lengths, outside, inverted, NaN, unknown label), 2 without boxes, 1 tiny box,
    1 with 12 boxes (an outlier among 1-2), the rest one or two boxes of classes 1..3."""
    rng = np.random.default_rng(0)
    reasons = {}
    good = [[0.1, 0.1, 0.5, 0.6]], [1]
    with TFRecordWriter(path) as w:
        for i in range(40):
            boxes, labels = [[0.1, 0.1, 0.5, 0.6], [0.55, 0.2, 0.9, 0.8]][: 1 + i % 2], [1 + i % 3, 1 + (i + 1) % 3][: 1 + i % 2]
            extra = {}
            if i == 1:
                boxes, labels, reasons[i] = good[0], [1, 2], "box_lengths"
            elif i == 3:
                boxes, labels, reasons[i] = [[0.1, 0.1, 1.2, 0.5]], [1], "box_outside"
            elif i == 5:
                boxes, labels, reasons[i] = [[0.6, 0.1, 0.2, 0.5]], [2], "box_inverted"
            elif i == 7:
                boxes, labels, reasons[i] = [[0.1, float("nan"), 0.4, 0.5]], [2], "box_nonfinite"
            elif i == 9:
                boxes, labels, reasons[i] = [[0.1, 0.1, 0.4, 0.5]], [num_bad_label], "box_label_range"
            elif i in (10, 12):
                boxes, labels = np.zeros((0, 4)), []
            elif i == 11:
                boxes, labels = [[0.1, 0.1, 0.13, 0.5]], [3]  # 1.5 pixels wide
            elif i == 13:
                boxes = [[0.075 * k, 0.1, 0.075 * k + 0.1, 0.3] for k in range(12)]
                labels = [1 + k % 3 for k in range(12)]
            texts = [["scratch", "dent", "stain"][c - 1] if 1 <= c <= 3 else "?" for c in labels]
            w.write(encode_detection_example(png(rng), "png", H, W, boxes, labels, texts, **extra))
    return reasons


def test_check_quarantines_every_bad_box_kind_with_file_record_and_reason(tmp_path):
    data = tmp_path / "det.tfrecord"
    expected = write_records(data)
    report, status = run_check([(str(data), None)], tmp_path / "chk", progress=False)
    assert status == 0
    assert report["records_valid"] == 35 and report["records_quarantined"] == 5
    lines = [json.loads(x) for x in (tmp_path / "chk" / "quarantine" / "reasons.jsonl").read_text().splitlines()[1:]]
    assert {(x["record_number"], x["check"]) for x in lines} == set(expected.items())
    assert all(x["file"] == str(data) and x["offset"] is not None and x["detail"] for x in lines)
    # Never trained on: clean/ holds exactly the good records, each readable with the label map 1..3.
    clean = list(read_records(tmp_path / "chk" / "clean" / "det.tfrecord"))
    assert len(clean) == 35 and all(read_detection_example(r, num_classes=3) for r in clean)
    det = report["detection"]
    assert det["num_classes"] == 3 and det["num_classes_source"] == "inferred"
    assert det["images"] == 35 and det["images_without_boxes"] == 2 and det["tiny_boxes"] == 1
    # 35 good records: 2 without boxes, one of 12; of the other 32, those at even i hold one box, odd two.
    counted = {11: 1, 13: 12, **{i: 0 for i in (1, 3, 5, 7, 9, 10, 12)}}
    assert det["boxes"] == sum(det["boxes_per_class"].values()) == sum(counted.get(i, 1 + i % 2) for i in range(40))
    assert det["class_names"] == {"1": "scratch", "2": "dent", "3": "stain"}
    assert [o["record_number"] for o in det["box_count_outliers"]] == [13]
    notes = {(n["record_number"], n["check"]) for n in report["notes"]}
    assert {(10, "no_boxes"), (12, "no_boxes"), (11, "tiny_box")} <= notes


def test_given_num_classes_quarantines_labels_past_it_during_the_scan(tmp_path):
    data = tmp_path / "det.tfrecord"
    write_records(data, num_bad_label=3)  # record 9's label is then in range...
    report, _ = run_check([(str(data), None)], tmp_path / "chk", progress=False, num_classes=2)
    # ...but the user says two classes: every record with a class-3 box goes as well.
    assert report["detection"]["num_classes"] == 2 and report["detection"]["num_classes_source"] == "given"
    assert report["checks"]["box_label_range"] >= 4
    assert "3" not in report["detection"]["boxes_per_class"]
