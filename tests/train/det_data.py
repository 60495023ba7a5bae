"""Small real detection data: Object Detection API TFRecords a tiny FCOS learns in seconds."""

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from data_tools.detection import encode_detection_example
from data_tools.tfrecord import write_records

DET_CLASSES = ("spot", "hole")


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def scene(rng, size: int = 48):
    """Grey noise with 0..3 squares 8..14 pixels: bright ones (label 1), dark ones (label 2)."""
    image = rng.integers(90, 130, (size, size)).astype(np.int16)
    boxes, labels = [], []
    for _ in range(rng.integers(0, 4)):
        side = int(rng.integers(8, 15))
        x, y = (int(v) for v in rng.integers(0, size - side, 2))
        if any(x < b[2] + 2 and b[0] < x + side + 2 and y < b[3] + 2 and b[1] < y + side + 2 for b in boxes):
            continue
        label = int(rng.integers(1, 3))
        image[y:y + side, x:x + side] += 90 if label == 1 else -80
        boxes.append((x, y, x + side, y + side))
        labels.append(label)
    return image.clip(0, 255).astype(np.uint8), np.array(boxes, np.float32).reshape(-1, 4) / size, labels


def det_records(n: int, seed: int, size: int = 48):
    rng = np.random.default_rng(seed)
    for i in range(n):
        image, boxes, labels = scene(rng, size)
        yield encode_detection_example(_png(image), "png", size, size, boxes, labels,
                                       [DET_CLASSES[c - 1] for c in labels], filename=f"d{seed}-{i}")


def make_det_config(tmp_path: Path, name: str = "det", train_records: int = 96, val_records: int = 32,
                    **sections) -> Path:
    """Train and val shards and a config training fcos_tiny on them (overrides per section)."""
    data = tmp_path / "detdata"
    if not data.exists():
        data.mkdir()
        write_records(data / "train-0.tfrecord", det_records(train_records, seed=1))
        write_records(data / "val-0.tfrecord", det_records(val_records, seed=2))
    config = {
        "run": {"name": name, "out_dir": "runs", "seed": 5, "deterministic": True, "log_every": 4},
        "task": {"kind": "detection"},
        "data": {"train": ["detdata/train-*.tfrecord"], "val": ["detdata/val-*.tfrecord"],
                 "classes": list(DET_CLASSES), "image_size": 48, "channels": 1, "mean": [0.4], "std": [0.2],
                 "num_workers": 0},
        "model": {"architecture": "fcos_tiny"},
        "optimizer": {"name": "adamw", "lr": 0.003},
        "train": {"epochs": 6, "batch_size": 16, "precision": "fp32"},
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
