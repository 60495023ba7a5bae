"""Make segmentation TFRecords (DeepLab convention) from an `images/` + `masks/` folder pair.

images/NAME.jpg|png and masks/NAME.png pair by stem. Grey PNG masks are stored byte for byte;
palette PNGs (Pascal VOC's) and other formats are written as grey PNGs of the same class ids. Whether each mask is valid
(size, class ids) is the data check's job: convert writes what it is given, so the check's
quarantine can name the exact record.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np

from appliance.core.errors import DataError
from appliance.core.manifest import write_manifest
from data_tools.image_decode import ImageProblem, open_image
from data_tools.convert import IMAGE_SUFFIXES, check_val_fraction, read_image, split_images, write_shards
from data_tools.segmentation import IGNORE_LABEL, MaskProblem, decode_mask, encode_segmentation_example, mask_png

MASK_SUFFIXES = (".png", ".bmp", ".tif", ".tiff", ".gif")


def is_mask_folder_pair(folder: str | os.PathLike) -> bool:
    """True when folder holds `images/` and `masks/` (and no other class folders)."""
    root = Path(folder)
    subdirs = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")} if root.is_dir() else set()
    return subdirs == {"images", "masks"}


def find_pairs(images_dir: str | os.PathLike, masks_dir: str | os.PathLike) -> list[tuple[Path, Path]]:
    """[(image, mask)] paired by file stem, sorted; an image without a mask (or the reverse) is an error."""
    images_dir, masks_dir = Path(images_dir), Path(masks_dir)
    for folder, what in ((images_dir, "images"), (masks_dir, "masks")):
        if not folder.is_dir():
            raise DataError(f"{folder}: not a directory (expected the {what} folder)")
    images = {p.stem: p for p in sorted(images_dir.iterdir()) if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES}
    masks = {p.stem: p for p in sorted(masks_dir.iterdir()) if p.is_file() and p.suffix.lower() in MASK_SUFFIXES}
    if not images:
        raise DataError(f"{images_dir}: no *.jpg|jpeg|png images found")
    missing = sorted(set(images) - set(masks))
    if missing:
        raise DataError(f"{masks_dir}: no mask for {len(missing)} image(s), e.g. {images[missing[0]].name} "
                        f"(expected {missing[0]}.png)")
    orphans = sorted(set(masks) - set(images))
    if orphans:
        raise DataError(f"{images_dir}: no image for {len(orphans)} mask(s), e.g. {masks[orphans[0]].name}")
    return [(images[stem], masks[stem]) for stem in sorted(images)]


def mask_stratum(mask_path: Path, ignore_label: int = IGNORE_LABEL) -> int:
    """The rarest-by-id foreground class in a mask (0 when only background): what the split stratifies on.

    The highest class id present stands for the image, so images with rare defect classes are
    dealt to validation in proportion instead of by chance.
    """
    classes = decode_mask(_mask_bytes(mask_path))
    present = np.unique(classes)
    present = present[present != ignore_label]
    return int(present.max()) if present.size else 0


def convert_mask_folders(images_dir, masks_dir, out_dir, shards: int = 1, prefix: str = "data", seed: int = 0,
                         progress: Callable[[int], None] | None = None, val_fraction: float = 0.0,
                         near_distance: int = 4) -> list[Path]:
    """Write shuffled, sharded, indexed DeepLab-convention TFRecords; returns the shard paths.

    With val_fraction > 0: the split_images rule (seeded, near duplicates on one side), stratified
    by mask_stratum, into train-* and val-* shards. out_dir gets manifest.json.
    """
    if shards < 1:
        raise DataError(f"--shards must be at least 1, not {shards}")
    check_val_fraction(val_fraction)
    pairs = find_pairs(images_dir, masks_dir)
    mask_of = dict(pairs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = {"images_dir": str(images_dir), "masks_dir": str(masks_dir), "shards": shards, "prefix": prefix,
              "seed": seed, "task": "segmentation", "made_by": "appliance data convert (images/ + masks/)"}
    if val_fraction > 0:
        strata = [(image, mask_stratum(mask)) for image, mask in pairs]
        split = split_images(strata, max(s for _, s in strata) + 1, val_fraction, seed, near_distance)
        params.pop("prefix")
        params["split"] = {"val_fraction": val_fraction, "near_distance": near_distance,
                           "groups_kept_together": split.groups_kept_together,
                           "counts": {"train": len(split.train), "val": len(split.val)}}
        sides = [("train", split.train, shards), ("val", split.val, max(1, round(shards * val_fraction)))]
    else:
        sides = [(prefix, [(image, 0) for image, _ in pairs], shards)]
    paths = []
    for name, images, count in sides:
        paths += _write_shards([(image, mask_of[image]) for image, _ in images], out, name, count, seed, progress)
    write_manifest(out, "convert", inputs=[p for pair in pairs for p in pair], params=params)
    return paths


def _mask_bytes(path: Path) -> bytes:
    """A grey PNG of class ids: grey PNGs as they are, anything else (palette PNGs, BMP, TIFF) re-encoded.

    Palette masks (Pascal VOC's) store the class id as the palette index; TensorFlow's decode_png
    would expand the palette to colours, so the index is written as grey, as DeepLab's
    remove_gt_colormap.py does before building its records.
    """
    data = path.read_bytes()
    try:  # both through the bounded decoder (data_tools.image_decode), as the check reads them later
        img = open_image(data, what="mask")
        if img.format == "PNG" and img.mode == "L":
            return data
        classes = decode_mask(data)
    except ImageProblem as err:
        raise DataError(f"{path}: {err.check}: {err.detail}") from None
    except MaskProblem as err:
        raise DataError(f"{path}: {err.check}: {err.detail}") from None
    return mask_png(classes)


def _image_size(path: Path, encoded: bytes) -> tuple[int, int]:
    try:
        return open_image(encoded).size
    except ImageProblem as err:
        raise DataError(f"{path}: {err.check}: {err.detail}") from None


def _write_shards(pairs: list[tuple[Path, Path]], out: Path, prefix: str, shards: int, seed: int,
                  progress: Callable[[int], None] | None) -> list[Path]:
    def encode(pair: tuple[Path, Path]) -> bytes:
        image, mask = pair
        encoded, fmt = read_image(image)
        width, height = _image_size(image, encoded)
        return encode_segmentation_example(encoded, fmt, height, width, _mask_bytes(mask), filename=image.stem)

    return write_shards(pairs, out, prefix, shards, seed, progress, encode)
