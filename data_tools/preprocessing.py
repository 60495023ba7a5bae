"""The one image preprocessing function: export parity, calibration, evaluation and the edge runner.

This file is copied verbatim into every edge package (python/preprocessing.py) so the device
computes exactly what the host measured. It must therefore import nothing but numpy and Pillow.
"""

from __future__ import annotations

import io

import numpy as np

PREPROCESSING_KEYS = ("image_size", "mean", "std", "channel_order")


def preprocessing_of(card) -> dict:
    """The preprocessing parameters of a ModelCard (or a dict holding them), as plain JSON types."""
    get = card.get if isinstance(card, dict) else lambda key: getattr(card, key)
    return {"image_size": int(get("image_size")), "mean": [float(v) for v in get("mean")],
            "std": [float(v) for v in get("std")], "channel_order": str(get("channel_order"))}


def preprocess_image(image, preprocessing: dict) -> np.ndarray:
    """An image (encoded bytes, a PIL image, or an HWC/HW uint8 array) -> float32 (C, H, W).

    Steps, in this order: convert to the card's channel order ("RGB" or "L"), resize to
    image_size x image_size with bilinear filtering, scale to [0, 1], subtract mean, divide by std.
    """
    from PIL import Image

    if isinstance(image, (bytes, bytearray, memoryview)):
        image = Image.open(io.BytesIO(bytes(image)))
        image.load()
    elif isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise ValueError(f"image arrays must be uint8, got {image.dtype}")
        image = Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[-1] == 1 else image)
    mode = preprocessing["channel_order"]
    if mode not in ("RGB", "L"):
        raise ValueError(f"channel_order must be 'RGB' or 'L', got {mode!r}")
    size = int(preprocessing["image_size"])
    image = image.convert(mode)
    if image.size != (size, size):
        image = image.resize((size, size), Image.BILINEAR)
    pixels = np.asarray(image, dtype=np.float32) / 255.0
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    mean = np.asarray(preprocessing["mean"], dtype=np.float32)
    std = np.asarray(preprocessing["std"], dtype=np.float32)
    if mean.size != pixels.shape[-1] or std.size != pixels.shape[-1]:
        raise ValueError(f"mean/std have {mean.size}/{std.size} values for {pixels.shape[-1]} channel(s)")
    return np.ascontiguousarray(((pixels - mean) / std).transpose(2, 0, 1), dtype=np.float32)
