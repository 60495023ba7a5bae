"""Thin handlers for the deploy verbs: `appliance export`, `quantize` (and, as their modules
move here, `compile`, `package`, `edge ...`). The work is in appliance.deploy.<stage>; a failed
gate raises GateFailed (exit status 3) after its report is written."""

from __future__ import annotations

import json
from pathlib import Path

from appliance import values
from appliance.deploy import quantize
from appliance.deploy.export import DEFAULT_MAX_REL_ERROR
from appliance.errors import GateFailed


def register(subparsers) -> None:
    register_export(subparsers)
    register_quantize(subparsers)


def register_export(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="export a trained model to ONNX with a PyTorch/onnxruntime parity check",
        description="Export RUN_DIR (holding model/) or a trained-model/checkpoint directory to "
        "DIR/model.onnx, with preprocessing and class names in its metadata, and check it "
        "against PyTorch on samples (parity.json).")
    p.add_argument("model", metavar="RUN_DIR|CHECKPOINT")
    p.add_argument("--out", required=True, metavar="DIR", type=values.output_dir)
    p.add_argument("--opset", type=values.positive_int, default=17)
    p.add_argument("--batch", default="dynamic", metavar="dynamic|N",
                   help="batch axis: dynamic (default) or a fixed size")
    p.add_argument("--samples", nargs="+", metavar="FILE",
                   help="validation TFRecord files (or a .npz of tensors) for the parity check; "
                   "default: 16 seeded random images")
    p.add_argument("--num-samples", type=values.positive_int, default=64)
    p.add_argument("--max-rel-error", type=values.non_negative_float, default=DEFAULT_MAX_REL_ERROR,
                   help="fail when max|torch-onnx| / max|torch| exceeds this (default 1e-5)")
    p.set_defaults(func=export_command)


def export_command(args) -> int:
    from appliance.deploy.export import export_model, parse_batch

    batch = parse_batch(args.batch)
    report = export_model(args.model, args.out, opset=args.opset, batch=batch, sample_files=args.samples,
                          num_samples=args.num_samples, max_rel_error=args.max_rel_error)
    parity = report["parity"]
    print(f"wrote {Path(args.out) / 'model.onnx'}: parity on {parity['samples']} {parity['source']} samples: "
          f"max abs {parity['max_abs_error']:.3g}, max rel {parity['max_rel_error']:.3g} "
          f"(limit {args.max_rel_error:g}), top-1 agreement {parity['top1_agreement']:.4f}")
    return 0


def register_quantize(subparsers) -> None:
    p = subparsers.add_parser(
        "quantize", help="INT8 (static QDQ) or FP16 quantization with an accuracy report and gate",
        description="Quantize MODEL.onnx with calibration data, evaluate FP32 vs quantized on the "
        "validation set (accuracy.json, accuracy.html) and exit 3 when top-1 drops more than --max-drop points.")
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument("--calib", required=True, nargs="+", metavar="DATA",
                   help="calibration TFRecord files (image/encoded, image/class/label) or a .npz of tensors")
    p.add_argument("--val", nargs="+", metavar="DATA", help="labelled validation data (default: --calib)")
    p.add_argument("--out", required=True, metavar="DIR", type=values.output_dir)
    p.add_argument("--mode", choices=["int8", "fp16"], default="int8")
    p.add_argument("--method", choices=quantize.METHODS, default="minmax", help="INT8 calibration method")
    p.add_argument("--per-channel", action="store_true", help="INT8: per-channel weight scales")
    p.add_argument("--scheme", choices=quantize.SCHEMES, default="s8s8",
                   help="INT8 types: s8s8 (default, accurate on any CPU) or u8s8 with 7-bit weights "
                   "(reduce_range: onnxruntime's faster x86 kernels without their AVX2 saturation)")
    p.add_argument("--calib-samples", type=values.positive_int, default=128)
    p.add_argument("--val-samples", type=values.positive_int, default=1000)
    p.add_argument("--max-drop", type=values.non_negative_float, default=1.0, help="allowed top-1 drop in points (default 1.0)")
    p.add_argument("--json", action="store_true", help="print the accuracy report as one JSON object on stdout")
    p.set_defaults(func=quantize_command)


def quantize_command(args) -> int:
    from appliance.deploy.quantize import quantize_model

    report = quantize_model(args.model, args.calib, args.out, val_files=args.val, mode=args.mode,
                            method=args.method, per_channel=args.per_channel, scheme=args.scheme,
                            calib_samples=args.calib_samples, val_samples=args.val_samples, max_drop=args.max_drop)
    q, f = report["quantized"], report["fp32"]
    line = (f"wrote {q['model']}: top-1 {f['top1'] * 100:.2f}% -> {q['top1'] * 100:.2f}% "
            f"(drop {report['top1_drop_points']:.2f} points, allowed {args.max_drop:g}), agreement "
            f"{report['prediction_agreement'] * 100:.2f}%, size x{report['size_ratio']:.2f}, latency "
            f"x{report['latency_ratio']:.2f}; report {Path(args.out) / 'accuracy.html'}")
    print(json.dumps(report) if args.json else line)
    if not report["gate_passed"]:
        raise GateFailed(f"{q['model']}: top-1 dropped {report['top1_drop_points']:.2f} points, more than "
                         f"--max-drop {args.max_drop:g} (see {Path(args.out) / 'accuracy.html'})")
    return 0
