"""The handlers of `appliance data index`, `cat` and `convert` (argument parsing: data_tools/cli.py).

Imported only when one of these verbs runs (data_tools.cli names them by string), so this module
imports what it uses at its top, PIL and numpy included.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

from appliance.core.errors import DataError
from appliance.core.inputs import require_file
from appliance.core.manifest import read_manifest
from appliance.core.progress import Progress
from data_tools import convert as conversion, example, index, tfrecord
from data_tools.convert_boxes import convert_boxes, is_voc_folder, read_coco, read_voc
from data_tools.convert_masks import convert_mask_folders, find_pairs, is_mask_folder_pair


def _warn(damage) -> None:
    print(f"warning: {damage}", file=sys.stderr)


def index_files(args) -> int:
    for path in args.files:
        require_file(path)
        damage = []
        index_path = index.build_index(path, args.cache_dir, force=args.force, on_damage=damage.append)
        count = len(index.read_index_file(index_path))
        conversion.require_records(path, count, damage)
        for d in damage:
            _warn(d)
        print(f"{path}: {count} records -> {index_path}")
    return 0


def _jsonable(value):
    """Feature values as JSON a person can read: text as text, other bytes as size + hex preview."""
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        try:
            text = value.decode()
            if len(text) <= 256 and text.isprintable():
                return text
        except UnicodeDecodeError:
            pass
        return {"bytes": len(value), "head": value[:16].hex()}
    if value.dtype.kind == "f":
        return [float(str(v)) for v in value]  # float32's shortest form, not float64 noise
    return value.tolist()


def cat_file(args) -> int:
    require_file(args.file)
    damage = []
    shown = 0

    def note(d):
        # Warnings wait for the first good record: a file with none gets only the one-line error.
        damage.append(d)
        if shown:
            _warn(d)

    if args.limit is not None and args.limit <= 0:
        return 0
    out = sys.stdout
    for number, offset, data in tfrecord.iter_records_with_offsets(args.file, strict=args.strict, on_damage=note):
        if not shown:
            for d in damage:
                _warn(d)
        line = {"record": number, "offset": offset, "bytes": len(data)}
        try:
            line["features"] = {k: _jsonable(v) for k, v in example.decode_example(data).items()}
        except DataError:
            line["not_an_example"] = base64.b64encode(data[:48]).decode()
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
        shown += 1
        if args.limit is not None and shown >= args.limit:
            break
    conversion.require_records(args.file, shown, damage)
    return 0


def convert(args) -> int:
    if args.decompress:
        bars = []

        def progress_for(source: Path):
            bars.append(Progress(desc=source.name, unit="B", unit_scale=True))
            return bars[-1].update
        try:
            done = conversion.decompress_files(args.sources, args.out, on_damage=lambda _, d: _warn(d), progress_for=progress_for)
        finally:
            for bar in bars:
                bar.close()
        for source, target, count in done:
            print(f"{source} ({source.stat().st_size} bytes compressed): {count} records -> {target}")
        return 0
    if len(args.sources) != 1:
        raise DataError("convert takes one IMAGE_DIR (or several files with --decompress)")
    conversion.check_val_fraction(args.val_fraction)
    if args.coco or args.voc or is_voc_folder(args.sources[0]):
        return convert_detection(args)
    if args.masks or is_mask_folder_pair(args.sources[0]):
        return convert_masks(args)
    _, images = conversion.find_images(args.sources[0])
    with Progress(total=len(images), desc="convert", unit="img") as bar:
        paths = conversion.convert_image_folder(args.sources[0], args.out, shards=args.shards, prefix=args.prefix,
                                     seed=args.seed, progress=bar.update, val_fraction=args.val_fraction)
    print(f"{len(images)} images -> {len(paths)} shards in {args.out}")
    if args.val_fraction:
        split = read_manifest(args.out)["params"]["split"]
        counts = split["counts"]
        width = max(len(name) for name in counts["train"])
        print(f"  {'class':{width}s}  train    val")
        for name in counts["train"]:
            print(f"  {name:{width}s}  {counts['train'][name]:5d}  {counts['val'][name]:5d}")
        print(f"  {'total':{width}s}  {sum(counts['train'].values()):5d}  {sum(counts['val'].values()):5d}"
              f"  ({len(split['groups_kept_together'])} groups of near-duplicate images kept on one side)")
    return 0


def convert_masks(args) -> int:
    """`data convert IMAGES --masks MASKS` (or a folder of images/ + masks/): DeepLab-convention records."""
    images_dir = Path(args.sources[0])
    masks_dir = Path(args.masks) if args.masks else images_dir / "masks"
    if not args.masks:
        images_dir = images_dir / "images"
    pairs = find_pairs(images_dir, masks_dir)
    with Progress(total=len(pairs), desc="convert", unit="img") as bar:
        paths = convert_mask_folders(images_dir, masks_dir, args.out, shards=args.shards, prefix=args.prefix,
                                     seed=args.seed, progress=bar.update, val_fraction=args.val_fraction)
    print(f"{len(pairs)} image/mask pairs -> {len(paths)} shards in {args.out} (DeepLab segmentation records)")
    if args.val_fraction:
        split = read_manifest(args.out)["params"]["split"]
        print(f"  train {split['counts']['train']}, val {split['counts']['val']} "
              f"({len(split['groups_kept_together'])} groups of near-duplicate images kept on one side)")
    return 0


def convert_detection(args) -> int:
    """`data convert IMAGES --coco JSON` or `data convert VOC_FOLDER [--voc]`: Object Detection API records."""
    source = Path(args.sources[0])
    if args.coco:
        classes, items = read_coco(args.coco, source)
        described = {"coco": str(args.coco), "images_dir": str(source)}
    else:
        if not is_voc_folder(source):
            raise DataError(f"{source}: not a Pascal VOC folder (expected Annotations/ and JPEGImages/)")
        classes, items = read_voc(source)
        described = {"voc": str(source)}
    with Progress(total=len(items), desc="convert", unit="img") as bar:
        paths = convert_boxes(classes, items, args.out, described, shards=args.shards, prefix=args.prefix,
                              seed=args.seed, progress=bar.update, val_fraction=args.val_fraction)
    boxes = sum(len(item.labels) for item in items)
    print(f"{len(items)} images, {boxes} boxes of {len(classes)} classes -> {len(paths)} shards in {args.out} "
          "(Object Detection API records; label_map.pbtxt)")
    if args.val_fraction:
        split = read_manifest(args.out)["params"]["split"]
        print(f"  train {split['counts']['train']}, val {split['counts']['val']} "
              f"({len(split['groups_kept_together'])} groups of near-duplicate images kept on one side)")
    return 0
