"""The one preprocessing function: shapes, order of steps, and one-channel models."""

import io

import numpy as np
import pytest
from PIL import Image

from data_tools.preprocessing import preprocess_image, preprocessing_of
from conftest import run_appliance  # noqa: F401  (shared helpers resolve from tests/)


def test_png_bytes_and_array_give_the_same_tensor(card):
    rng = np.random.default_rng(3)
    img = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    params = preprocessing_of(card)
    a, b = preprocess_image(buf.getvalue(), params), preprocess_image(img, params)
    assert a.shape == (3, 16, 16) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)


def test_mean_std_and_channel_order():
    params = {"image_size": 2, "mean": [0.5], "std": [0.25], "channel_order": "L"}
    white = np.full((2, 2, 3), 255, np.uint8)
    out = preprocess_image(white, params)
    assert out.shape == (1, 2, 2)
    np.testing.assert_allclose(out, 2.0)  # (1.0 - 0.5) / 0.25
    with pytest.raises(ValueError, match="mean/std"):
        preprocess_image(white, {**params, "channel_order": "RGB"})
