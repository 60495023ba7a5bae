"""Generated image-classification TFRecord datasets with planted problems, for the data check tests.

Every planted problem is recorded in the returned `Planted` so tests compare the report with
what was built, not with hard-coded numbers.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
from PIL import Image

from data_tools.example import decode_example, encode_example
from data_tools.tfrecord import FRAME_BYTES, write_records

CLASSES = ["cat", "dog", "owl", "fox", "eel"]


def jpeg(rng: np.random.Generator, size=(64, 64), quality=90) -> bytes:
    """A textured image unlike any other: smooth random field plus noise."""
    w, h = size
    base = rng.integers(0, 256, (max(h // 16, 2), max(w // 16, 2), 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((w, h), Image.Resampling.BILINEAR)
    arr = np.asarray(img, dtype=np.int16) + rng.integers(-20, 21, (h, w, 3))
    out = io.BytesIO()
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def blank_jpeg(size=(64, 64), grey=128) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (grey, grey, grey)).save(out, format="JPEG")
    return out.getvalue()


def example(image: bytes, label: int, fmt: bytes = b"jpeg") -> bytes:
    text = CLASSES[label].encode() if 0 <= label < len(CLASSES) else b"unknown"
    return encode_example({"image/encoded": image, "image/format": fmt,
                           "image/class/label": label, "image/class/text": text})


@dataclasses.dataclass
class Planted:
    train: Path
    val: Path
    train_records: list  # the bytes of every record written, in order
    val_records: list
    bad: dict  # check -> [(split, record_number)]
    corrupt_record: int  # record number (in train) whose bytes were damaged on disk
    huge: tuple  # (split, record_number) of the huge image
    duplicate: tuple  # (split, record_number) of the in-split duplicate copy
    near: list  # [(split, record_number)]: the same picture encoded twice
    leaked: list  # [(split, record_number)] val copies of train images
    minority_class: int
    per_class: int


def make_planted(directory: Path, per_class: int = 30, minority: int = 2, seed: int = 7) -> Planted:
    """train: 4 classes x per_class + 1 class x minority + planted problems; val: clean + 2 leaked copies."""
    rng = np.random.default_rng(seed)
    train, bad = [], {}
    for label in range(len(CLASSES)):
        for _ in range(per_class if label < len(CLASSES) - 1 else minority):
            train.append(example(jpeg(rng), label))

    def plant(check, record):
        bad.setdefault(check, []).append(("train", len(train)))
        train.append(record)

    plant("image_decode", example(jpeg(rng)[:300], 1))  # truncated JPEG
    plant("image_decode", example(b"GIF89a but not really an image", 2))
    plant("blank_image", example(blank_jpeg(), 0))
    plant("label_range", example(jpeg(rng), 9))
    plant("parse", b"\xff\xff\xff\xff\xff")  # wire type 7: not a protobuf message
    huge = ("train", len(train))
    train.append(example(jpeg(rng, size=(1600, 1200), quality=60), 3))
    duplicate = ("train", len(train))
    train.append(train[5])  # an exact copy of record 5
    near = [("train", 0), ("train", len(train))]
    original = Image.open(io.BytesIO(decode_example(train[0])["image/encoded"][0]))
    reencoded = io.BytesIO()
    original.save(reencoded, format="JPEG", quality=70)  # the same picture, different bytes
    train.append(example(reencoded.getvalue(), 0))
    corrupt_record = len(train)
    train.append(example(jpeg(rng), 1))  # its bytes get damaged on disk below
    train.append(example(jpeg(rng), 2))

    val = [example(jpeg(rng), label) for label in range(4) for _ in range(5)]
    leaked = []
    for source in (1, per_class + 3):  # train images also put into val
        leaked.append(("val", len(val)))
        val.append(train[source])

    directory.mkdir(parents=True, exist_ok=True)
    train_path, val_path = directory / "train.tfrecord", directory / "val.tfrecord"
    write_records(train_path, train)
    write_records(val_path, val)
    # Flip one byte in the payload of corrupt_record: its data CRC fails, the rest is intact.
    offset = sum(len(r) + FRAME_BYTES for r in train[:corrupt_record]) + 12 + 20
    raw = bytearray(train_path.read_bytes())
    raw[offset] ^= 0xFF
    train_path.write_bytes(bytes(raw))
    return Planted(train_path, val_path, train, val, bad, corrupt_record, huge, duplicate, near, leaked,
                   len(CLASSES) - 1, per_class)
