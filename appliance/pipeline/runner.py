"""`appliance pipeline PIPELINE.toml`: check -> train -> export -> quantize -> compile -> package -> verify.

Each stage writes OUT/<stage>/ with its manifest.json; OUT/.pipeline/<stage>.json holds the
stage's fingerprint: the sha256 of its parameters and of its input files' hashes (taken from
the upstream stages' manifests). A rerun skips a stage whose fingerprint is unchanged and
whose outputs still match their manifest, so changing one training parameter redoes train and
what follows, and nothing before it. A training stage that was interrupted (same fingerprint,
not completed) resumes from its newest good checkpoint.
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

from appliance.errors import ApplianceError, ConfigError, DataError
from appliance.manifest import atomic_write_text, read_manifest, sha256_file, verify_outputs
from appliance.pipeline.config import PipelineConfig, load_pipeline_config

RECORDS_DIR = ".pipeline"  # OUT/.pipeline/<stage>.json, outside the stage directories and their manifests
STAGES = ("check", "train", "export", "quantize", "compile", "package", "verify")


class GateFailed(ApplianceError):
    """A stage's quality gate failed; the pipeline stops there."""

    exit_code = 3


def say(message: str) -> None:
    print(f"[pipeline] {message}", file=sys.stderr, flush=True)


def fingerprint(params: dict, input_hashes: list[str]) -> str:
    """sha256 over the parameters and the inputs' content hashes (not their times or paths)."""
    digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
    for h in input_hashes:
        digest.update(h.encode())
    return digest.hexdigest()


@dataclass
class StageRun:
    name: str
    out_dir: Path
    params: dict
    inputs: list[Path]
    action: Callable[[Path], dict]  # does the work into out_dir; returns a summary for the report
    resumable: bool = False


def _record_path(out_dir: Path) -> Path:
    return out_dir.parent / RECORDS_DIR / f"{out_dir.name}.json"


