"""Quantization-aware fine-tuning after PTQ and fallback failed the gate: train -> export -> the quantize report.

It composes three stages, so it lives here and not in deploy (which may not import train):
1. a training config made from the trained run's own (its manifest's config): [model] init = that run,
   [qat] enabled, `epochs` epochs, lr times `lr_scale`, no warm-up, fp32; run by the same launcher
   (torchrun, checkpoints, exact resume: a rerun resumes its newest checkpoint);
2. `appliance export` of that run: a QDQ model whose scales came from training;
3. appliance.deploy.qat.add_qat: evaluated next to FP32 and PTQ in the quantize report, and shipped
   when it passes the gate.
`appliance quantize --qat RUN` and the pipeline's `[quantize] qat = true` both call `qat_after_gate`.
"""

from __future__ import annotations

import math
from pathlib import Path

from appliance.core.errors import ConfigError, GateFailed
from appliance.core.manifest import MANIFEST_NAME
from appliance.core.stage import read_result_json
from appliance.deploy import commands as deploy_commands
from appliance.deploy.export import export_stage
from appliance.deploy.qat import add_qat
from appliance.deploy.quantize import QuantizeResult
from appliance.train.stage import stage_config, train_stage

QAT_RUN, QAT_EXPORT = "qat-run", "qat-export"  # under the quantize stage's directory
QAT_EPOCHS, QAT_LR_SCALE = 2, 0.1
QAT_PARITY = 1e-2  # torch's and onnxruntime's int8 rounding may differ by one step at a tie


def qat_sections(run_dir: Path, *, epochs: int, lr_scale: float) -> dict:
    """The training sections of the QAT run of run_dir, from its manifest (data, run name and place are
    the caller's: appliance.train.stage.stage_config sets them)."""
    manifest = read_result_json(Path(run_dir) / MANIFEST_NAME)
    config = manifest.get("params", {}).get("config")
    if not isinstance(config, dict) or "run" not in config:
        raise ConfigError(f"{run_dir}/manifest.json: not a finished training run (no params.config)")
    sections = {k: v for k, v in config.items() if isinstance(v, dict)}
    sections["model"] = {**sections.get("model", {}), "init": str(Path(run_dir).resolve()), "reset": []}
    optimizer = sections.setdefault("optimizer", {})
    optimizer["lr"] = float(optimizer.get("lr", 1e-3)) * lr_scale
    sections["schedule"] = {**sections.get("schedule", {}), "warmup_steps": 0}
    sections["train"] = {**sections.get("train", {}), "epochs": epochs, "max_steps": 0, "precision": "fp32"}
    sections["qat"] = {"enabled": True}
    sections.pop("profile", None)
    return sections


def qat_after_gate(run_dir: Path, quantize_dir: Path, calib_files, val_files, *, epochs: int = QAT_EPOCHS,
                   lr_scale: float = QAT_LR_SCALE, nproc_per_node: str = "auto", opset: int = 17) -> QuantizeResult:
    """Fine-tune run_dir with fake quantization, export it, add it to quantize_dir's report; GateFailed
    when the QAT model misses the gate too."""
    if not (epochs >= 1 and math.isfinite(lr_scale) and lr_scale > 0):
        raise ConfigError(f"QAT needs epochs >= 1 and a positive lr scale (got {epochs}, {lr_scale})")
    quantize_dir = Path(quantize_dir)
    sections = qat_sections(run_dir, epochs=epochs, lr_scale=lr_scale)
    data = sections.get("data", {})
    config = stage_config(sections, Path(run_dir) / MANIFEST_NAME, (quantize_dir / QAT_RUN).resolve(),
                          train_files=data.get("train", ()), val_files=data.get("val", ()), check_report=None)
    trained = train_stage(config, nproc_per_node=nproc_per_node)
    exported = export_stage(trained.model_dir, quantize_dir / QAT_EXPORT, opset=opset,
                            sample_files=list(val_files or calib_files), max_rel_error=QAT_PARITY)
    add_qat(quantize_dir, exported.model, val_files, calib_files, run_dir=trained.run_dir)
    result = QuantizeResult.load(quantize_dir)
    if not result.gate_passed:
        qat, m = result.report["qat"], result.report.get("metric", "top1")
        label = result.report.get("metric_label", "top-1")
        raise GateFailed(f"{result.model}: int8 {label} dropped {result.report[f'{m}_drop_points']:.2f} points after "
                         f"PTQ and fallback, and {qat[f'{m}_drop_points']:.2f} after QAT, more than --max-drop "
                         f"{result.report['max_drop_points']:g} (see {result.html})")
    return result


def quantize_command(args) -> int:
    """`appliance quantize`: PTQ and fallback (appliance.deploy.commands); with --qat RUN, QAT when they fail."""
    if not args.qat or args.mode != "int8":
        return deploy_commands.quantize_command(args)
    try:
        return deploy_commands.quantize_command(args)
    except GateFailed as failed:
        print(f"{failed}; trying quantization-aware fine-tuning of {args.qat}", flush=True)
    result = qat_after_gate(Path(args.qat), Path(args.out), args.calib, args.val, epochs=args.qat_epochs,
                            lr_scale=args.qat_lr_scale)
    qat, m = result.report["qat"], result.report.get("metric", "top1")
    print(f"wrote {result.model}: QAT {result.report.get('metric_label', 'top-1')} {qat[m] * 100:.2f}% "
          f"(drop {qat[f'{m}_drop_points']:.2f} points); "
          f"INT8 made by: {result.report['produced_by']}; report {result.html}")
    return 0
