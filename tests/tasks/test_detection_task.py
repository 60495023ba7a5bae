"""The detection task: COCO figures by faster-coco-eval cross-checked with pycocotools, the
box-prior gate, decoding + per-class NMS + top-k, and the FCOS loss's assignment."""

import numpy as np
import pytest
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from appliance.tasks import task_for
from appliance.tasks.detection_decode import decode_image, decoding_spec
from appliance.tasks.detection_metrics import detection_quality, detection_rows, map_figures, per_class_ap
from appliance.tasks.detection_models import FCOSLoss, TinyFCOS


def scenes(seed=0, n=30, k=3):
    rng = np.random.default_rng(seed)
    truths, detections = [], []
    for i in range(n):
        m = int(rng.integers(0, 4))
        xy = rng.uniform(0, 60, (m, 2))
        boxes = np.concatenate([xy, xy + rng.uniform(6, 30, (m, 2))], 1)
        labels = rng.integers(1, k + 1, m)
        truths.append((boxes, labels))
        noisy = boxes + rng.normal(0, 2.5, boxes.shape)
        extra = rng.uniform(0, 60, (2, 2))
        detections.append((np.concatenate([noisy, np.concatenate([extra, extra + 12], 1)]),
                           rng.uniform(0, 1, m + 2), np.concatenate([labels, rng.integers(1, k + 1, 2)])))
    return truths, detections


def test_faster_coco_eval_agrees_with_pycocotools_per_class_and_with_cocoeval_stats():
    truths, detections = scenes()
    ours = per_class_ap(truths, detections, 3, 96)
    theirs = per_class_ap(truths, detections, 3, 96, coco=(COCO, COCOeval))
    assert np.allclose(ours, theirs, atol=1e-9) and (ours > 0).all()
    # The mean over classes is COCOeval's own stats[0] / stats[1].
    from appliance.tasks.detection_metrics import COCO_of, coco_dicts
    gt, results = coco_dicts(truths, detections, 3, 96)
    truth = COCO_of(COCO, gt)
    e = COCOeval(truth, truth.loadRes(results), "bbox")
    e.evaluate(), e.accumulate(), e.summarize()
    f = map_figures(detection_rows(truths, detections, 3, 96))
    assert f["map"] == pytest.approx(e.stats[0], abs=1e-9) and f["map50"] == pytest.approx(e.stats[1], abs=1e-9)


def test_the_gate_compares_with_the_box_prior_and_a_perfect_model_passes():
    truths, _ = scenes(1)
    perfect = [(b, np.ones(len(b)), l) for b, l in truths]
    rows = detection_rows(truths, perfect, 3, 96)
    q = detection_quality(rows, ("a", "b", "c"))
    assert q["passed"] and q["val_map50"] == 1.0 and q["val_map"] == 1.0 and 0 <= q["baseline_map50"] < 0.5
    empty = [(np.zeros((0, 4)), np.zeros(0), np.zeros(0, np.int64)) for _ in truths]
    q = detection_quality(detection_rows(truths, empty, 3, 96), ("a", "b", "c"))
    assert not q["passed"] and q["val_map50"] == 0.0 and "box-prior baseline" in q["verdict"]


def raw_for(boxes_px, labels, spec, logit=6.0):
    """Raw outputs whose decoding is the given boxes at the points nearest their centres."""
    k, stride, grid = spec["num_classes"], spec["stride"], spec["grid"]
    raw = np.full((grid * grid, 5 + k), -8.0, np.float32)
    raw[:, :4] = 0.0
    for (x0, y0, x1, y1), c in zip(boxes_px, labels):
        i, j = int((y0 + y1) / 2 // stride), int((x0 + x1) / 2 // stride)
        px, py = (j + 0.5) * stride, (i + 0.5) * stride
        raw[i * grid + j, :4] = np.log(np.array([px - x0, py - y0, x1 - px, y1 - py]) / stride)
        raw[i * grid + j, 4] = logit
        raw[i * grid + j, 5 + c - 1] = logit
    return raw


def test_decoding_per_class_nms_and_top_k():
    spec = decoding_spec(64, 8, 2, max_detections=3)
    raw = raw_for([(10, 10, 30, 30), (40, 8, 60, 20)], [1, 2], spec)
    # Point 19 (x 28, y 20) predicts box A again: weakly as class 1 (suppressed by A) and as class 2 (kept: per class).
    raw[19, :4] = np.log(np.array([28 - 10, 20 - 10, 30 - 28, 30 - 20], np.float32) / 8)
    raw[19, 4], raw[19, 5], raw[19, 6] = 6.0, 2.0, 3.0
    boxes, scores, labels = decode_image(raw, spec)
    # B (point 14) and A (point 18) score the same: the lower point first; then class 2 at point 19.
    assert list(labels) == [2, 1, 2] and list(scores) == sorted(scores, reverse=True)
    assert np.allclose(boxes, [[40, 8, 60, 20], [10, 10, 30, 30], [10, 10, 30, 30]], atol=1e-3)
    assert len(decode_image(raw, {**spec, "max_detections": 1})[0]) == 1
    assert len(decode_image(raw, {**spec, "score_threshold": 0.999})[0]) == 0


def test_fcos_loss_assigns_each_box_and_falls_as_the_head_fits():
    torch.manual_seed(0)
    model, loss = TinyFCOS(2, 1), FCOSLoss(8)
    targets = torch.tensor([[[1, 0.1, 0.1, 0.45, 0.5], [2, 0.55, 0.5, 0.9, 0.95]], [[2, 0.3, 0.3, 0.7, 0.7], [0, 0, 0, 0, 0]]])
    matched, _ = loss.assign(targets, torch.stack(torch.meshgrid(torch.arange(8) * 8 + 4.0, torch.arange(8) * 8 + 4.0,
                                                                 indexing="xy"), -1).reshape(-1, 2), 64.0)
    assert set(matched[0].unique().tolist()) == {-1, 0, 1} and set(matched[1].unique().tolist()) == {-1, 0}
    x = torch.randn(2, 1, 64, 64)
    optimizer = torch.optim.Adam(model.parameters(), 0.01)
    first = None
    for _ in range(30):
        value = loss(model(x), targets)
        first = first if first is not None else value.item()
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
    assert torch.isfinite(value) and value.item() < 0.5 * first


def test_task_for_detection_reads_its_section():
    task = task_for({"kind": "detection", "score_threshold": 0.2, "iou_threshold": 0.6, "max_detections": 7})
    assert task.kind == "detection" and task.metric == "map50"
    assert task.card_extra()["task"] == {"kind": "detection", "score_threshold": 0.2, "iou_threshold": 0.6,
                                         "max_detections": 7, "stride": 8}
    assert task.spec(64, 8, 3)["grid"] == 8 and task.spec(64, 8, 3)["iou_threshold"] == 0.6
