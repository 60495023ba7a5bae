"""What the deploy stages ask the detection task: samples with their boxes from TFRecords, mAP@.5
of raw outputs, and box agreement between two runtimes' raw outputs."""

import io

import numpy as np
import pytest
from PIL import Image

from appliance.core.errors import DataError
from appliance.deploy.samples import load_samples
from appliance.tasks import task_for
from data_tools.detection import encode_detection_example
from data_tools.tfrecord import write_records

SIZE = 64
PREPROCESSING = {"image_size": SIZE, "mean": [0.5], "std": [0.2], "channel_order": "L"}
BOXES = [([[0.1, 0.1, 0.4, 0.45]], [1]), ([[0.5, 0.5, 0.9, 0.8], [0.05, 0.6, 0.3, 0.95]], [2, 1]), ([], [])]


def png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((48, 48), 100, np.uint8)).save(out, format="PNG")
    return out.getvalue()


def raw_for(targets, k=2, stride=8, logit=8.0):
    """Raw outputs [N, P, 5 + K] that decode to exactly the targets' boxes."""
    grid = SIZE // stride
    raw = np.full((len(targets), grid * grid, 5 + k), -12.0, np.float32)
    raw[..., :4] = 0.0
    for n, rows in enumerate(targets):
        for label, *box in rows[rows[:, 0] > 0]:
            x0, y0, x1, y1 = np.array(box) * SIZE
            i, j = int((y0 + y1) / 2 // stride), int((x0 + x1) / 2 // stride)
            px, py = (j + 0.5) * stride, (i + 0.5) * stride
            raw[n, i * grid + j, :4] = np.log(np.array([px - x0, py - y0, x1 - px, y1 - py]) / stride)
            raw[n, i * grid + j, 4] = logit
            raw[n, i * grid + j, 4 + int(label)] = logit
    return raw


def test_samples_carry_padded_boxes_and_the_task_scores_raw_outputs(tmp_path):
    path = tmp_path / "det.tfrecord"
    write_records(path, [encode_detection_example(png(), "png", 48, 48, np.array(b, np.float32).reshape(-1, 4), l)
                         for b, l in BOXES])
    samples = load_samples([path], PREPROCESSING)
    assert samples.x.shape == (3, 1, SIZE, SIZE) and samples.y.shape == (3, 2, 5)
    assert samples.y[1, :, 0].tolist() == [2, 1] and samples.y[2].sum() == 0
    assert np.allclose(samples.y[0, 0, 1:], BOXES[0][0][0])
    task = task_for({"kind": "detection"})
    perfect = raw_for(samples.y)
    assert task.score(perfect, samples.y) == pytest.approx(1.0)
    assert task.agreement(perfect, perfect) == 1.0
    moved = perfect.copy()
    moved[1, :, :4] += 0.8  # every box of image 1 grows 2.2 times each way: IoU about 0.2
    assert task.agreement(perfect, moved) == pytest.approx(1 / 3)
    assert task.score(moved, samples.y) < 1.0


def test_a_bad_box_in_the_samples_is_one_line(tmp_path):
    path = tmp_path / "bad.tfrecord"
    write_records(path, [encode_detection_example(png(), "png", 48, 48, np.array([[0.5, 0.1, 0.2, 0.4]], np.float32), [1])])
    with pytest.raises(DataError, match=r"bad.tfrecord: record 0: box 0 .* xmin >= xmax"):
        load_samples([path], PREPROCESSING)
