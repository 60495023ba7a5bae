"""The demo's data: scikit-learn's bundled handwritten digits as TFRecord shards.

scikit-learn ships the 1,797 8x8 images of the UCI optical digits set inside its wheel, so
the demo needs no download. Pixels are 0..16 intensities; they become 8-bit grayscale PNGs
under the standard image-classification keys, exactly as a site's own data would look.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from data_tools.convert import shard_name
from data_tools.example import encode_example
from data_tools.index import build_index
from data_tools.tfrecord import TFRecordWriter

CLASS_NAMES = tuple(str(d) for d in range(10))


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8), mode="L").save(buf, format="PNG")
    return buf.getvalue()


def write_digits_shards(out_dir: str | Path, val_fraction: float = 0.2, shards: int = 2,
                        seed: int = 0) -> dict[str, list[Path]]:
    """Write train/val shards (stratified split) + indexes into out_dir; returns their paths."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.rint(digits.images * (255.0 / 16.0)).clip(0, 255)
    labels = digits.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    split = {"train": [], "val": []}
    for label in range(10):
        members = rng.permutation(np.flatnonzero(labels == label))
        n_val = int(round(len(members) * val_fraction))
        split["val"].extend(members[:n_val])
        split["train"].extend(members[n_val:])

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[Path]] = {}
    for name, members in split.items():
        members = rng.permutation(np.array(members))
        paths = []
        for shard in range(shards):
            path = out_dir / shard_name(name, shard, shards)
            with TFRecordWriter(path) as writer:
                for i in members[shard::shards]:
                    writer.write(encode_example({
                        "image/encoded": _png(images[i]),
                        "image/format": b"png",
                        "image/class/label": int(labels[i]),
                        "image/class/text": CLASS_NAMES[labels[i]].encode(),
                    }))
            build_index(path)
            paths.append(path)
        written[name] = paths
    return written
