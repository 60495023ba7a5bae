"""`appliance data ...`: thin handlers for the verb group for TFRecord data (index, cat, convert, and others' sub-verbs).

Another module adds a sub-verb by exposing `register_data_verb(subparsers)` and being listed in
DATA_VERB_MODULES. The handlers are in data_tools/commands.py, named by string and imported when their
verb runs, so `appliance --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib

from appliance.core import values

# Modules contributing `appliance data VERB` sub-verbs via register_data_verb(subparsers).
DATA_VERB_MODULES: list[str] = [
    "data_tools.check.cli",
    "data_tools.preview",
]


def shard_prefix(text: str) -> str:
    """--prefix: the start of a file name in --out. '../../x' wrote shards outside --out, 'a/b' was an
    internal error, '' made files named '-00000-of-00001.tfrecord'."""
    problem = values.path_problem(text)
    if problem or not text or "/" in text or text.startswith(".") or len(text) > 200:
        raise argparse.ArgumentTypeError(f"must be the start of a file name (no '/', not empty, not starting with "
                                         f"'.', at most 200 characters), got {values.shown(text)}")
    return text


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="index, inspect and convert TFRecord data",
                                   description="Work with TFRecord files (plain, GZIP, ZLIB).")
    sub = parser.add_subparsers(dest="data_verb", metavar="DATA_VERB")
    parser.set_defaults(func=lambda args: parser.print_help() or 2)

    p = sub.add_parser("index", help="write FILE.index (offset size per record, DALI format) for each file")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--cache-dir", help="where indexes go when a data directory is read-only")
    p.add_argument("--force", action="store_true", help="rebuild even when a current index exists")
    p.set_defaults(func="data_tools.commands:index_files")

    p = sub.add_parser("cat", help="print records as JSON lines, for people inspecting data")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--limit", type=values.int_in(values.Range(ge=0, le=10**12), "an integer"), default=None, metavar="N", help="stop after N records")
    p.add_argument("--strict", action="store_true", help="stop with an error at the first damaged byte")
    p.set_defaults(func="data_tools.commands:cat_file")

    p = sub.add_parser("convert", help="image folder -> sharded TFRecords, or GZIP/ZLIB -> plain",
                       description="IMAGE_DIR holds class_name/*.jpg|png; each class folder is one label "
                       "(sorted names -> 0, 1, ...). With --decompress, SOURCE is one or more GZIP/ZLIB "
                       "TFRecord files to rewrite as plain, indexed files.")
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="IMAGE_DIR, or FILE... with --decompress")
    p.add_argument("--out", required=True, type=values.output_dir, help="output directory")
    p.add_argument("--shards", type=values.int_in(values.SMALL_COUNT_AT_LEAST_ONE, "an integer"), default=1, help="number of output files (default 1)")
    p.add_argument("--prefix", type=shard_prefix, default="data", help="shard file name prefix (default data)")
    p.add_argument("--seed", type=values.int_in(values.SEED, "an integer"), default=0, help="shuffle seed for dealing images to shards")
    p.add_argument("--val-fraction", type=values.float_in(values.Range(ge=0, lt=1)), default=0.0, metavar="F",
                   help="split IMAGE_DIR into train-* and val-* shards: F of each class to validation, "
                   "seeded by --seed, near-duplicate images kept on one side (default 0: no split)")
    p.add_argument("--decompress", action="store_true", help="SOURCE files are GZIP/ZLIB TFRecords")
    p.add_argument("--masks", metavar="MASK_DIR", default=None,
                   help="segmentation: IMAGE_DIR holds the images, MASK_DIR a class-id PNG per image (same stem); "
                   "written in TensorFlow DeepLab's record convention. A SOURCE holding just images/ and masks/ "
                   "is taken as such a pair")
    p.add_argument("--coco", metavar="JSON", default=None,
                   help="detection: IMAGE_DIR holds the images a COCO instances JSON names; written in the "
                   "TensorFlow Object Detection API's record convention (categories -> labels 1..K)")
    p.add_argument("--voc", action="store_true",
                   help="detection: SOURCE is a Pascal VOC folder (Annotations/*.xml + JPEGImages/); a SOURCE "
                   "holding both is taken as one without the flag")
    p.set_defaults(func="data_tools.commands:convert")

    for name in DATA_VERB_MODULES:
        importlib.import_module(name).register_data_verb(sub)
