"""Verbs `appliance pipeline PIPELINE.toml` and `appliance demo`."""

from __future__ import annotations


from appliance.core import values
from appliance.pipeline.config import STAGES


def run_pipeline_command(args) -> int:
    import json

    from appliance.pipeline.runner import run_pipeline  # late: torch, at the CLI boundary

    summary = run_pipeline(args.config, from_stage=args.from_stage, quiet_summary=args.json)
    if args.json:
        print(json.dumps(summary, default=str))
    return 0


def run_demo_command(args) -> int:
    from appliance.pipeline.demo import run_demo  # late: torch, at the CLI boundary

    run_demo(args.out, epochs=args.epochs, task=args.task)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "pipeline", help="run every stage from one config: check, train, export, quantize, compile, package, verify",
        description="Run the stages in order, each into OUT/<stage>/ with a manifest.json. A rerun skips "
        "stages whose inputs and parameters are unchanged and resumes an interrupted training run.")
    p.add_argument("config", help="PIPELINE.toml (its keys: docs/pipeline.md)")
    p.add_argument("--from", dest="from_stage", metavar="STAGE", choices=STAGES,
                   help=f"rerun from this stage even if unchanged ({', '.join(STAGES)})")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress output (results and errors still print)")
    p.set_defaults(func=run_pipeline_command)

    d = subparsers.add_parser(
        "demo", help="the whole pipeline on data made offline (digits, or inspection images), ending on ARM under qemu",
        description="Build TFRecord shards from the handwritten digits that ship inside scikit-learn "
        "(no download), then run the pipeline on them: data check, small CNN training, ONNX export, "
        "INT8 quantization, TVM builds for x86_64 and aarch64, an edge package verified under qemu-aarch64. "
        "With --task segmentation: seeded industrial inspection images (scratches, spots, cracks) and a small U-Net, "
        "its mIoU at every stage. With --task detection: the same surfaces with boxed defects and a small anchor-free "
        "detector, COCO mAP.")
    d.add_argument("--out", type=values.output_dir, default="appliance-demo", help="output directory (default: %(default)s)")
    d.add_argument("--epochs", type=values.int_in(values.EPOCHS_AT_LEAST_ONE, "an integer"), metavar="N",
                   help="train for N epochs instead of the config's (12 for the digits, 10 for segmentation; a quicker run, "
                   "every stage still runs). "
                   "Applies when the demo writes its pipeline.toml, which then says N")
    d.add_argument("--task", choices=("classification", "segmentation", "detection"), default="classification",
                   help="classification: the digits (default); segmentation: seeded inspection images, mIoU; "
                   "detection: the same images with boxes, mAP")
    d.set_defaults(func=run_demo_command)
