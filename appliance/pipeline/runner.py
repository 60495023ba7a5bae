"""`appliance pipeline PIPELINE.toml`: check -> train -> gate -> export -> quantize -> compile -> package -> verify.

Each stage is a typed library function (data_tools.check.stage, appliance.train.stage,
appliance.deploy.stages) that writes OUT/<stage>/ with its manifest.json and returns a result
holding its output paths and figures; this module only composes them and names none of their
files. OUT/.pipeline/<stage>.json holds the stage's fingerprint: the sha256 of its parameters and
of the files it reads (the data files for check and train, whether or not the check ran; an
upstream result's outputs for the others). A rerun skips a stage whose fingerprint is unchanged
and whose outputs still match their manifest, so changing one training parameter redoes train
and what its new model changes, and nothing before it. A training stage that was interrupted
(same fingerprint, not completed) resumes from its newest good checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from appliance.core.errors import ConfigError, DataError
from appliance.core.manifest import atomic_write_text, read_manifest, sha256_file, verify_outputs
from appliance.pipeline.config import STAGES, PipelineConfig, load_pipeline_config
from appliance.deploy import stages as deploy
from appliance.train.launcher import TrainResult
from data_tools.check.stage import CheckResult, REPORT_JSON, result_of, check_stage
from appliance.train.quality import GATE_KEYS, GateResult, Thresholds, gate_stage
from appliance.train.stage import train_stage
from appliance.core.inputs import require_file

RECORDS_DIR = ".pipeline"  # OUT/.pipeline/<stage>.json, outside the stage directories and their manifests


def say(message: str) -> None:
    print(f"[pipeline] {message}", file=sys.stderr, flush=True)


def fingerprint(params: dict, input_hashes: list[str]) -> str:
    """sha256 over the parameters and the inputs' content hashes (not their times or paths)."""
    digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
    for h in input_hashes:
        digest.update(h.encode())
    return digest.hexdigest()


Results = dict  # stage name -> that stage's typed result (CheckResult, TrainResult, ExportResult, ...)


@dataclass
class Stage:
    """One step of the plan. inputs(results) lists the files it reads (hashed into its fingerprint);
    action(out_dir, results) runs it and returns its result; load(out_dir) rebuilds the result of
    a finished run that is skipped."""

    name: str
    out_dir: Path
    params: dict
    inputs: Callable[[Results], list[Path]]
    action: Callable[[Path, Results], object]
    load: Callable[[Path], object]
    resumable: bool = False


def _record_path(out_dir: Path) -> Path:
    return out_dir.parent / RECORDS_DIR / f"{out_dir.name}.json"


