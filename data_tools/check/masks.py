"""The data check for segmentation records: each mask decodes, fits its image and holds valid class ids.

Active when the records carry `image/segmentation/class/encoded` (DeepLab's convention, see
data_tools.segmentation). Per record the scan keeps only the class ids present and their pixel
counts; the class range, when not given (--num-classes or the schema's num_classes), is
inferred from the pixels of each class, as classification labels are from records, and records with
stray classes are quarantined after the scan. The report gets a "segmentation" block: pixel
share and images per class, empty masks, the ignored share.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from data_tools.check.schema import infer_num_classes
from data_tools.image_decode import DEFAULT_MAX_PIXELS
from data_tools.segmentation import IGNORE_LABEL, MASK_KEY, MaskProblem, check_mask


def add_mask_keys(schema: dict, num_classes: int | None, ignore_label: int = IGNORE_LABEL) -> dict:
    """Mark a schema as segmentation when its records carry a mask; num_classes pins the class range."""
    if MASK_KEY in schema["features"] or schema.get("mask_key"):
        schema["mask_key"] = schema.get("mask_key") or MASK_KEY
        if schema.get("label_key") not in schema["features"]:  # the mask is the label: no class label to require
            schema["label_key"] = None
        schema["ignore_label"] = int(schema.get("ignore_label", ignore_label))
        if num_classes is not None:
            schema["num_classes"] = int(num_classes)
        schema["num_classes_given"] = schema.get("num_classes") is not None
    return schema


def mask_summary(example: dict, width: int, height: int, schema: dict,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[tuple | None, dict | None]:
    """((check, detail), None) for a bad mask, else (None, {"classes", "pixels"}) of a good one."""
    encoded = example.get(schema["mask_key"])
    if not isinstance(encoded, list) or len(encoded) != 1:
        return ("mask_decode", f"{schema['mask_key']} holds {len(encoded or [])} values, expected one PNG"), None
    for key, size in (("image/height", height), ("image/width", width)):
        declared = example.get(key)
        if declared is not None and len(declared) == 1 and not isinstance(declared, list) and int(declared[0]) != size:
            return ("declared_size", f"{key} = {int(declared[0])}, the image is {width}x{height}"), None
    given = schema["num_classes"] if schema.get("num_classes_given") else None
    try:
        classes, pixels = check_mask(encoded[0], width, height, given, schema["ignore_label"], max_pixels)
    except MaskProblem as err:
        return (err.check, err.detail), None
    return None, {"classes": classes.tobytes(), "pixels": pixels}


def empty_mask_note(mask: dict, ignore_label: int) -> tuple[str, str] | None:
    """A note (not a quarantine) for a mask with nothing but background and ignored pixels."""
    classes = set(mask["classes"])
    if classes <= {0, ignore_label}:
        what = "only ignored pixels" if classes == {ignore_label} else "no foreground class (background only)"
        return "empty_mask", f"mask has {what}"
    return None


def mask_range_from_all(results, schema: dict) -> list[tuple]:
    """Late rejections ((file index, record), check, detail) for classes past the inferred range."""
    if not schema.get("mask_key") or schema.get("num_classes_given"):
        return []
    ignore = schema["ignore_label"]
    # By pixels, not images: a stray id is a few pixels in a few masks, a real class is not.
    pixels: Counter = Counter()
    for r in results:
        for mask in r.masks.values():
            for c, n in zip(mask["classes"], mask["pixels"]):
                if c != ignore:
                    pixels[c] += int(n)
    k = infer_num_classes(pixels)
    if k is None:
        return []
    schema["num_classes"] = k
    return [((r.file_index, n), "mask_label_range",
             f"mask holds class {max(c for c in mask['classes'] if c != ignore)} outside 0..{k - 1} "
             f"and ignore {ignore}")
            for r in results for n, mask in r.masks.items()
            if any(c >= k and c != ignore for c in mask["classes"])]


def segmentation_report(results, schema: dict) -> dict | None:
    """The report's "segmentation" block over the records that passed every check."""
    if not schema.get("mask_key"):
        return None
    ignore, k = schema["ignore_label"], schema.get("num_classes") or 0
    # A mask holds ids 0..255; --num-classes may say more classes than a mask can hold (none of the
    # ids past 255 is then in any image, and the report says so instead of indexing past the counts).
    pixels = np.zeros(max(256, k), dtype=np.int64)
    images = np.zeros(max(256, k), dtype=np.int64)
    empty = masks = 0
    for r in results:
        clean = set(r.clean_records)
        for number, mask in r.masks.items():
            if number not in clean:
                continue
            masks += 1
            classes = np.frombuffer(mask["classes"], dtype=np.uint8)
            pixels[classes] += mask["pixels"]
            images[classes] += 1
            empty += empty_mask_note(mask, ignore) is not None
    total = int(pixels.sum())
    labelled = total - int(pixels[ignore])
    return {
        "mask_key": schema["mask_key"],
        "num_classes": k,
        "num_classes_source": "given" if schema.get("num_classes_given") else "inferred",
        "ignore_label": ignore,
        "masks": masks,
        "pixels": total,
        "ignored_pixel_share": int(pixels[ignore]) / total if total else 0.0,
        # Shares of the labelled (not ignored) pixels: what the loss sees.
        "pixel_share": {str(c): (int(pixels[c]) / labelled if labelled else 0.0) for c in range(k)},
        "images_per_class": {str(c): int(images[c]) for c in range(k)},
        "classes_in_no_image": [c for c in range(k) if images[c] == 0],
        "empty_masks": empty,
        "most_common_class": int(np.argmax(pixels[:k])) if k and labelled else None,
    }
