"""Decode one encoded image and measure it: format, size, channels, brightness, contrast, hash.

The perceptual hash is a 64-bit difference hash (dHash: sign of horizontal gradients on a 9x8
grey thumbnail). It survives re-encoding, small resizes and brightness shifts, which is what
makes a near duplicate; the exact-duplicate check uses a content hash of the encoded bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError


DEFAULT_MAX_PIXELS = 64_000_000
BLANK_CONTRAST = 1.0  # std of grey levels (0..255) below which an image carries no content


class ImageProblem(Exception):
    """The image cannot be used; .check names the check ('image_decode', 'image_too_large', 'blank_image')."""

    def __init__(self, check: str, detail: str):
        super().__init__(detail)
        self.check, self.detail = check, detail


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

    Pillow's own decompression-bomb guard stays on for the whole process (the pipeline decodes
    calibration and verification images in it too): it is raised here, never lowered, only as far
    as a --max-pixels above Pillow's default asks, and its errors become image_too_large."""
    if max_pixels > (Image.MAX_IMAGE_PIXELS or max_pixels):
        Image.MAX_IMAGE_PIXELS = max_pixels  # Pillow refuses past twice this at open(): ours decides first
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # judged below, in one line
            img = Image.open(io.BytesIO(encoded))
        fmt = (img.format or "unknown").lower()
        width, height = img.size
        channels = len(img.getbands())
    except UnidentifiedImageError:
        raise ImageProblem("image_decode", f"not an image format Pillow reads (starts {encoded[:8]!r})") from None
    except Image.DecompressionBombError as err:
        raise ImageProblem("image_too_large", f"{err} (limit {max_pixels})") from None
    except (OSError, ValueError, SyntaxError) as err:
        raise ImageProblem("image_decode", f"image header does not decode: {err}") from None
    if width * height > max_pixels:
        raise ImageProblem("image_too_large", f"{width}x{height} = {width * height} pixels > limit {max_pixels}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # JPEG can decode at 1/2..1/8 scale directly (DCT scaling): the statistics need
            # no more, and the whole stream is still entropy-decoded, so truncation is caught.
            img.draft("L", (128, 128))
            grey = img.convert("L")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise ImageProblem("image_decode", f"{fmt} image does not decode: {err}") from None
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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img = Image.open(io.BytesIO(encoded))
            img.draft("RGB", (size, size))
            img = img.convert("RGB")
            img.thumbnail((size, size))
    except Exception:  # noqa: BLE001 - a thumbnail is decoration; a bad image just has none
        return None
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()
