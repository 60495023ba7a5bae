"""Seeded augmentation: parameters inside their documented bounds, reproducible per (seed, epoch, index)."""

import colorsys
import logging
import re

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from data_tools.augment import AugmentParams, EvalTransform, TrainTransform, jitter_hsv

IMAGE = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (3, 96, 128), dtype=np.uint8))


@pytest.fixture(autouse=True)
def one_thread():
    # As in a DataLoader worker: per-image ops on small tensors are slower, not faster, with
    # intra-op threads on a busy 2-core CI box.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _applied_params(caplog, transform, indexes, epoch=0):
    """The parameters __call__ really applied, read back from the debug log."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="data_tools.augment"):
        for i in indexes:
            transform(IMAGE, i, epoch)
    params = []
    for record in caplog.records:
        fields = dict(re.findall(r"'(\w+)': ([-\w.]+)", record.getMessage()))
        params.append({k: float(v) if k != "flip" else v == "True" for k, v in fields.items()})
    assert len(params) == len(indexes)
    return params


def test_applied_parameters_stay_inside_their_bounds(caplog):
    t = TrainTransform(64, seed=11, debug=True)  # defaults: 15 degrees, hue 0.1, saturation/value 0.1
    params = _applied_params(caplog, t, range(400))
    angles = np.array([p["angle"] for p in params])
    hues = np.array([p["hue_shift"] for p in params])
    sats = np.array([p["saturation_factor"] for p in params])
    vals = np.array([p["value_factor"] for p in params])
    assert np.abs(angles).max() <= 15 and np.abs(angles).max() > 14  # the whole range is used
    assert np.abs(hues).max() <= 0.1 and np.abs(hues).max() > 0.095
    for factors in (sats, vals):
        assert factors.min() >= 0.9 and factors.max() <= 1.1 and factors.max() - factors.min() > 0.19
    flips = [p["flip"] for p in params]
    assert 0.4 < sum(flips) / len(flips) < 0.6
    for p in params:
        assert 0 <= p["top"] and p["top"] + p["height"] <= 96 and 0 <= p["left"] and p["left"] + p["width"] <= 128


def test_custom_degrees_bound(caplog):
    t = TrainTransform(32, seed=0, degrees=5, hue=0.02, debug=True)
    params = _applied_params(caplog, t, range(300))
    assert max(abs(p["angle"]) for p in params) <= 5
    assert max(abs(p["hue_shift"]) for p in params) <= 0.02


def test_hue_unit_is_a_fraction_of_the_colour_circle():
    red = torch.zeros(3, 4, 4)
    red[0] = 1.0
    out = jitter_hsv(red.clone(), hue_shift=0.1, saturation_factor=1.0, value_factor=1.0)
    h, s, v = colorsys.rgb_to_hsv(*out[:, 0, 0].tolist())
    assert h * 360 == pytest.approx(36.0, abs=0.01) and s == pytest.approx(1.0) and v == pytest.approx(1.0)
    muted = torch.tensor([0.8, 0.4, 0.4]).view(3, 1, 1).expand(3, 2, 2).clone()
    out = jitter_hsv(muted, hue_shift=0.0, saturation_factor=1.1, value_factor=0.9)
    h, s, v = colorsys.rgb_to_hsv(*out[:, 0, 0].tolist())
    assert s == pytest.approx(0.5 * 1.1, abs=1e-5) and v == pytest.approx(0.8 * 0.9, abs=1e-5)


def test_same_seed_epoch_index_identical_and_independent_of_global_rng():
    a = TrainTransform(48, seed=5)
    b = TrainTransform(48, seed=5)  # a resumed run builds a fresh transform
    torch.manual_seed(0)
    x = a(IMAGE, 17, epoch=3)
    torch.manual_seed(12345)
    np.random.seed(1)
    assert torch.equal(x, b(IMAGE, 17, epoch=3))
    assert not torch.equal(x, a(IMAGE, 18, epoch=3))
    assert not torch.equal(x, a(IMAGE, 17, epoch=4))
    assert not torch.equal(x, TrainTransform(48, seed=6)(IMAGE, 17, epoch=3))
    assert a.sample_params(96, 128, 17, 3) == b.sample_params(96, 128, 17, 3)
    assert isinstance(a.sample_params(96, 128, 0), AugmentParams)


class _Images(Dataset):
    def __init__(self, transform):
        self.transform = transform

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return self.transform(IMAGE, i)


def test_dataloader_workers_do_not_change_augmentation():
    t = TrainTransform(32, seed=9)
    t.set_epoch(2)
    serial = torch.cat(list(DataLoader(_Images(t), batch_size=3, num_workers=0)))
    parallel = torch.cat(list(DataLoader(_Images(t), batch_size=3, num_workers=2)))
    assert torch.equal(serial, parallel)


def test_eval_transform_is_deterministic():
    t = EvalTransform(64)
    x = t(IMAGE)
    assert x.shape == (3, 64, 64) and x.dtype == torch.float32
    assert torch.equal(x, t(IMAGE, 5))
    grey = EvalTransform(32)(IMAGE[:1])
    assert grey.shape == (1, 32, 32)


def test_seeded_augmentation_over_checked_tfrecords(tmp_path):
    from check_datasets import make_planted
    from data_tools.augment import SeededAugmentation
    from data_tools.check.run import run_check
    from data_tools.dataset import TFRecordDataset

    planted = make_planted(tmp_path / "data", per_class=2, minority=2)
    run_check([(str(planted.val), None)], tmp_path / "out", progress=False)
    records = TFRecordDataset.for_classification([tmp_path / "out" / "clean" / "val.tfrecord"])
    t = TrainTransform(32, seed=4)
    data = SeededAugmentation(records, t)
    data.set_epoch(1)
    batches = list(DataLoader(data, batch_size=4, num_workers=2))
    images = torch.cat([b[0] for b in batches])
    assert images.shape == (len(records), 3, 32, 32)
    for i in (0, len(records) - 1):
        assert torch.equal(images[i], t(records[i][0], i, epoch=1))
