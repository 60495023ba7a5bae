"""Segmentation through the deploy seam: DeepLab records become (image, mask) samples on the model's
grid, and the task scores logits by mIoU (per pixel agreement), classification by top-1."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from seg_data import seg_records  # noqa: E402

from appliance.core.errors import DataError
from appliance.deploy.samples import load_samples
from appliance.tasks import task_for, task_of_metadata
from data_tools.tfrecord import write_records

PRE = {"image_size": 8, "mean": [0.4], "std": [0.2], "channel_order": "L"}


def test_masks_load_on_the_model_grid_with_nearest_neighbour(tmp_path):
    path = tmp_path / "val.tfrecord"
    write_records(path, seg_records(5, seed=3, size=16))
    s = load_samples([path], PRE)
    assert s.x.shape == (5, 1, 8, 8) and s.y.shape == (5, 8, 8) and s.y.dtype == np.int64
    assert set(np.unique(s.y)) <= {0, 1, 2, 255}  # nearest: no blended class ids
    assert (s.y[:, -1] == 255).all()  # the ignored last row survives the resize


def test_an_undecodable_mask_is_one_line_naming_the_file(tmp_path):
    from data_tools.segmentation import encode_segmentation_example

    good = next(seg_records(1, seed=1, size=8))
    from data_tools.example import decode_example
    image = decode_example(good, keys=["image/encoded"])["image/encoded"][0]
    path = tmp_path / "bad.tfrecord"
    write_records(path, [encode_segmentation_example(bytes(image), "png", 8, 8, b"not a png")])
    with pytest.raises(DataError, match="bad.tfrecord: record 0"):
        load_samples([path], PRE)


def test_segmentation_scores_miou_and_classification_top1():
    seg = task_of_metadata({"model_card": {"extra": {"task": {"kind": "segmentation", "ignore_label": 255}}}})
    masks = np.array([[[0, 1], [2, 255]]])
    logits = np.zeros((1, 3, 2, 2), np.float32)
    logits[0, 0, 0, 0] = logits[0, 1, 0, 1] = logits[0, 1, 1, 0] = 1  # pixel (1,0) wrong: 1 for 2
    assert seg.metric == "miou" and seg.score(logits, masks) == pytest.approx((1 + 0.5 + 0) / 3)
    assert seg.agreement(logits, logits) == 1.0
    cls = task_for(None)
    assert cls.metric == "top1" and cls.score(np.eye(3), np.array([0, 1, 1])) == pytest.approx(2 / 3)
    assert task_of_metadata({}).kind == "classification"


def test_a_segmentation_model_exports_4d_logits_with_a_dynamic_batch_and_parity(tmp_path):
    import onnx
    import torch

    from appliance.deploy.export import export_model
    from appliance.models import ModelCard, save_trained_model
    from appliance.tasks.segmentation_models import build_segmentation_model

    torch.manual_seed(0)
    card = ModelCard("unet_small", 3, 1, 16, mean=(0.4,), std=(0.2,), channel_order="L",
                     class_names=("surface", "scratch", "spot"),
                     extra={"task": {"kind": "segmentation", "ignore_label": 255}})
    save_trained_model(tmp_path / "model", build_segmentation_model("unet_small", 3, 1).eval(), card)
    val = tmp_path / "val.tfrecord"
    write_records(val, seg_records(6, seed=2, size=16))
    report = export_model(tmp_path / "model", tmp_path / "export", sample_files=[val])
    assert report["parity"]["passed"] and report["parity"]["samples"] == 6
    assert report["task"]["kind"] == "segmentation"
    out = onnx.load(str(tmp_path / "export" / "model.onnx")).graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in out] == ["batch", 3, 16, 16]
