"""From TFRecord files to batches: decode, resize, normalise; the resumable sampler per rank.

`decode_image` is the single definition of preprocessing (export and the edge runner read the
same mean/std/size from the model card), so it lives in one function.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from appliance.errors import DataError


def decode_image(encoded: bytes, image_size: int, channels: int, mean, std) -> torch.Tensor:
    """PNG/JPEG bytes -> float32 tensor [C, H, W]: resized to image_size, normalised with mean/std."""
    try:
        image = Image.open(io.BytesIO(encoded))
        image = image.convert("RGB" if channels == 3 else "L")
    except Exception as err:  # PIL raises several types for damaged images
        raise DataError(f"undecodable image ({err})") from None
    if image.size != (image_size, image_size):
        image = image.resize((image_size, image_size), Image.BILINEAR)
    array = np.asarray(image, dtype=np.float32) / 255.0
    if array.ndim == 2:
        array = array[:, :, None]
    array = (array - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))
