"""The segmentation demo's generated inspection data: seeded, every class present, readable back."""

import hashlib
import time

import numpy as np

from appliance.pipeline.inspection import make_sample, write_inspection_shards
from data_tools.segmentation import read_segmentation_example
from data_tools.tfrecord import read_records


def _records(paths):
    out = []
    for p in paths:
        out.extend(read_records(p))
    return out


def test_shards_are_seeded_split_and_cover_every_class(tmp_path):
    t0 = time.perf_counter()
    a = write_inspection_shards(tmp_path / "a", count=60, seed=3)
    took = time.perf_counter() - t0
    b = write_inspection_shards(tmp_path / "b", count=60, seed=3)
    c = write_inspection_shards(tmp_path / "c", count=60, seed=4)
    digest = lambda w: hashlib.sha256(b"".join(p.read_bytes() for p in w["train"] + w["val"])).hexdigest()
    assert digest(a) == digest(b) and digest(a) != digest(c)
    train, val = _records(a["train"]), _records(a["val"])
    assert (len(train), len(val)) == (48, 12)
    counts = np.zeros(4)
    for rec in train + val:
        _, mask = read_segmentation_example(rec)
        assert mask.shape == (64, 64) and mask.max() <= 3
        counts += np.bincount(mask.ravel(), minlength=4)[:4]
    assert (counts > 0).all()
    assert counts[0] / counts.sum() > 0.7  # defects are a minority, as on a real line
    assert took < 10


def test_defect_pixels_look_different_from_the_surface():
    rng = np.random.default_rng(0)
    for _ in range(10):
        img, mask = make_sample(rng, 64)
        assert img.shape == (64, 64, 3) and img.dtype == np.uint8
        if (mask == 3).any():  # cracks are dark
            assert img[mask == 3].mean() < img[mask == 0].mean()
