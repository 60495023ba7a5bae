"""Segmentation records in TensorFlow DeepLab's convention, and the class masks inside them.

A record (tf.train.Example, as DeepLab's build_voc2012_data.py / build_ade20k_data.py write it):
  image/encoded                      the image (PNG or JPEG bytes)
  image/format                       "png" / "jpeg"
  image/height, image/width          int64, the image's size in pixels
  image/filename                     optional, the source file's stem
  image/segmentation/class/encoded   the mask: a one-channel PNG (grey or palette), one class id per pixel
  image/segmentation/class/format    "png"
Class ids are 0..num_classes-1; IGNORE_LABEL (255) marks pixels that count for nothing
(borders, unlabelled), as DeepLab's `ignore_label`.
"""

from __future__ import annotations

import io

from data_tools.image_decode import DEFAULT_MAX_PIXELS, ImageProblem, decode_image, open_image

IMAGE_KEY = "image/encoded"
MASK_KEY = "image/segmentation/class/encoded"
MASK_FORMAT_KEY = "image/segmentation/class/format"
IGNORE_LABEL = 255
# Pillow modes whose pixel value is the class id itself (palette PNGs: the index, as in VOC).
MASK_MODES = ("L", "P", "I;16", "I")


class MaskProblem(Exception):
    """A mask that cannot be trained on; .check is 'mask_decode', 'image_too_large', 'mask_size' or
    'mask_label_range'."""

    def __init__(self, check: str, detail: str):
        super().__init__(detail)
        self.check, self.detail = check, detail


def encode_segmentation_example(image: bytes, image_format: str, height: int, width: int, mask_png: bytes,
                                filename: str | None = None) -> bytes:
    """One DeepLab-convention record; the image and mask bytes are stored as given (no re-encode)."""
    features = {
        IMAGE_KEY: image,
        "image/format": image_format,
        "image/height": int(height),
        "image/width": int(width),
        MASK_KEY: mask_png,
        MASK_FORMAT_KEY: "png",
    }
    if filename is not None:
        features["image/filename"] = filename
    from data_tools.example import encode_example  # late: numpy; tasks read this module's keys in `appliance --help`

    return encode_example(features)


def mask_png(classes: np.ndarray) -> bytes:
    """A (H, W) array of class ids (0..255) as a one-channel PNG."""
    import numpy as np  # lazy: numpy/PIL stay out of `appliance --help`
    from PIL import Image, UnidentifiedImageError  # lazy: numpy/PIL stay out of `appliance --help`
    classes = np.asarray(classes)
    if classes.ndim != 2 or classes.min(initial=0) < 0 or classes.max(initial=0) > 255:
        raise ValueError(f"a mask is (H, W) of class ids 0..255, got shape {classes.shape}")
    out = io.BytesIO()
    Image.fromarray(classes.astype(np.uint8), mode="L").save(out, format="PNG")
    return out.getvalue()


def decode_mask(encoded: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """(H, W) uint8 class ids of a mask PNG; MaskProblem('mask_decode') when it is not one, and
    MaskProblem('image_too_large') past max_pixels (data_tools.image_decode, before any pixel is decoded)."""
    import numpy as np  # lazy: numpy/PIL stay out of `appliance --help`

    try:
        img = open_image(encoded, max_pixels, what="mask")
        if img.mode not in MASK_MODES:
            raise MaskProblem("mask_decode", f"mask is a {img.mode} image; a mask has one channel of class ids "
                                             f"(grey or palette PNG)")
        img = decode_image(encoded, None, max_pixels, what="mask")
        classes = np.asarray(img)
    except ImageProblem as err:
        if err.check == "image_too_large":
            raise MaskProblem(err.check, err.detail) from None
        if encoded.startswith(b"\x89PNG\r\n\x1a\n") and "not an image format" in err.detail:
            raise MaskProblem("mask_decode", f"mask PNG is damaged or truncated ({len(encoded)} bytes)") from None
        raise MaskProblem("mask_decode", err.detail) from None
    if classes.dtype != np.uint8:
        if classes.size and (classes.min() < 0 or classes.max() > 255):
            raise MaskProblem("mask_label_range", f"mask holds value {int(classes.max())}; class ids are 0..255")
        classes = classes.astype(np.uint8)
    return classes


def check_mask(encoded: bytes, width: int, height: int, num_classes: int | None,
               ignore_label: int = IGNORE_LABEL, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[np.ndarray, np.ndarray]:
    """(class ids present, their pixel counts) of a valid mask; MaskProblem otherwise.

    Valid: decodes to one channel within max_pixels, is width x height, and every value is a class
    id below num_classes (when known) or the ignore label (judge_mask: training's definition too).
    """
    return judge_mask(decode_mask(encoded, max_pixels), width, height, num_classes, ignore_label)


def judge_mask(classes: np.ndarray, width: int, height: int, num_classes: int | None,
               ignore_label: int = IGNORE_LABEL) -> tuple[np.ndarray, np.ndarray]:
    """check_mask on decoded class ids: the one definition of a valid mask, for the data check and training."""
    import numpy as np  # lazy: numpy/PIL stay out of `appliance --help`

    if classes.shape != (height, width):
        raise MaskProblem("mask_size", f"mask is {classes.shape[1]}x{classes.shape[0]}, the image is {width}x{height}")
    counts = np.bincount(classes.ravel(), minlength=256)
    present = np.flatnonzero(counts)
    if num_classes is not None:
        bad = present[(present >= num_classes) & (present != ignore_label)]
        if bad.size:
            raise MaskProblem("mask_label_range", f"mask holds class {int(bad[0])} ({int(counts[bad[0]])} pixels) "
                                                  f"outside 0..{num_classes - 1} and ignore {ignore_label}")
    return present.astype(np.uint8), counts[present].astype(np.int64)


def read_segmentation_example(data: bytes) -> tuple[bytes, np.ndarray]:
    """(encoded image, (H, W) uint8 class ids) of one record."""
    from data_tools.example import decode_example  # late: numpy; tasks read this module's keys in `appliance --help`

    example = decode_example(data, (IMAGE_KEY, MASK_KEY))
    return example[IMAGE_KEY][0], decode_mask(example[MASK_KEY][0])
