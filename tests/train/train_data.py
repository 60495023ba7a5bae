"""Small real training data and configs: PNG images in TFRecords, learnable by a small CNN in seconds."""

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from data_tools.example import encode_example
from data_tools.tfrecord import write_records

CLASSES = ("left", "right", "top")


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode="L").save(buf, format="PNG")
    return buf.getvalue()


def image_records(n: int, seed: int, size: int = 8):
    """tf.train.Example records: 8x8 grayscale noise with a bright left/right/top half by class."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        label = i % len(CLASSES)
        img = rng.integers(0, 100, (size, size))
        half = size // 2
        region = {0: (slice(None), slice(0, half)), 1: (slice(None), slice(half, None)), 2: (slice(0, half), slice(None))}
        img[region[label]] += 120
        yield encode_example({"image/encoded": _png(img.astype(np.uint8)), "image/format": b"png",
                              "image/class/label": label, "image/class/text": CLASSES[label]})


def make_config(tmp_path: Path, name: str = "run", train_records: int = 256, val_records: int = 33,
                **sections) -> Path:
    """Two train shards + one val shard, and a config training small_cnn on them (overrides per section).

    33 validation records: the two ranks get 17 and 16, two batches against one.
    """
    data = tmp_path / "data"
    if not data.exists():
        data.mkdir()
        half = train_records // 2
        write_records(data / "train-0.tfrecord", image_records(half, seed=1))
        write_records(data / "train-1.tfrecord", image_records(train_records - half, seed=2))
        write_records(data / "val-0.tfrecord", image_records(val_records, seed=3))
    config = {
        "run": {"name": name, "out_dir": "runs", "seed": 7, "deterministic": True, "log_every": 4},
        "data": {"train": ["data/train-*.tfrecord"], "val": ["data/val-*.tfrecord"], "classes": list(CLASSES),
                 "image_size": 8, "channels": 1, "mean": [0.3], "std": [0.25], "num_workers": 0},
        "model": {"architecture": "small_cnn"},
        "optimizer": {"name": "adamw", "lr": 0.003, "weight_decay": 0.01},
        "schedule": {"warmup_steps": 3, "min_lr_ratio": 0.1},
        "train": {"epochs": 3, "batch_size": 16, "precision": "fp32", "grad_clip": 1.0},
        "checkpoint": {"every_steps": 5, "keep_last": 2, "keep_best": 1, "min_free_gb": 0.0},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    lines = []
    for section, values in config.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml(value)}" for key, value in values.items()]
    path = tmp_path / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(value) -> str:
    """JSON is TOML for strings, numbers, booleans and lists; tables are written inline."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def config_over_shared_data(data_dir: Path, tmp_path: Path, name: str = "campaign") -> Path:
    """A config in tmp_path whose [data] files are data_dir's (one small dataset made once by
    make_config for many config cases) and whose runs go under tmp_path."""
    text = make_config(data_dir, name=name).read_text()
    copy = tmp_path / "train.toml"
    copy.write_text(text.replace('"data/', f'"{data_dir}/data/').replace('out_dir = "runs"',
                                                                         f'out_dir = "{tmp_path}/runs"'))
    return copy
