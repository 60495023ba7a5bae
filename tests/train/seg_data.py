"""Small real segmentation data: DeepLab-convention TFRecords a small U-Net learns in seconds."""

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from data_tools.segmentation import encode_segmentation_example, mask_png
from data_tools.tfrecord import write_records

SEG_CLASSES = ("surface", "scratch", "spot")


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def scene(rng, size: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Grey noise; a bright horizontal scratch (class 1) and a dark square spot (class 2); the last row ignored."""
    image = rng.integers(70, 110, (size, size)).astype(np.int16)
    mask = np.zeros((size, size), np.uint8)
    row, width = rng.integers(1, size - 3), rng.integers(size // 3, size - 2)
    col = rng.integers(0, size - width)
    mask[row:row + 2, col:col + width] = 1
    if rng.random() < 0.7:
        r, c = rng.integers(0, size - 4, 2)
        mask[r:r + 4, c:c + 4] = 2
    image[mask == 1] += 110
    image[mask == 2] -= 60
    mask[-1, :] = 255  # unlabelled border, as DeepLab datasets mark it
    return image.clip(0, 255).astype(np.uint8), mask


def seg_records(n: int, seed: int, size: int = 16):
    rng = np.random.default_rng(seed)
    for i in range(n):
        image, mask = scene(rng, size)
        yield encode_segmentation_example(_png(image), "png", size, size, mask_png(mask), filename=f"s{seed}-{i}")


def make_seg_config(tmp_path: Path, name: str = "seg", train_records: int = 96, val_records: int = 24,
                    **sections) -> Path:
    """Train and val shards and a config training unet_small on them (overrides per section)."""
    data = tmp_path / "segdata"
    if not data.exists():
        data.mkdir()
        write_records(data / "train-0.tfrecord", seg_records(train_records, seed=1))
        write_records(data / "val-0.tfrecord", seg_records(val_records, seed=2))
    config = {
        "run": {"name": name, "out_dir": "runs", "seed": 5, "deterministic": True, "log_every": 4},
        "task": {"kind": "segmentation"},
        "data": {"train": ["segdata/train-*.tfrecord"], "val": ["segdata/val-*.tfrecord"],
                 "classes": list(SEG_CLASSES), "image_size": 16, "channels": 1, "mean": [0.4], "std": [0.2],
                 "num_workers": 0},
        "model": {"architecture": "unet_small"},
        "optimizer": {"name": "adamw", "lr": 0.01},
        "train": {"epochs": 4, "batch_size": 8, "precision": "fp32"},
        "checkpoint": {"every_steps": 1000, "keep_last": 1, "keep_best": 0, "min_free_gb": 0.0},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    lines = []
    for section, values in config.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    path = tmp_path / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path
