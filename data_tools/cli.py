"""`appliance data ...`: thin handlers for the verb group for TFRecord data (index, cat, convert, and others' sub-verbs).

Another module adds a sub-verb by exposing `register_data_verb(subparsers)` and being listed in
DATA_VERB_MODULES; heavy imports stay inside the functions so `appliance --help` stays fast.
"""

from __future__ import annotations

import base64
import importlib
import json
import sys
from pathlib import Path

from appliance.core import values
from appliance.core.errors import DataError
from appliance.core.inputs import require_file
from appliance.core.progress import Progress
from appliance.core.manifest import read_manifest

# Modules contributing `appliance data VERB` sub-verbs via register_data_verb(subparsers).
DATA_VERB_MODULES: list[str] = [
    "data_tools.check.cli",
    "data_tools.preview",
]


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="index, inspect and convert TFRecord data",
                                   description="Work with TFRecord files (plain, GZIP, ZLIB).")
    sub = parser.add_subparsers(dest="data_verb", metavar="DATA_VERB")
    parser.set_defaults(func=lambda args: parser.print_help() or 2)

    p = sub.add_parser("index", help="write FILE.index (offset size per record, DALI format) for each file")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--cache-dir", help="where indexes go when a data directory is read-only")
    p.add_argument("--force", action="store_true", help="rebuild even when a current index exists")
    p.set_defaults(func=index_files)

    p = sub.add_parser("cat", help="print records as JSON lines, for people inspecting data")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--limit", type=values.non_negative_int, default=None, metavar="N", help="stop after N records")
    p.add_argument("--strict", action="store_true", help="stop with an error at the first damaged byte")
    p.set_defaults(func=cat_file)

    p = sub.add_parser("convert", help="image folder -> sharded TFRecords, or GZIP/ZLIB -> plain",
                       description="IMAGE_DIR holds class_name/*.jpg|png; each class folder is one label "
                       "(sorted names -> 0, 1, ...). With --decompress, SOURCE is one or more GZIP/ZLIB "
                       "TFRecord files to rewrite as plain, indexed files.")
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="IMAGE_DIR, or FILE... with --decompress")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--shards", type=values.positive_int, default=1, help="number of output files (default 1)")
    p.add_argument("--prefix", default="data", help="shard file name prefix (default data)")
    p.add_argument("--seed", type=values.non_negative_int, default=0, help="shuffle seed for dealing images to shards")
    p.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                   help="split IMAGE_DIR into train-* and val-* shards: F of each class to validation, "
                   "seeded by --seed, near-duplicate images kept on one side (default 0: no split)")
    p.add_argument("--decompress", action="store_true", help="SOURCE files are GZIP/ZLIB TFRecords")
    p.add_argument("--masks", metavar="MASK_DIR", default=None,
                   help="segmentation: IMAGE_DIR holds the images, MASK_DIR a class-id PNG per image (same stem); "
                   "written in TensorFlow DeepLab's record convention. A SOURCE holding just images/ and masks/ "
                   "is taken as such a pair")
    p.set_defaults(func=convert)

    for name in DATA_VERB_MODULES:
        importlib.import_module(name).register_data_verb(sub)


def _warn(damage) -> None:
    print(f"warning: {damage}", file=sys.stderr)


def index_files(args) -> int:
    from data_tools import convert as conversion, index  # lazy: PIL and numpy, at the CLI boundary

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
    from data_tools import convert as conversion, example, tfrecord  # lazy: PIL and numpy, at the CLI boundary

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
    from data_tools import convert as conversion  # lazy: PIL and numpy, at the CLI boundary
    from data_tools.convert_masks import is_mask_folder_pair  # lazy: PIL and numpy, at the CLI boundary

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
    from appliance.core.progress import Progress
    from data_tools.convert_masks import convert_mask_folders, find_pairs

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
        from appliance.core.manifest import read_manifest

        split = read_manifest(args.out)["params"]["split"]
        print(f"  train {split['counts']['train']}, val {split['counts']['val']} "
              f"({len(split['groups_kept_together'])} groups of near-duplicate images kept on one side)")
    return 0
