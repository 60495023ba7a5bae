"""`appliance pipeline PIPELINE.toml`: check -> train -> gate -> export -> quantize -> compile -> package -> verify.

The stages, what each reads and which stage function runs it are in appliance.pipeline.plan; this
module runs or skips them in order and writes OUT/summary.json and OUT/index.html
(appliance.pipeline.summary). It names none of the stages' files. OUT/.pipeline/<stage>.json holds
the stage's fingerprint: the sha256 of its parameters and of the files it reads (the data files for
check and train, whether or not the check ran; an upstream result's outputs for the others). A rerun
skips a stage whose fingerprint is unchanged and whose outputs still match their manifest, so
changing one training parameter redoes train and what its new model changes, and nothing before it.
A training stage that was interrupted (same fingerprint, not completed) resumes from its newest good
checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

from appliance.core.errors import ConfigError, DataError
from appliance.core.inputs import require_file
from appliance.core.manifest import MANIFEST_NAME, atomic_write_text, sha256_file, verify_outputs
from appliance.core.stage import StageResult
from appliance.deploy.estimate import check_latency_budget, estimate_once
from appliance.pipeline.config import STAGES, load_pipeline_config, validate_training
from appliance.pipeline.plan import Results, Stage, plan
from appliance.pipeline.summary import INDEX_HTML, SUMMARY_JSON, build_summary, format_summary, index_html

__all__ = ["STAGES", "run_pipeline", "run_stages", "plan", "build_summary"]
RECORDS_DIR = ".pipeline"  # OUT/.pipeline/<stage>.json, outside the stage directories and their manifests


def say(message: str) -> None:
    print(f"[pipeline] {message}", file=sys.stderr, flush=True)


def fingerprint(params: dict, input_hashes: list[str]) -> str:
    """sha256 over the parameters and the inputs' content hashes (not their times or paths)."""
    digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
    for h in input_hashes:
        digest.update(h.encode())
    return digest.hexdigest()


def _record_path(out_dir: Path) -> Path:
    return out_dir.parent / RECORDS_DIR / f"{out_dir.name}.json"


def _record(out_dir: Path) -> dict:
    try:
        record = json.loads(_record_path(out_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def _output_problems(out_dir: Path) -> list[str]:
    if not (out_dir / MANIFEST_NAME).exists():
        return ["no manifest"]
    try:
        return verify_outputs(out_dir)
    except DataError as err:
        return [str(err)]


def run_stage(stage: Stage, results: Results, force: bool) -> tuple[StageResult, bool]:
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


def run_stages(cfg, stages: list[Stage], first_forced: int | None = None) -> tuple[Results, list[str]]:
    """Run or skip each stage in order; returns the results and the names of the stages that ran."""
    results = Results(cfg)
    ran = []
    for i, stage in enumerate(stages):
        say(f"stage {i + 1}/{len(stages)}: {stage.name}")
        result, did_run = run_stage(stage, results, force=first_forced is not None and i >= first_forced)
        stage.keep(results, result)
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
    if cfg.deploy.latency_budget_ms:
        meet_latency_budget(cfg)
    results, ran = run_stages(cfg, stages, first_forced)
    summary = build_summary(cfg, results, ran, time.monotonic() - start)
    atomic_write_text(cfg.out_dir / SUMMARY_JSON, json.dumps(summary, indent=2, default=str) + "\n")
    atomic_write_text(cfg.out_dir / INDEX_HTML, index_html(summary, results))
    if not quiet_summary:
        print(format_summary(summary))
    return summary


def meet_latency_budget(cfg) -> None:
    """Before any training: the configured architecture's estimated device latency (appliance edge
    estimate, kept in OUT/estimate) against [deploy] latency_budget_ms; one line and no training when
    it is over."""
    train = validate_training(cfg.training, cfg.source)
    table = estimate_once(cfg.out_dir / "estimate", train.model.architecture, cfg.package.target,
                          train.data.image_size, train.num_classes, log=say)
    budget, core = cfg.deploy.latency_budget_ms, cfg.deploy.latency_core
    estimate = check_latency_budget(table, budget, core, "int8" if cfg.quantize.mode == "int8" else "fp32")
    say(f"latency budget {budget:g} ms on {core}: estimated {estimate:.2f} ms")
