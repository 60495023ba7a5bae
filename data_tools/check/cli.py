"""`appliance data check`: argument parsing only; the work is in data_tools.check.run."""

from __future__ import annotations

import json
import sys

from appliance.core import values
from appliance.core.errors import ConfigError, DataError, GateFailed
from data_tools.image_decode import MAX_PIXELS_LIMIT
from data_tools.labels import MAX_CLASSES

MAX_JOBS = 256  # worker processes; --jobs 100000 forked until the box gave out (each is a whole Python)


def register_data_verb(data_subparsers) -> None:
    p = data_subparsers.add_parser(
        "check", help="check TFRecord files: report, quarantine, clean shards, gate",
        description="Check TFRecord files in one streaming pass: framing/CRC, parse, schema, images, "
                    "statistics (3-sigma and median/MAD), duplicates, label balance, train/val leakage. "
                    "Writes report.json, report.html, schema.json, quarantine/ and clean/ into --out. "
                    "Exit status: 0 passed, 2 an input file could not be read, 3 the --fail-on gate failed.")
    p.add_argument("files", nargs="*", metavar="FILE", help="TFRecord files (plain, GZIP or ZLIB)")
    p.add_argument("--out", required=True, type=values.output_dir, help="output directory")
    p.add_argument("--train", nargs="+", default=[], metavar="FILE", help="files of the training split")
    p.add_argument("--val", nargs="+", default=[], metavar="FILE",
                   help="files of the validation split (checked for leakage against --train)")
    p.add_argument("--schema", help="schema JSON (default: inferred from the first records, written to OUT/schema.json)")
    p.add_argument("--fail-on", default=None,
                   help="gate thresholds, e.g. 'corrupt>0,quarantined_fraction>0.05,imbalance>10'; metrics: "
                        "corrupt, quarantined, quarantined_fraction, imbalance, duplicates, near_duplicates, "
                        "leakage, outliers, unreadable_files")
    p.add_argument("--image-key", default="image/encoded", help="feature holding the encoded image (default image/encoded)")
    p.add_argument("--label-key", default="image/class/label", help="feature holding the class (default image/class/label)")
    p.add_argument("--max-pixels", type=values.int_in(values.Range(ge=1, le=MAX_PIXELS_LIMIT), "an integer"), default=None,
                   help="larger images and masks are quarantined before they are decoded (default 64M, at most 1G; "
                        "training's [data] max_pixels)")
    p.add_argument("--near-distance", type=values.int_in(values.Range(ge=0, le=7), "an integer"), default=4, help="perceptual-hash bits (0..7) that may differ in a near duplicate (default 4)")
    p.add_argument("--num-classes", type=values.int_in(values.Range(ge=1, le=MAX_CLASSES), "an integer"), default=None,
                   help="class labels (or masks' class ids) are 0..N-1, as the training config's classes; others are "
                        f"quarantined (default: inferred from all records, and said so; at most {MAX_CLASSES})")
    p.add_argument("--ignore-label", type=values.int_in(values.Range(ge=0, le=255), "an integer"), default=255,
                   help="segmentation masks: the class id of pixels that count for nothing (default 255)")
    p.add_argument("--jobs", type=values.int_in(values.Range(ge=1, le=MAX_JOBS), "an integer"), default=None, help="worker processes (default: one per file, up to the cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress output")
    p.add_argument("--quiet", action="store_true", help="no progress output (results and errors still print)")
    p.add_argument("--json", action="store_true",
                   help="print report.json as one JSON object on stdout (the summary line goes to stderr)")
    p.set_defaults(func=check_command)


def check_command(args) -> int:
    from data_tools.check.stage import check_stage  # late: PIL and numpy, at the CLI boundary

    inputs = [(f, None) for f in args.files] + [(f, "train") for f in args.train] + [(f, "val") for f in args.val]
    if not inputs:
        raise ConfigError("data check: give TFRecord files, or --train and --val files")
    for flag, key in (("--image-key", args.image_key), ("--label-key", args.label_key)):
        if not key or "\0" in key:
            raise ConfigError(f"data check: {flag} must name a feature, got {key!r}")
    if args.val and not args.train:
        raise ConfigError("data check: --val needs --train (leakage is checked between the two)")
    sizes = {"max_pixels": args.max_pixels} if args.max_pixels else {}  # else run_check's default
    try:
        check_stage(inputs, args.out, fail_on=args.fail_on, on_result=(lambda r: print(json.dumps(r.report))) if args.json
                    else None, schema_path=args.schema, image_key=args.image_key, label_key=args.label_key,
                    near_distance=args.near_distance, jobs=args.jobs, progress=not (args.no_progress or args.quiet),
                    command=["appliance", *sys.argv[1:]], summary_stream=sys.stderr if args.json else None,
                    num_classes=args.num_classes, ignore_label=args.ignore_label, **sizes)
    except (GateFailed, DataError) as failed:  # its lines (each unreadable file, each failed rule) are printed already
        return failed.exit_code
    return 0
