"""The segmentation task: figures from per-pixel confusion counts, the most-common-class gate, the
ignore label in loss and counts, every architecture's output, and [task] in the training config."""

import sys
from pathlib import Path

# The training tests' data helpers (train_data, seg_data) serve these tests too (no conftest here: a second
# conftest module would shadow tests/conftest.py for `from conftest import ...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))

import pytest
import torch

from appliance.core.errors import ConfigError
from appliance.tasks import task_for
from appliance.tasks.segmentation_figures import iou_figures, segmentation_quality
from appliance.tasks.segmentation_models import SEGMENTATION_ARCHITECTURES, build_segmentation_model
from appliance.tasks.segmentation import SEGMENTATION_ARCHITECTURES as LISTED
from appliance.tasks.thresholds import Thresholds
from appliance.train.config import load_config
from seg_data import make_seg_config
from train_data import make_config


def test_iou_figures_by_hand():
    # true \ predicted: background 90 px (80 right), scratch 10 px (6 right, 4 as background).
    confusion = [[80, 10], [4, 6]]
    f = iou_figures(confusion, ("background", "scratch"))
    assert f["iou"] == {"background": 80 / (90 + 84 - 80), "scratch": 6 / (10 + 16 - 6)}
    assert f["miou"] == pytest.approx((80 / 94 + 6 / 20) / 2) and f["pixel_acc"] == 86 / 100
    # A class in neither truth nor prediction has no IoU and is left out of the mean.
    g = iou_figures([[5, 0, 0], [0, 5, 0], [0, 0, 0]])
    assert g["iou"]["2"] is None and g["miou"] == 1.0


def test_the_gate_fails_a_model_that_paints_everything_background():
    # 90 % background: "background everywhere" scores pixel accuracy 90 % and mIoU 45 % (two classes present).
    everything_background = [[900, 0], [100, 0]]
    q = segmentation_quality(everything_background, ("surface", "crack"), Thresholds())
    assert q["baseline_miou"] == pytest.approx(0.45) and q["val_miou"] == pytest.approx(0.45)
    assert not q["passed"] and "below the" in q["failures"][0] and "predicts class 'surface'" in q["failures"][1]
    good = [[890, 10], [10, 90]]
    q = segmentation_quality(good, ("surface", "crack"), Thresholds())
    assert q["passed"] and q["required_miou"] == pytest.approx(0.45 + 0.1 * 0.55) and "gate passed" in q["verdict"]


def test_loss_and_counts_skip_ignored_pixels():
    task = task_for({"kind": "segmentation"})
    logits = torch.zeros(1, 3, 2, 2)
    logits[0, 1] = 5.0  # predicts class 1 everywhere
    labels = torch.tensor([[[1, 255], [0, 255]]])
    loss, correct, counted, pairs = task.eval_counts(logits, labels, 3)
    assert int(counted) == 2 and int(correct) == 1 and sorted(pairs.tolist()) == [1, 4]
    expected = torch.nn.functional.cross_entropy(logits[:, :, :, 0], labels[:, :, 0], reduction="sum")
    assert loss.item() == pytest.approx(expected.item())
    assert task.criterion()(logits, labels).item() == pytest.approx(expected.item() / 2)
    weighted = task_for({"kind": "segmentation", "class_weights": [1.0, 3.0, 1.0]}).criterion()
    assert weighted.weight.tolist() == [1.0, 3.0, 1.0] and weighted.ignore_index == 255


@pytest.mark.parametrize("architecture", SEGMENTATION_ARCHITECTURES)
def test_every_architecture_gives_logits_per_pixel(architecture):
    assert SEGMENTATION_ARCHITECTURES == LISTED
    model = build_segmentation_model(architecture, num_classes=4, in_channels=1).eval()
    with torch.no_grad():
        out = model(torch.rand(2, 1, 32, 48))
    assert out.shape == (2, 4, 32, 48)


def test_task_section_in_the_training_config(tmp_path):
    cfg = load_config(make_seg_config(tmp_path))
    assert cfg.task.kind == "segmentation" and task_for(cfg.task).kind == "segmentation"
    with pytest.raises(ConfigError, match=r"\[model\] architecture 'small_cnn' is not one of unet_small"):
        load_config(make_seg_config(tmp_path, name="b", model={"architecture": "small_cnn"}))
    with pytest.raises(ConfigError, match=r"\[task\] kind 'detection'"):
        load_config(make_seg_config(tmp_path, name="c", task={"kind": "detection"}))
    with pytest.raises(ConfigError, match=r"\[task\] class_weights"):
        load_config(make_seg_config(tmp_path, name="d", task={"class_weights": [1.0, 2.0]}))


def test_classification_configs_hash_and_read_as_before(tmp_path):
    plain = load_config(make_config(tmp_path))
    spelled = load_config(make_config(tmp_path, name="run", task={"kind": "classification"}))
    assert plain.training_hash() == spelled.training_hash() and "task" not in plain.to_dict()
    seg = load_config(make_seg_config(tmp_path))
    assert seg.to_dict()["task"]["kind"] == "segmentation"
