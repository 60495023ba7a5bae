"""The one bounded decoder of untrusted image bytes: every image and mask a record carries, wherever
it is read (the data check, training on either decode path, calibration and verification samples,
the preview, mask conversion), is opened here.

The header is read first and the size judged against one pixel limit before any pixel is decoded,
so a PNG bomb (a 30000x30000 zero mask is 1 MB) or a JPEG whose frame header claims 12000x12000
costs what its header costs. Too large is ImageProblem("image_too_large"), anything else that does
not decode ImageProblem("image_decode"), with the same words everywhere: the check quarantines the
record with them, training refuses it with them and the record's address.

Imports only Pillow (numpy is not needed): the tasks read this module's names in `appliance --help`.
"""

from __future__ import annotations

import io
import re
import struct
import warnings

DEFAULT_MAX_PIXELS = 64_000_000  # width x height of one image or mask; `data check --max-pixels`, [data] max_pixels
# The most a site may allow: 1 G pixels is 3 GB as RGB, past any photograph we train on.
MAX_PIXELS_LIMIT = 1_000_000_000
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class ImageProblem(Exception):
    """The bytes cannot be used; .check names the data check's check ('image_decode', 'image_too_large',
    'blank_image'), .detail says what is wrong in one line."""

    def __init__(self, check: str, detail: str):
        super().__init__(detail)
        self.check, self.detail = check, detail


def too_large(what: str, width: int, height: int, max_pixels: int) -> ImageProblem:
    return ImageProblem("image_too_large", f"{what} is {width}x{height} = {width * height} pixels "
                                           f"> limit {max_pixels}")


def open_image(encoded: bytes, max_pixels: int = DEFAULT_MAX_PIXELS, what: str = "image"):
    """A PIL image with its header read and nothing decoded; ImageProblem when the bytes are not an
    image Pillow reads or it is larger than max_pixels.

    Pillow's own decompression-bomb guard stays on for the whole process: it is raised here, never
    lowered, only as far as a limit above Pillow's default asks (it refuses past twice its value at
    open(); ours decides first), and its refusal becomes image_too_large."""
    from PIL import Image, UnidentifiedImageError  # late: Pillow stays out of `appliance --help`

    if max_pixels > (Image.MAX_IMAGE_PIXELS or max_pixels):
        Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # judged below, in one line
            image = Image.open(io.BytesIO(bytes(encoded)))
    except UnidentifiedImageError:
        raise ImageProblem("image_decode", f"{what}: not an image format Pillow reads "
                                           f"(starts {bytes(encoded[:8])!r})") from None
    except Image.DecompressionBombError as err:  # past twice Pillow's limit: it says the pixel count only
        data = bytes(encoded[:24])
        if data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR":
            raise too_large(what, *struct.unpack(">II", data[16:24]), max_pixels) from None
        pixels = re.search(r"\((\d+) pixels\)", str(err))
        raise ImageProblem("image_too_large", f"{what} is {pixels.group(1) if pixels else 'more'} pixels "
                                              f"> limit {max_pixels}") from None
    except Exception as err:  # noqa: BLE001 - Pillow's plugins raise OSError, ValueError, SyntaxError, struct.error ...
        raise ImageProblem("image_decode", f"{what} header does not decode: {type(err).__name__}: {err}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise too_large(what, width, height, max_pixels)
    return image


def decode_image(encoded: bytes, mode: str | None = None, max_pixels: int = DEFAULT_MAX_PIXELS,
                 what: str = "image", draft: tuple[int, int] | None = None):
    """A loaded PIL image, converted to `mode` ("RGB", "L") when given; ImageProblem as open_image,
    and image_decode for pixel data that does not decode (truncated, damaged).
    draft: a JPEG may decode at 1/2..1/8 scale, no smaller than this (the whole stream is still read)."""
    image = open_image(encoded, max_pixels, what)
    fmt = (image.format or "unknown").lower()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if draft is not None:
                image.draft(mode or image.mode, draft)
            image.load()
            return image.convert(mode) if mode and image.mode != mode else image
    except Exception as err:  # noqa: BLE001 - Pillow raises several types for damaged pixel data
        raise ImageProblem("image_decode", f"{fmt} {what} does not decode: {type(err).__name__}: {err}") from None


def record_problem(err: ImageProblem) -> str:
    """Training's words for a record the data check quarantines: its check, then its detail."""
    return f"{err.check}: {err.detail} (the data check quarantines this record)"
