"""The segmentation demo's data: seeded textured surfaces with defects, as DeepLab TFRecords.

Industrial inspection made offline: each image is a procedural surface (metal: brushed noise,
fabric: woven stripes, wood: bent grain) with 0..3 defects drawn on it. The mask's classes are
0 background, 1 scratch (thin line or curve), 2 spot (blob), 3 crack (branching thin path).
Everything comes from one numpy Generator, so a seed gives the same bytes every time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data_tools.convert import shard_name
from data_tools.index import build_index
from data_tools.segmentation import encode_segmentation_example, mask_png
from data_tools.tfrecord import TFRecordWriter

CLASS_NAMES = ("background", "scratch", "spot", "crack")


def _surface(rng: np.random.Generator, size: int) -> np.ndarray:
    """A (size, size, 3) float texture in 0..1: metal, fabric or wood."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    kind = rng.integers(3)
    noise = rng.normal(0, 1, (size, size)).astype(np.float32)
    if kind == 0:  # brushed metal: noise smeared along x
        k = 7
        gray = np.cumsum(noise, axis=1)
        gray = (gray[:, k:] - gray[:, :-k]) / k
        gray = np.pad(gray, ((0, 0), (0, k)), mode="edge") * 0.08 + 0.6
        tint = np.array([1.0, 1.0, 1.02])
    elif kind == 1:  # fabric: two crossing stripe sets
        f = rng.uniform(6, 12)
        gray = 0.5 + 0.12 * np.sin(2 * np.pi * f * x) * np.sin(2 * np.pi * f * y) + 0.03 * noise
        tint = rng.uniform(0.7, 1.1, 3)
    else:  # wood: bent grain lines
        f = rng.uniform(8, 16)
        gray = 0.55 + 0.15 * np.sin(2 * np.pi * f * (y + 0.1 * np.sin(3 * x + rng.uniform(0, 6)))) + 0.03 * noise
        tint = np.array([1.0, 0.75, 0.5])
    return np.clip(gray[..., None] * tint[None, None, :], 0, 1)


def _stroke(mask: np.ndarray, pts: np.ndarray, width: float, cls: int) -> None:
    """Paint a polyline of points (N, 2) with the given half width into mask."""
    size = mask.shape[0]
    yy, xx = np.mgrid[0:size, 0:size]
    for (y0, x0), (y1, x1) in zip(pts[:-1], pts[1:]):
        d = np.array([y1 - y0, x1 - x0])
        n2 = max(float(d @ d), 1e-6)
        t = np.clip(((yy - y0) * d[0] + (xx - x0) * d[1]) / n2, 0, 1)
        dist = np.hypot(yy - (y0 + t * d[0]), xx - (x0 + t * d[1]))
        mask[dist <= width] = cls


def _walk(rng: np.random.Generator, start: np.ndarray, angle: float, steps: int, step: float,
          bend: float) -> np.ndarray:
    pts = [start]
    for _ in range(steps):
        angle += rng.normal(0, bend)
        pts.append(pts[-1] + step * np.array([np.sin(angle), np.cos(angle)]))
    return np.array(pts)


def _defects(rng: np.random.Generator, size: int) -> np.ndarray:
    mask = np.zeros((size, size), np.uint8)
    for cls in rng.permutation([1, 2, 3])[: rng.integers(1, 4)]:
        start = rng.uniform(0.2, 0.8, 2) * size
        if cls == 1:  # scratch: long, gently curved, thin
            _stroke(mask, _walk(rng, start, rng.uniform(0, 2 * np.pi), 4, size / 8, 0.15), 0.8, 1)
        elif cls == 2:  # spot: an irregular blob
            yy, xx = np.mgrid[0:size, 0:size]
            r = rng.uniform(0.05, 0.11) * size
            ang = np.arctan2(yy - start[0], xx - start[1])
            wobble = 1 + 0.25 * np.sin(3 * ang + rng.uniform(0, 6))
            mask[np.hypot(yy - start[0], xx - start[1]) <= r * wobble] = 2
        else:  # crack: jagged trunk with branches
            trunk = _walk(rng, start, rng.uniform(0, 2 * np.pi), 6, size / 16, 0.6)
            _stroke(mask, trunk, 0.7, 3)
            for p in trunk[rng.integers(1, len(trunk), 2)]:
                _stroke(mask, _walk(rng, p, rng.uniform(0, 2 * np.pi), 3, size / 20, 0.6), 0.6, 3)
    return mask


def make_sample(rng: np.random.Generator, size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """One (H, W, 3) uint8 image and its (H, W) uint8 class mask."""
    img = _surface(rng, size)
    mask = _defects(rng, size)
    look = {1: (0.95, 0.95, 0.95), 2: (0.25, 0.2, 0.15), 3: (0.08, 0.08, 0.08)}
    for cls, colour in look.items():
        alpha = rng.uniform(0.6, 0.9)
        img[mask == cls] = (1 - alpha) * img[mask == cls] + alpha * np.array(colour)
    return np.rint(np.clip(img, 0, 1) * 255).astype(np.uint8), mask


def _png(pixels: np.ndarray) -> bytes:
    import io

    from PIL import Image  # lazy: PIL

    buf = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def write_inspection_shards(out_dir: str | Path, count: int = 320, size: int = 64, val_fraction: float = 0.2,
                            shards: int = 2, seed: int = 0) -> dict[str, list[Path]]:
    """Write train/val DeepLab shards + indexes into out_dir; returns their paths."""
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
                    image, mask = samples[i]
                    writer.write(encode_segmentation_example(_png(image), "png", size, size, mask_png(mask),
                                                             filename=f"{name}_{i:05d}.png"))
            build_index(path)
            paths.append(path)
        written[name] = paths
    return written
