"""The detection demo's data: the segmentation demo's seeded surfaces with defects, boxed, as
Object Detection API TFRecords.

Each image is a procedural surface (inspection._surface: metal, fabric, wood) with 1..4 defects of
three classes: 1 scratch (thin curved line), 2 spot (blob), 3 crack (branching thin path). Each
defect is drawn into its own mask, so its box is the exact pixel extent of that defect. Everything
comes from one numpy Generator, so a seed gives the same bytes every time.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from appliance.pipeline.inspection import _stroke, _surface, _walk
from data_tools.convert import shard_name
from data_tools.detection import encode_detection_example
from data_tools.index import build_index
from data_tools.tfrecord import TFRecordWriter

BOX_CLASSES = ("scratch", "spot", "crack")
LOOK = {1: (0.95, 0.95, 0.95), 2: (0.25, 0.2, 0.15), 3: (0.08, 0.08, 0.08)}


def _defect(rng: np.random.Generator, cls: int, size: int) -> np.ndarray:
    """One defect's (size, size) boolean mask."""
    mask = np.zeros((size, size), np.uint8)
    start = rng.uniform(0.2, 0.8, 2) * size
    if cls == 1:  # scratch: long, gently curved, a little wider than the segmentation demo's
        _stroke(mask, _walk(rng, start, rng.uniform(0, 2 * np.pi), 3, size / 10, 0.15), 1.0, 1)
    elif cls == 2:  # spot: an irregular blob
        yy, xx = np.mgrid[0:size, 0:size]
        r = rng.uniform(0.05, 0.1) * size
        ang = np.arctan2(yy - start[0], xx - start[1])
        mask[np.hypot(yy - start[0], xx - start[1]) <= r * (1 + 0.25 * np.sin(3 * ang + rng.uniform(0, 6)))] = 1
    else:  # crack: jagged trunk with a branch
        trunk = _walk(rng, start, rng.uniform(0, 2 * np.pi), 5, size / 18, 0.6)
        _stroke(mask, trunk, 0.8, 1)
        p = trunk[rng.integers(1, len(trunk))]
        _stroke(mask, _walk(rng, p, rng.uniform(0, 2 * np.pi), 2, size / 20, 0.6), 0.7, 1)
    return mask > 0


def make_sample(rng: np.random.Generator, size: int = 64):
    """One (H, W, 3) uint8 image, its (N, 4) normalised boxes and (N,) labels from 1."""
    img = _surface(rng, size)
    boxes, labels, taken = [], [], np.zeros((size, size), bool)
    for cls in rng.integers(1, 4, rng.integers(1, 5)):
        mask = _defect(rng, int(cls), size)
        if not mask.any() or (mask & taken).any():  # overlapping defects: one box would hide the other
            continue
        taken |= mask
        alpha = rng.uniform(0.6, 0.9)
        img[mask] = (1 - alpha) * img[mask] + alpha * np.array(LOOK[int(cls)])
        ys, xs = np.nonzero(mask)
        boxes.append((xs.min() / size, ys.min() / size, (xs.max() + 1) / size, (ys.max() + 1) / size))
        labels.append(int(cls))
    return (np.rint(np.clip(img, 0, 1) * 255).astype(np.uint8), np.array(boxes, np.float32).reshape(-1, 4),
            np.array(labels, np.int64))


def _png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def write_box_shards(out_dir: str | Path, count: int = 400, size: int = 64, val_fraction: float = 0.2,
                     shards: int = 2, seed: int = 0) -> dict[str, list[Path]]:
    """Write train/val Object Detection API shards + indexes into out_dir; returns their paths."""
    rng = np.random.default_rng(seed)
    n_val = int(round(count * val_fraction))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[Path]] = {}
    for name, n in (("train", count - n_val), ("val", n_val)):
        samples = [make_sample(rng, size) for _ in range(n)]
        paths = []
        for shard in range(shards):
            path = out_dir / shard_name(name, shard, shards)
            with TFRecordWriter(path) as writer:
                for i in range(shard, n, shards):
                    image, boxes, labels = samples[i]
                    writer.write(encode_detection_example(_png(image), "png", size, size, boxes, labels,
                                                          [BOX_CLASSES[c - 1] for c in labels],
                                                          filename=f"{name}_{i:05d}.png", source_id=f"{name}_{i:05d}"))
            build_index(path)
            paths.append(path)
        written[name] = paths
    return written
