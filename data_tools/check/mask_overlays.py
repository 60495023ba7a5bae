"""Mask overlays for the data check's HTML report: each class in its colour over its image.

Shown: a few valid records chosen so that every class appears where it can (rarest first),
and the first quarantined records of each mask check with the reason as the caption (their
image only, since a bad mask cannot be laid over it).
"""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

from data_tools.check.image_probe import thumbnail_png
from data_tools.example import decode_example
from data_tools.image_decode import ImageProblem, decode_image
from data_tools.tfrecord import read_records

MAX_OVERLAYS = 12
MAX_BAD_MASKS = 8
THUMB = 128
ALPHA = 0.55
MASK_CHECKS = ("mask_decode", "mask_size", "mask_label_range", "declared_size")
# Class 0 (background) is left clear; the others take these colours in turn.
PALETTE = np.array([(0, 0, 0), (230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48),
                    (145, 30, 180), (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212),
                    (0, 128, 128), (170, 110, 40), (128, 0, 0), (0, 0, 128), (128, 128, 0)], dtype=np.float32)
IGNORE_COLOUR = np.array((255, 255, 255), dtype=np.float32)


def class_colour(c: int) -> tuple[int, int, int]:
    return tuple(int(v) for v in PALETTE[c % len(PALETTE)]) if c else (0, 0, 0)


def overlay_png(image: bytes, mask: bytes, ignore_label: int, size: int = THUMB) -> bytes | None:
    """A small PNG: the image with each class blended in its colour (ignored pixels whitened)."""
    try:
        rgb = decode_image(image, "RGB")
        classes = decode_image(mask, what="mask")
        classes = classes if classes.mode in ("L", "P") else classes.convert("L")
    except ImageProblem:  # an overlay is decoration; a record that fails has none
        return None
    scale = min(1.0, size / max(rgb.size))
    target = (max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale)))
    pixels = np.asarray(rgb.resize(target, Image.Resampling.BILINEAR), dtype=np.float32)
    ids = np.asarray(classes.resize(target, Image.Resampling.NEAREST)).astype(np.int64)
    colours = PALETTE[ids % len(PALETTE)]
    colours[ids == ignore_label] = IGNORE_COLOUR
    painted = (ids != 0)[..., None]
    blended = np.where(painted, (1 - ALPHA) * pixels + ALPHA * colours, pixels)
    out = io.BytesIO()
    Image.fromarray(blended.round().astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def collect_overlays(out, report: dict, results, names) -> dict:
    """{"valid": [items], "bad": [items], "colours": {class: "#rrggbb"}}; items as thumbnails.py's."""
    seg = report["segmentation"]
    ignore, image_key, mask_key = seg["ignore_label"], report["schema"]["image_key"], seg["mask_key"]
    wanted = _pick_valid(results, seg)
    valid = []
    for i, result in enumerate(results):
        picks = {n for f, n in wanted if f == i}
        if not picks:
            continue
        positions = {pos: n for pos, n in enumerate(result.clean_records) if n in picks}
        for pos, data in enumerate(read_records(out / "clean" / names[i])):
            if pos in positions:
                ex = decode_example(bytes(data), (image_key, mask_key))
                png = overlay_png(ex[image_key][0], ex[mask_key][0], ignore)
                classes = sorted(c for c in result.masks[positions[pos]]["classes"] if c not in (0, ignore))
                valid.append(_item(result.path, positions[pos], png, "classes " + (" ".join(map(str, classes)) or "none")))
            if pos >= max(positions):
                break
    return {"valid": valid, "bad": _bad_masks(out, results, names, image_key),
            "colours": {str(c): "#%02x%02x%02x" % class_colour(c) for c in range(1, seg["num_classes"])}}


def _pick_valid(results, seg) -> list[tuple[int, int]]:
    """Records to show: for each class, rarest first, one record holding it; then the first others."""
    ignore = seg["ignore_label"]
    order = sorted(range(1, seg["num_classes"]), key=lambda c: seg["images_per_class"].get(str(c), 0))
    clean = [(i, n, set(r.masks[n]["classes"]) - {0, ignore})
             for i, r in enumerate(results) for n in r.clean_records if n in r.masks]
    chosen: list[tuple[int, int]] = []
    for c in order:
        hit = next(((i, n) for i, n, cs in clean if c in cs and (i, n) not in chosen), None)
        if hit and len(chosen) < MAX_OVERLAYS:
            chosen.append(hit)
    for i, n, _ in clean:
        if len(chosen) >= MAX_OVERLAYS:
            break
        if (i, n) not in chosen:
            chosen.append((i, n))
    return chosen


def _bad_masks(out, results, names, image_key) -> list[dict]:
    items = []
    for i, result in enumerate(results):
        bad = {r["record_number"]: f"{r['check']}: {r['detail']}" for r in result.reasons if r["check"] in MASK_CHECKS}
        if not bad or len(items) >= MAX_BAD_MASKS:
            continue
        positions = {pos: n for pos, n in enumerate(result.quarantined_records) if n in bad}
        for pos, data in enumerate(read_records(out / "quarantine" / names[i])):
            if pos in positions and len(items) < MAX_BAD_MASKS:
                encoded = decode_example(bytes(data), (image_key,)).get(image_key)
                png = thumbnail_png(encoded[0]) if encoded else None
                items.append(_item(result.path, positions[pos], png, bad[positions[pos]]))
    return items


def _item(path: str, number: int, png: bytes | None, caption: str) -> dict:
    item = {"file": path, "record_number": number, "caption": caption,
            "png": base64.b64encode(png).decode("ascii") if png else None}
    if png:
        item["width"], item["height"] = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    return item

