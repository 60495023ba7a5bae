"""Decode one encoded image and measure it: format, size, channels, brightness, contrast, hash.

The perceptual hash is a 64-bit difference hash (dHash: sign of horizontal gradients on a 9x8
grey thumbnail). It survives re-encoding, small resizes and brightness shifts, which is what
makes a near duplicate; the exact-duplicate check uses a content hash of the encoded bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io

import numpy as np
from PIL import Image

from data_tools.image_decode import DEFAULT_MAX_PIXELS, ImageProblem, decode_image, open_image


BLANK_CONTRAST = 1.0  # std of grey levels (0..255) below which an image carries no content


@dataclasses.dataclass(frozen=True)
class ImageProbe:
    format: str  # "jpeg", "png", ...
    width: int
    height: int
    channels: int
    brightness: float  # mean grey level, 0..255
    contrast: float  # std of grey levels, 0..255
    phash: int  # 64-bit difference hash


def content_hash(data: bytes) -> bytes:
    """16 bytes of blake2b: enough to tell images apart, half the memory of sha256."""
    return hashlib.blake2b(data, digest_size=16).digest()


def probe_image(encoded: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageProbe:
    """Decode and measure; raises ImageProblem for undecodable, oversized or blank images.

    The bytes go through data_tools.image_decode, the bounded decoder training uses too. A JPEG
    decodes at 1/2..1/8 scale directly (DCT scaling): the statistics need no more, and the whole
    stream is still entropy-decoded, so truncation is caught."""
    img = open_image(encoded, max_pixels)
    fmt = (img.format or "unknown").lower()
    width, height = img.size
    channels = len(img.getbands())
    grey = decode_image(encoded, "L", max_pixels, draft=(128, 128))
    pixels = np.asarray(grey, dtype=np.float32)
    brightness, contrast = float(pixels.mean()), float(pixels.std())
    if contrast < BLANK_CONTRAST:
        raise ImageProblem("blank_image", f"blank {width}x{height} image (every pixel about {brightness:.0f})")
    return ImageProbe(fmt, width, height, channels, brightness, contrast, difference_hash(grey))


def difference_hash(grey: Image.Image) -> int:
    small = np.asarray(grey.resize((9, 8), Image.Resampling.BILINEAR), dtype=np.int16)
    bits = (small[:, 1:] > small[:, :-1]).flatten()
    return int(np.packbits(bits).view(">u8")[0])


def thumbnail_png(encoded: bytes, size: int = 96) -> bytes | None:
    """A small PNG of the image for the HTML report, or None when it does not decode."""
    try:
        img = decode_image(encoded, "RGB", draft=(size, size))
    except ImageProblem:  # a thumbnail is decoration; a bad image just has none
        return None
    img.thumbnail((size, size))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()