def _record(out_dir: Path) -> dict:
    try:
        record = json.loads(_record_path(out_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def _output_problems(out_dir: Path) -> list[str]:
    if not (out_dir / "manifest.json").exists():
        return ["no manifest"]
    try:
        return verify_outputs(out_dir)
    except DataError as err:
        return [str(err)]


def run_stage(stage: Stage, results: Results, force: bool) -> tuple[object, bool]:
    """Run stage, or skip it when its fingerprint is unchanged and its outputs are intact.
    Returns (its result, whether it ran)."""
    fp = fingerprint(stage.params, [sha256_file(p) for p in stage.inputs(results)])
    record = _record(stage.out_dir)
    if not force and record.get("fingerprint") == fp and record.get("completed"):
        problems = _output_problems(stage.out_dir)
        if not problems:
            say(f"{stage.name}: unchanged, skipped ({stage.out_dir})")
            return stage.load(stage.out_dir), False
        say(f"{stage.name}: outputs changed since it ran ({problems[0]}); running it again")
    resume = stage.resumable and not force and record.get("fingerprint") == fp and not record.get("completed")
    if stage.out_dir.exists() and not resume:
        # Keep the previous result beside the new one until the new one completes.
        previous = stage.out_dir.with_name(stage.out_dir.name + ".previous")
        shutil.rmtree(previous, ignore_errors=True)
        stage.out_dir.rename(previous)
    stage.out_dir.mkdir(parents=True, exist_ok=True)
    _record_path(stage.out_dir).parent.mkdir(exist_ok=True)
    atomic_write_text(_record_path(stage.out_dir), json.dumps({"stage": stage.name, "fingerprint": fp,
                                                                "completed": False}) + "\n")
    say(f"{stage.name}: {'resuming' if resume else 'running'} -> {stage.out_dir}")
    start = time.monotonic()
    result = stage.action(stage.out_dir, results)
    seconds = round(time.monotonic() - start, 1)
    atomic_write_text(_record_path(stage.out_dir), json.dumps(
        {"stage": stage.name, "fingerprint": fp, "completed": True, "seconds": seconds}, indent=2) + "\n")
    shutil.rmtree(stage.out_dir.with_name(stage.out_dir.name + ".previous"), ignore_errors=True)
    say(f"{stage.name}: done in {seconds} s")
    return result, True


def _files_in(directory: Path) -> list[Path]:
    return sorted(p for p in Path(directory).rglob("*") if p.is_file())


def plan(cfg: PipelineConfig) -> list[Stage]:
    """The stages in order, each with its parameters, inputs, action and result loader."""
    out = cfg.out_dir
    stages: list[Stage] = []

    def clean(results: Results, split: str) -> list[Path]:
        """The data a later stage reads: the check stage's clean shards, or the files as given."""
        check: CheckResult | None = results.get("check")
        if check is None:
            return list(cfg.train_files if split == "train" else cfg.val_files)
        return list(check.clean.get(split, ()))

    if cfg.check.enabled:
        def load_check(d: Path) -> CheckResult:
            return result_of(d, json.loads((d / REPORT_JSON).read_text()))

        def check(d: Path, results: Results) -> CheckResult:
            files = [(p, "train") for p in cfg.train_files] + [(p, "val") for p in cfg.val_files]
            return check_stage(files, d, fail_on=cfg.check.fail_on)
        stages.append(Stage("check", out / "check", asdict(cfg.check),
                            lambda r: [*cfg.train_files, *cfg.val_files], check, load_check))

    def train(d: Path, results: Results) -> TrainResult:
        check = results.get("check")
        return train_stage(cfg.training, cfg.source, d, train_files=clean(results, "train"),
                           val_files=clean(results, "val"), check_report=check.report_json if check else None,
                           nproc_per_node=cfg.pipeline.nproc_per_node, max_restarts=cfg.pipeline.max_restarts)

    # Training reads the data files; their content is in its fingerprint whether or not a check ran.
    # Neither where the processes talk ([distributed]) nor the gate's thresholds decide the weights:
    # changing a threshold reruns the gate only.

    weights_deciding = {**{k: v for k, v in cfg.training.items() if k != "distributed"},
                        "train": {k: v for k, v in cfg.training.get("train", {}).items() if k not in GATE_KEYS}}
    train_params = {"training": weights_deciding, "nproc_per_node": cfg.pipeline.nproc_per_node,
                    "checked": cfg.check.enabled}
    stages.append(Stage("train", out / "train", train_params,
                        lambda r: [*clean(r, "train"), *clean(r, "val")], train, TrainResult.from_run_dir,
                        resumable=True))

    thresholds = Thresholds.of(cfg.training.get("train", {}))
    stages.append(Stage("gate", out / "gate", asdict(thresholds),
                        lambda r: [r["train"].metrics_path, *_files_in(r["train"].model_dir)],
                        lambda d, r: gate_stage(r["train"], thresholds, d), GateResult.load))

    stages.append(Stage(
        "export", out / "export", asdict(cfg.export),
        lambda r: [*_files_in(r["train"].model_dir), *clean(r, "val")],
        lambda d, r: deploy.export_stage(r["train"].model_dir, d, opset=cfg.export.opset,
                                         sample_files=clean(r, "val"), max_rel_error=cfg.export.max_rel_error),
        deploy.ExportResult.load))

    q = cfg.quantize
    if q.mode != "none":
        stages.append(Stage(
            "quantize", out / "quantize", asdict(q),
            lambda r: [r["export"].model, *clean(r, "train"), *clean(r, "val")],
            lambda d, r: deploy.quantize_stage(r["export"].model, clean(r, "train"), clean(r, "val"), d,
                                               mode=q.mode, method=q.method, per_channel=q.per_channel,
                                               calib_samples=q.calib_samples, max_drop=q.max_drop),
            deploy.QuantizeResult.load))

    def deployed(results: Results) -> Path:
        return results["quantize"].model if "quantize" in results else results["export"].model

    for target in cfg.compile.targets:
        stages.append(Stage(
            f"compile-{target}", out / f"compile-{target}", {"target": target},
            lambda r: [deployed(r), *clean(r, "val")],
            lambda d, r, target=target: deploy.compile_stage(deployed(r), target, d, sample_files=clean(r, "val")),
            deploy.CompileResult.load))

    compiled = f"compile-{cfg.package.target}"
    stages.append(Stage(
        "package", out / "package", asdict(cfg.package),
        lambda r: [r[compiled].library, r[compiled].out_dir / deploy.COMPILE_JSON],
        lambda d, r: deploy.package_stage(r[compiled], d, sample_files=clean(r, "val")),
        deploy.PackageResult.load))

    stages.append(Stage(
        "verify", out / "verify", asdict(cfg.verify),
        lambda r: [r["package"].package, *clean(r, "val")],
        lambda d, r: deploy.verify_stage(r["package"], d, sample_files=clean(r, "val"),
                                         num_samples=cfg.verify.samples, min_agreement=cfg.verify.min_agreement),
        deploy.VerifyResult.load))
    return stages


def run_stages(stages: list[Stage], first_forced: int | None = None) -> tuple[Results, list[str]]:
    """Run or skip each stage in order; returns the results and the names of the stages that ran."""
    results: Results = {}
    ran = []
    for i, stage in enumerate(stages):
        say(f"stage {i + 1}/{len(stages)}: {stage.name}")
        results[stage.name], did_run = run_stage(stage, results, force=first_forced is not None and i >= first_forced)
        if did_run:
            ran.append(stage.name)
    return results, ran


def run_pipeline(config_path: str | Path, from_stage: str | None = None, *, quiet_summary: bool = False) -> dict:
    require_file(config_path, "pipeline config")
    cfg = load_pipeline_config(config_path)
    stages = plan(cfg)
    names = [s.name for s in stages]
    first_forced = None
    if from_stage is not None:
        matching = [n for n in names if n == from_stage or n.startswith(from_stage + "-")]
        if not matching:
            raise ConfigError(f"--from {from_stage}: not a stage of this pipeline ({', '.join(names)})")
        first_forced = names.index(matching[0])
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    say(f"{cfg.source.name}: {len(stages)} stages into {cfg.out_dir}: {' -> '.join(names)}")
    start = time.monotonic()
    results, ran = run_stages(stages, first_forced)
    summary = build_summary(cfg, results, ran, time.monotonic() - start)
    atomic_write_text(cfg.out_dir / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    if not quiet_summary:
        print(format_summary(summary))
    return summary


def build_summary(cfg: PipelineConfig, results: Results, ran: list[str], seconds: float) -> dict:
    """Accuracy at each stage, sizes, latencies, where every artifact is, and the lineage."""
    out = cfg.out_dir
    figures = {name: (r.figures() if hasattr(r, "figures") else {}) for name, r in results.items()}
    summary = {"made_by": "appliance pipeline", "config": str(cfg.source), "out_dir": str(out),
               "seconds": round(seconds, 1), "ran": ran, "stages": figures, "accuracy": {}, "sizes_bytes": {},
               "latency_ms": {}, "artifacts": {}}
    train = results.get("train")
    if train is not None:
        figures["train"] = {"run_dir": str(train.run_dir), "model_dir": str(train.model_dir), "steps": train.steps,
                            "val_acc": train.val_acc}
        if train.val_acc is not None:
            summary["accuracy"]["train_val_top1"] = train.val_acc
    gate = results.get("gate")
    if gate is not None and "val_acc" in gate.quality:
        summary["accuracy"]["val_majority_baseline_top1"] = gate.quality["majority_baseline"]
        summary["accuracy"]["quality_gate_required_top1"] = gate.quality["required_val_acc"]
        summary["quality_gate"] = {"passed": gate.quality["passed"], "line": gate.quality.get("line", "")}
    quantized = results.get("quantize")
    if quantized is not None:
        q = quantized.report
        summary["accuracy"]["fp32_top1"] = q["fp32"]["top1"]
        summary["accuracy"][f"{q['mode']}_top1"] = q["quantized"]["top1"]
        summary["accuracy"]["quantized_top1_drop_points"] = q["top1_drop_points"]
        summary["sizes_bytes"].update({"onnx_fp32": q["fp32"]["bytes"], f"onnx_{q['mode']}": q["quantized"]["bytes"]})
        summary["latency_ms"].update({"host_ort_fp32": q["fp32"]["latency_ms_median"],
                                      f"host_ort_{q['mode']}": q["quantized"]["latency_ms_median"]})
    elif train is not None and train.val_acc is not None:
        summary["accuracy"]["fp32_top1"] = train.val_acc
    verify = results.get("verify")
    if verify is not None:
        report = verify.report
        route = report["routes"][0]
        summary["accuracy"]["edge_agreement_with_host"] = route["top1_agreement"]
        if "top1" in route:
            summary["accuracy"]["edge_top1"] = route["top1"]
        summary["accuracy"]["edge_max_logit_diff"] = route["max_logit_diff"]
        summary["latency_ms"]["edge_qemu_per_sample"] = round(1000 * route["seconds"] / max(1, report["samples"]), 2)
        summary["verified_samples"] = report["samples"]
        selftest, bench = report.get("selftest"), report.get("bench")
        if selftest:
            summary["edge_selftest"] = {k: selftest.get(k) for k in ("passed", "samples", "top1_agreement",
                                                                      "max_abs_diff", "allowed_abs_diff")}
        if bench:  # measured under qemu: a figure of the emulator, not of the device; never gated
            summary["latency_ms"]["edge_bench_median_emulated"] = bench["median_ms"]
            summary["latency_ms"]["edge_bench_p99_emulated"] = bench["p99_ms"]
            summary["edge_bench_fluctuation_emulated"] = bench["fluctuation"]
    for name, result in results.items():
        if name.startswith("compile-"):  # what each build computes: int8 or simulated layers, size, host speed
            info = result.info
            summary.setdefault("builds", {})[result.target] = {
                k: info.get(k) for k in ("int8_compute", "layers", "int8_kernels", "fp32_kernels", "tuned_tasks",
                                         "library_bytes", "host_latency_ms")}
    package = results.get("package")
    if package is not None:
        summary["sizes_bytes"]["edge_package"] = package.bytes
        summary["lineage"] = lineage(package.out_dir, results.get("check"))
    for name, result in results.items():
        summary["artifacts"][name] = str(getattr(result, "out_dir", None) or getattr(result, "run_dir"))
    return summary


def lineage(package_dir: Path, check) -> list[dict]:
    """The edge package's lineage, from the raw data files the check stage read to the compiled model."""
    manifest = read_manifest(package_dir)
    steps = manifest.get("lineage") or manifest["params"].get("lineage", [])  # params: older manifests
    if check is not None and not any(s.get("stage") == "check" for s in steps):
        manifest = read_manifest(check.out_dir)
        steps = [{"stage": "check", "dir": str(check.out_dir), "inputs": manifest["inputs"]}, *steps]
    return steps


def format_summary(summary: dict) -> str:
    lines = [f"pipeline finished in {summary['seconds']} s; artifacts under {summary['out_dir']}"]
    for key, value in summary["accuracy"].items():
        shown = f"{100 * value:.2f} %" if ("top1" in key or "agreement" in key) and "drop" not in key else f"{value:.4g}"
        lines.append(f"  {key:32s} {shown}")
    for key, value in summary["sizes_bytes"].items():
        lines.append(f"  size {key:27s} {value / 1024:.1f} KiB")
    for key, value in summary["latency_ms"].items():
        lines.append(f"  latency {key:24s} {value:.3f} ms")
    for name, path in summary["artifacts"].items():
        lines.append(f"  {name:32s} {path}")
    lines.append(f"  summary                          {Path(summary['out_dir']) / 'summary.json'}")
    return "\n".join(lines)