def _record(out_dir: Path) -> dict:
    try:
        return json.loads(_record_path(out_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def run_stage(stage: StageRun, input_hashes: list[str], force: bool) -> dict:
    fp = fingerprint(stage.params, input_hashes)
    record = _record(stage.out_dir)
    if not force and record.get("fingerprint") == fp and record.get("completed"):
        problems = verify_outputs(stage.out_dir) if (stage.out_dir / "manifest.json").exists() else ["no manifest"]
        if not problems:
            say(f"{stage.name}: unchanged, skipped ({stage.out_dir})")
            return record["summary"]
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
    summary = stage.action(stage.out_dir)
    summary["seconds"] = round(time.monotonic() - start, 1)
    atomic_write_text(_record_path(stage.out_dir), json.dumps(
        {"stage": stage.name, "fingerprint": fp, "completed": True, "summary": summary}, indent=2) + "\n")
    shutil.rmtree(stage.out_dir.with_name(stage.out_dir.name + ".previous"), ignore_errors=True)
    say(f"{stage.name}: done in {summary['seconds']} s")
    return summary


def _resolve_files(cfg: PipelineConfig, key: str) -> list[Path]:
    import glob

    base = cfg.source.parent
    files = []
    for pattern in cfg.training["data"].get(key, []):
        matches = sorted(glob.glob(str(base / pattern)))
        if not matches:
            raise ConfigError(f"{cfg.source}: [data] {key}: {pattern!r} matches no file")
        files.extend(Path(m).resolve() for m in matches)
    return files


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} into the training config")


def write_train_config(path: Path, sections: dict) -> None:
    lines = [f"# Written by `appliance pipeline` from {sections.get('_source', 'the pipeline config')}; "
             "remade on every run."]
    for name, table in sections.items():
        if name.startswith("_"):
            continue
        lines.append(f"\n[{name}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in table.items())
    atomic_write_text(path, "\n".join(lines) + "\n")


def plan(cfg: PipelineConfig) -> list[StageRun]:
    """The stages in order, each with its parameters, inputs and action."""
    out = cfg.out_dir
    train_files, val_files = _resolve_files(cfg, "train"), _resolve_files(cfg, "val")
    if not val_files:
        raise ConfigError(f"{cfg.source}: [data] val = [...] is required: every later stage is measured on it")
    stages: list[StageRun] = []

    def clean(split: str) -> list[Path]:
        """The check stage's clean shards for a split (the raw files when the check is off)."""
        if not cfg.check.enabled:
            return train_files if split == "train" else val_files
        report = json.loads((out / "check" / "report.json").read_text())
        return [out / "check" / f["clean_shard"] for f in report["files"]
                if f["split"] == split and f["clean_shard"]]

    if cfg.check.enabled:
        def check(d: Path) -> dict:
            from data_tools.check.run import run_check

            report, status = run_check([(str(p), "train") for p in train_files] + [(str(p), "val") for p in val_files],
                                       d, fail_on=cfg.check.fail_on)
            if status != 0:
                failed = "; ".join(report.get("gate", {}).get("failed", [])) or f"exit status {status}"
                raise GateFailed(f"{d / 'report.json'}: data check gate failed: {failed}")
            return {"records_total": report["records_total"], "records_valid": report["records_valid"],
                    "records_quarantined": report["records_quarantined"], "report": str(d / "report.html")}
        stages.append(StageRun("check", out / "check", asdict(cfg.check), train_files + val_files, check))

    def train(d: Path) -> dict:
        from appliance.cli import main as cli_main

        sections = json.loads(json.dumps(cfg.training))  # a deep copy
        sections["_source"] = str(cfg.source)
        sections["data"]["train"] = [str(p) for p in clean("train")]
        sections["data"]["val"] = [str(p) for p in clean("val")]
        if cfg.check.enabled:
            sections["data"]["check_report"] = str(out / "check" / "report.json")
        sections.setdefault("run", {})
        sections["run"]["out_dir"], sections["run"]["name"] = str(d.parent), d.name
        write_train_config(d / "config.toml", sections)
        status = cli_main(["train", str(d / "config.toml"), "--nproc-per-node", cfg.pipeline.nproc_per_node,
                           "--max-restarts", str(cfg.pipeline.max_restarts)])
        if status != 0:
            raise ApplianceError(f"{d}: training failed (exit status {status}); rerun the same command to resume")
        metrics = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
        evals = [m for m in metrics if "val_top1" in m]
        return {"run_dir": str(d), "model_dir": str(d / "model"), **({"val_top1": evals[-1]["val_top1"]} if evals else {})}

    train_params = {k: v for k, v in cfg.training.items()}
    train_params["pipeline"] = {"nproc_per_node": cfg.pipeline.nproc_per_node}
    stages.append(StageRun("train", out / "train", train_params, [], train, resumable=True))

    def export(d: Path) -> dict:
        from appliance.deploy.export import export_model

        report = export_model(out / "train", d, opset=cfg.export.opset, sample_files=clean("val"),
                              max_rel_error=cfg.export.max_rel_error)
        return {"model": str(d / "model.onnx"), "bytes": (d / "model.onnx").stat().st_size, "parity": report}
    stages.append(StageRun("export", out / "export", asdict(cfg.export), [], export))

    def quantize(d: Path) -> dict:
        from appliance.deploy.quantize import quantize_model

        q = cfg.quantize
        report = quantize_model(out / "export" / "model.onnx", clean("train"), d, val_files=clean("val"),
                                mode=q.mode, method=q.method, per_channel=q.per_channel,
                                calib_samples=q.calib_samples, val_samples=1_000_000, max_drop=q.max_drop)
        if not report["gate_passed"]:
            raise GateFailed(f"{d / 'accuracy.json'}: {q.mode} top-1 dropped more than {q.max_drop} points")
        return {"model": str(d / f"model.{q.mode}.onnx"), "report": report}
    if cfg.quantize.mode != "none":
        stages.append(StageRun("quantize", out / "quantize", asdict(cfg.quantize), [], quantize))
    deployed = (lambda: out / "quantize" / f"model.{cfg.quantize.mode}.onnx") if cfg.quantize.mode != "none" \
        else (lambda: out / "export" / "model.onnx")

    for target in cfg.compile.targets:
        def compile_target(d: Path, target=target) -> dict:
            from appliance.deploy.compile import compile_model

            return {"target": target, "report": compile_model(deployed(), target, d, sample_files=clean("val"))}
        stages.append(StageRun(f"compile-{target}", out / f"compile-{target}", {"target": target}, [], compile_target))

    def package(d: Path) -> dict:
        from appliance.deploy.package import build_package

        from appliance.deploy.lineage import lineage_from
        from appliance.manifest import write_manifest

        compiled = out / f"compile-{cfg.package.target}"
        tar = d / f"edge-package-{cfg.package.target}.tar"
        info = build_package(compiled, tar)
        # The package carries its own manifest inside; this one describes the stage directory.
        write_manifest(d, "package", [compiled / "model.so", compiled / "compile.json"],
                       {"target": cfg.package.target, "lineage": lineage_from(compiled)})
        return {"package": str(tar), "bytes": tar.stat().st_size, "info": info}
    stages.append(StageRun("package", out / "package", asdict(cfg.package), [], package))

    def verify(d: Path) -> dict:
        from appliance.deploy.edge_verify import verify_package

        tar = out / "package" / f"edge-package-{cfg.package.target}.tar"
        report = verify_package(tar, sample_files=clean("val"), num_samples=cfg.verify.samples or 1_000_000,
                                min_agreement=cfg.verify.min_agreement, out_dir=d)
        if not report["passed"]:
            raise GateFailed(f"{d / 'verify.json'}: the edge build disagrees with the host "
                             f"({report['routes'][0]['top1_agreement']:.4f} < {cfg.verify.min_agreement})")
        return {"report": report}
    stages.append(StageRun("verify", out / "verify", asdict(cfg.verify), [], verify))
    return stages


def upstream_hashes(stages: list[StageRun], index: int) -> list[str]:
    """The sha256 of every earlier stage's outputs, from their manifests: a change there is a change here."""
    hashes = []
    for earlier in stages[:index]:
        try:
            hashes.extend(o["sha256"] for o in read_manifest(earlier.out_dir)["outputs"])
        except DataError:
            raise DataError(f"{earlier.out_dir}: no manifest; run the pipeline from stage {earlier.name}") from None
    return hashes


def run_pipeline(config_path: str | Path, from_stage: str | None = None) -> dict:
    cfg = load_pipeline_config(config_path)
    stages = plan(cfg)
    names = [s.name for s in stages]
    if from_stage is not None:
        matching = [n for n in names if n == from_stage or n.startswith(from_stage + "-")]
        if not matching:
            raise ConfigError(f"--from {from_stage}: not a stage of this pipeline ({', '.join(names)})")
        first_forced = names.index(matching[0])
    else:
        first_forced = len(stages)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    say(f"{cfg.source.name}: {len(stages)} stages into {cfg.out_dir}: {' -> '.join(names)}")
    start = time.monotonic()
    summaries = {}
    for i, stage in enumerate(stages):
        say(f"stage {i + 1}/{len(stages)}: {stage.name}")
        hashes = [sha256_file(p) for p in stage.inputs] + upstream_hashes(stages, i)
        summaries[stage.name] = run_stage(stage, hashes, force=i >= first_forced)
    summary = build_summary(cfg, summaries, time.monotonic() - start)
    atomic_write_text(cfg.out_dir / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    print(format_summary(summary))
    return summary


def build_summary(cfg: PipelineConfig, stages: dict, seconds: float) -> dict:
    """Accuracy at each stage, sizes, latencies, where every artifact is, and the lineage."""
    out = cfg.out_dir
    summary = {"made_by": "appliance pipeline", "config": str(cfg.source), "out_dir": str(out),
               "seconds": round(seconds, 1), "stages": stages, "accuracy": {}, "sizes_bytes": {},
               "latency_ms": {}, "artifacts": {}}
    q = stages.get("quantize", {}).get("report")
    if q:
        summary["accuracy"]["fp32_top1"] = q["fp32"]["top1"]
        summary["accuracy"][f"{q['mode']}_top1"] = q["quantized"]["top1"]
        summary["accuracy"]["quantized_top1_drop_points"] = q["top1_drop_points"]
        summary["sizes_bytes"].update({"onnx_fp32": q["fp32"]["bytes"], f"onnx_{q['mode']}": q["quantized"]["bytes"]})
        summary["latency_ms"].update({"host_ort_fp32": q["fp32"]["latency_ms_median"],
                                      f"host_ort_{q['mode']}": q["quantized"]["latency_ms_median"]})
    elif "train" in stages and "val_top1" in stages["train"]:
        summary["accuracy"]["fp32_top1"] = stages["train"]["val_top1"]
    verify = stages.get("verify", {}).get("report")
    if verify:
        route = verify["routes"][0]
        summary["accuracy"]["edge_agreement_with_host"] = route["top1_agreement"]
        if "top1" in route:
            summary["accuracy"]["edge_top1"] = route["top1"]
        summary["accuracy"]["edge_max_logit_diff"] = route["max_logit_diff"]
        summary["latency_ms"]["edge_qemu_per_sample"] = round(1000 * route["seconds"] / max(1, verify["samples"]), 2)
        summary["verified_samples"] = verify["samples"]
    if "package" in stages:
        summary["sizes_bytes"]["edge_package"] = stages["package"]["bytes"]
        summary["lineage"] = lineage(out)
    for name in stages:
        summary["artifacts"][name] = str(out / name)
    return summary


def lineage(out: Path) -> list[dict]:
    """The edge package's lineage, from the raw data files the check stage read to the compiled model."""
    steps = read_manifest(out / "package")["params"].get("lineage", [])
    if (out / "check" / "manifest.json").is_file() and not any(s.get("stage") == "check" for s in steps):
        check = read_manifest(out / "check")
        steps = [{"stage": "check", "dir": str(out / "check"), "inputs": check["inputs"]}, *steps]
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
