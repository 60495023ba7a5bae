"""Joint augmentation: one seeded geometry on image and mask (nearest for the mask), colour on the image only;
and the segmentation samples' one-line errors for masks that cannot be trained on."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from appliance.core.errors import DataError
from data_tools.augment_masks import JointTrainTransform, SegmentationSamples
from data_tools.dataset import TFRecordDataset
from data_tools.segmentation import MASK_KEY, encode_segmentation_example, mask_png
from data_tools.tfrecord import write_records

COLOURS = np.array([[40, 40, 40], [230, 30, 30], [30, 200, 60]], np.uint8)


def painted(size=(48, 64), seed=0):
    """A mask of blocks and an image whose colour is its class: any misalignment shows."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(size, np.uint8)
    for _ in range(6):
        r, c = rng.integers(0, size[0] - 12), rng.integers(0, size[1] - 12)
        mask[r:r + 12, c:c + 12] = rng.integers(1, 3)
    return COLOURS[mask], mask


def test_geometry_is_shared_and_the_mask_is_never_blended():
    image, mask = painted()
    t = JointTrainTransform(32, seed=3, hue=0.0, saturation=0.0, value=0.0, scale=(0.3, 1.0), mean=None, std=None)
    for index in range(12):
        x, m = t(Image.fromarray(image), mask, index)
        assert x.shape == (3, 32, 32) and m.shape == (32, 32) and m.dtype == torch.int64
        assert set(m.unique().tolist()) <= {0, 1, 2, 255}  # nearest: only ids that exist, or ignore
        # Where the mask says class c (away from edges, which bilinear softens), the image has c's colour.
        pixels = (x.permute(1, 2, 0).numpy() * 255)
        labelled = m.numpy() != 255
        nearest = np.argmin(((pixels[:, :, None, :] - COLOURS[None, None].astype(np.float32)) ** 2).sum(-1), -1)
        agree = (nearest == m.numpy())[labelled].mean()
        assert agree > 0.9, (index, agree)
        # The black corners rotation brings in are ignored in the mask.
        params = t.sample_params(48, 64, index)
        if abs(params.angle) > 5:
            assert (m == 255).any()
    a, b = t(Image.fromarray(image), mask, 5), t(Image.fromarray(image), mask, 5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    t.set_epoch(1)
    assert not torch.equal(t(Image.fromarray(image), mask, 5)[1], a[1])


def test_colour_changes_the_image_only():
    image, mask = painted()
    still = dict(degrees=0.0, scale=(1.0, 1.0), ratio=(64 / 48, 64 / 48), flip_probability=0.0, mean=None, std=None)
    plain = JointTrainTransform((48, 64), seed=1, hue=0.0, saturation=0.0, value=0.0, **still)
    jittered = JointTrainTransform((48, 64), seed=1, hue=0.1, saturation=0.1, value=0.1, **still)
    x0, m0 = plain(Image.fromarray(image), mask, 0)
    x1, m1 = jittered(Image.fromarray(image), mask, 0)
    assert torch.equal(m0, m1) and torch.equal(m0, torch.from_numpy(mask.astype(np.int64)))
    assert not torch.allclose(x0, x1)


def _png(a):
    out = io.BytesIO()
    Image.fromarray(a).save(out, format="PNG")
    return out.getvalue()


def test_samples_name_file_and_record_of_a_bad_mask(tmp_path):
    image, mask = painted((16, 16))
    good = encode_segmentation_example(_png(image), "png", 16, 16, mask_png(mask))
    small = encode_segmentation_example(_png(image), "png", 16, 16, mask_png(mask[:8]))
    stray = mask.copy()
    stray[0, 0] = 9
    wrong = encode_segmentation_example(_png(image), "png", 16, 16, mask_png(stray))
    path = tmp_path / "seg.tfrecord"
    write_records(path, [good, small, wrong])
    pre = {"image_size": 8, "mean": [0.5] * 3, "std": [0.25] * 3, "channel_order": "RGB"}
    samples = SegmentationSamples(TFRecordDataset([path], features={"image/encoded": "bytes", MASK_KEY: "bytes"}),
                                  num_classes=3, preprocessing=pre)
    x, m = samples[0]
    assert x.shape == (3, 8, 8) and m.shape == (8, 8)  # the evaluation grid of the edge preprocessing
    with pytest.raises(DataError, match=rf"{path}: record 1: mask_size: mask is 16x8, the image is 16x16"):
        samples[1]
    with pytest.raises(DataError, match=rf"{path}: record 2: mask_label_range: mask holds class 9 \(1 pixels\) outside 0..2 and ignore 255 "
                                         r"\(the config has 3 classes\)"):
        samples[2]
