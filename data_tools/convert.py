"""Make TFRecord files: an image folder (`class_name/*.jpg|png`) into sharded, indexed shards,
and GZIP/ZLIB files into plain ones (which random access and DALI need).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from appliance.core.errors import DataError
from appliance.core.inputs import require_file
from appliance.core.manifest import atomic_write_text, write_manifest
from data_tools.example import encode_example
from data_tools.index import build_index, find_index, read_index_file
from data_tools.tfrecord import DamagedRange, TFRecordWriter, detect_compression, read_records
from data_tools.check.duplicates import exact_groups, near_groups
from data_tools.check.image_probe import ImageProblem, content_hash, probe_image

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
COMPRESSED_SUFFIXES = (".gz", ".gzip", ".zlib", ".zz")


def image_format(head: bytes) -> str | None:
    """"jpeg" or "png" from the first bytes of a file (the extension can lie)."""
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    return None


def find_images(image_dir: str | os.PathLike) -> tuple[list[str], list[tuple[Path, int]]]:
    """(class names in label order, [(image path, label)]) of an image folder; sorted, so stable."""
    root = Path(image_dir)
    if not root.is_dir():
        raise DataError(f"{root}: not a directory (expected class_name/*.jpg|png folders)")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    images = [
        (path, label)
        for label, name in enumerate(classes)
        for path in sorted((root / name).iterdir())
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file()
    ]
    if not images:
        raise DataError(f"{root}: no class_name/*.jpg|jpeg|png images found")
    return classes, images


def shard_name(prefix: str, shard: int, shards: int) -> str:
    return f"{prefix}-{shard:05d}-of-{shards:05d}.tfrecord"


def convert_image_folder(
    image_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    shards: int = 1,
    prefix: str = "data",
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    val_fraction: float = 0.0,
    near_distance: int = 4,
) -> list[Path]:
    """Write shuffled, sharded TFRecords with image/encoded, image/format, image/class/label, image/class/text.

    Images are shuffled with `seed` and dealt round-robin, so every shard mixes every class.
    With val_fraction > 0 the images are first split (split_images: seeded, stratified, near
    duplicates on one side) into `train-*` shards (`shards` of them) and `val-*` shards
    (round(shards * val_fraction), at least one); prefix is then not used.
    Each shard gets its index; out_dir gets labels.txt and manifest.json. Returns the shard paths.
    """
    if shards < 1:
        raise DataError(f"--shards must be at least 1, not {shards}")
    check_val_fraction(val_fraction)
    classes, images = find_images(image_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = {"image_dir": str(image_dir), "shards": shards, "prefix": prefix, "seed": seed, "classes": classes,
              "made_by": "appliance data convert"}
    if val_fraction > 0:
        split = split_images(images, len(classes), val_fraction, seed, near_distance)
        params.pop("prefix")
        params["split"] = {"val_fraction": val_fraction, "near_distance": near_distance,
                           "groups_kept_together": split.groups_kept_together,
                           "counts": split_counts(split, classes)}
        paths = [*_write_shards(split.train, classes, out, "train", shards, seed, progress),
                 *_write_shards(split.val, classes, out, "val", max(1, round(shards * val_fraction)), seed, progress)]
    else:
        paths = _write_shards(images, classes, out, prefix, shards, seed, progress)
    atomic_write_text(out / "labels.txt", "".join(f"{name}\n" for name in classes))
    write_manifest(out, "convert", inputs=[p for p, _ in sorted(images)], params=params)
    return paths


def check_val_fraction(val_fraction: float) -> None:
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction must be in [0, 1), not {val_fraction}")


def read_image(path: Path) -> tuple[bytes, str]:
    """(the file's bytes, "jpeg" or "png" by its first bytes); anything else is one line naming it."""
    encoded = path.read_bytes()
    fmt = image_format(encoded[:8])
    if fmt is None:
        raise DataError(f"{path}: not a JPEG or PNG file (by its first bytes)")
    return encoded, fmt


def write_shards(items: list, out: Path, prefix: str, shards: int, seed: int,
                 progress: Callable[[int], None] | None, encode: Callable[[object], bytes]) -> list[Path]:
    """items shuffled by seed and dealt round-robin into `shards` TFRecord files (fewer for fewer
    items), each record encode(item); each file indexed. On any error every file is removed."""
    items = list(items)
    shards = max(1, min(shards, len(items)))
    random.Random(seed).shuffle(items)
    paths = [out / shard_name(prefix, s, shards) for s in range(shards)]
    writers = [TFRecordWriter(p) for p in paths]
    try:
        for i, item in enumerate(items):
            writers[i % shards].write(encode(item))
            if progress:
                progress(1)
    except BaseException:
        for w in writers:
            w.abort()
        raise
    for w in writers:
        w.close()
    for p in paths:
        build_index(p)
    return paths


def _write_shards(images: list[tuple[Path, int]], classes: list[str], out: Path, prefix: str, shards: int,
                  seed: int, progress: Callable[[int], None] | None) -> list[Path]:
    def encode(item: tuple[Path, int]) -> bytes:
        path, label = item
        encoded, fmt = read_image(path)
        return encode_example({"image/encoded": encoded, "image/format": fmt, "image/class/label": label,
                               "image/class/text": classes[label]})

    return write_shards(images, out, prefix, shards, seed, progress, encode)


@dataclass(frozen=True)
class Split:
    train: list[tuple[Path, int]]
    val: list[tuple[Path, int]]
    groups_kept_together: list[list[str]]  # near or exact duplicates (2+ images), each on one side


def split_images(images: list[tuple[Path, int]], num_classes: int, val_fraction: float, seed: int = 0,
                 near_distance: int = 4) -> Split:
    """A seeded, stratified train/val split that never puts two near duplicates on different sides.

    Near duplicates are found with the data check's own perceptual hash and distance
    (data_tools.check), so `appliance data check` finds no leakage between the two splits it
    makes. Each group of duplicates (usually one image) joins its class's validation side while
    it fits round(n_class * val_fraction), so each class is within one image of exact unless
    groups of duplicates are too large to fit.
    """
    images = sorted(images)
    hashes = []
    for i, (path, _) in enumerate(images):
        encoded = path.read_bytes()
        digest = content_hash(encoded)
        try:
            hashes.append((i, probe_image(encoded).phash, digest))
        except ImageProblem:
            hashes.append((i, None, digest))  # the data check will quarantine it; no near duplicate
    parent = list(range(len(images)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    near = near_groups([h for h in hashes if h[1] is not None], max_distance=near_distance)
    for group in [*near, *exact_groups((i, digest) for i, _, digest in hashes)]:
        for member in group[1:]:
            parent[find(member)] = find(group[0])
    groups: dict[int, list[int]] = {}
    for i in range(len(images)):
        groups.setdefault(find(i), []).append(i)
    # A group belongs to the class of its first image (a group spanning classes is mislabelled data).
    by_class: dict[int, list[list[int]]] = {c: [] for c in range(num_classes)}
    for members in groups.values():
        by_class[images[members[0]][1]].append(members)
    rng = random.Random(seed)
    train, val = [], []
    for label in range(num_classes):
        class_groups = sorted(by_class[label])
        rng.shuffle(class_groups)
        target = round(sum(len(g) for g in class_groups) * val_fraction)
        taken = 0
        for members in class_groups:
            side = train
            if taken + len(members) <= target:
                side, taken = val, taken + len(members)
            side.extend(images[i] for i in members)
    together = sorted(sorted(str(images[i][0]) for i in g) for g in groups.values() if len(g) > 1)
    return Split(train=sorted(train), val=sorted(val), groups_kept_together=together)


def split_counts(split: Split, classes: list[str]) -> dict[str, dict[str, int]]:
    """{"train": {class: images}, "val": {class: images}}."""
    return {side: {name: sum(1 for _, label in getattr(split, side) if label == c) for c, name in enumerate(classes)}
            for side in ("train", "val")}


def decompressed_name(path: Path) -> str:
    name = path.name
    for suffix in COMPRESSED_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def decompress(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    on_damage: Callable[[DamagedRange], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Copy every verified record of a GZIP/ZLIB TFRecord file into a plain, indexed one in out_dir."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    compression = detect_compression(path)
    if compression is None:
        raise DataError(f"{path}: not GZIP or ZLIB compressed; nothing to decompress")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / decompressed_name(path)
    if target.resolve() == path.resolve():
        raise DataError(f"{path}: --out would overwrite the input")
    with TFRecordWriter(target) as writer:
        for record in read_records(path, compression=compression, on_damage=on_damage):
            writer.write(record)
            if progress:
                progress(len(record))
    build_index(target)
    return target


def decompress_files(
    sources: list[str | os.PathLike],
    out_dir: str | os.PathLike,
    on_damage: Callable[[str, DamagedRange], None] | None = None,
    progress_for: Callable[[Path], Callable[[int], None]] | None = None,
) -> list[tuple[Path, Path, int]]:
    """Decompress every source into out_dir and write the directory's manifest; every source is
    checked before any is read. Returns (source, plain file, records) per source; a source with
    damage and no valid record is a DataError (it is not TFRecord data)."""
    for source in sources:
        require_file(source)
        if detect_compression(source) is None:
            raise DataError(f"{source}: not GZIP or ZLIB compressed; nothing to decompress")
    done = []
    for source in sources:
        damage: list[DamagedRange] = []

        def note(d, source=source, damage=damage):
            damage.append(d)
            if on_damage:
                on_damage(str(source), d)
        target = decompress(source, out_dir, on_damage=note, progress=progress_for(Path(source)) if progress_for else None)
        count = len(read_index_file(find_index(target)))
        require_records(source, count, damage)
        done.append((Path(source), target, count))
    write_manifest(out_dir, "convert", inputs=list(sources),
                   params={"decompress": True, "made_by": "appliance data convert --decompress"})
    return done


def require_records(path, records: int, damage: list) -> None:
    """A file with damage and no valid record at all is not TFRecord data: say so in one line."""
    if records == 0 and damage:
        raise DataError(f"{path}: not a TFRecord file (no valid record; {damage[0].reason} at byte 0)"
                        if damage[0].start == 0 else f"{path}: no valid record ({damage[0]})")
