"""`appliance tune` end to end: a real Optuna study whose trials are real `appliance train` runs (torchrun,
CPU) on small real TFRecords, with learning rates that diverge in its space.

One uninterrupted study; the best config it writes retrained by `appliance train`; the same study killed
(SIGKILL of the tuner) while its first trial trains, then started again. About 8 short training runs.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "train"))
sys.path.insert(0, str(ROOT))

from conftest import appliance_cmd, seeded_choice  # noqa: E402
from test_reports_html import assert_readable, measure  # noqa: E402
from train_data import make_config  # noqa: E402

DIVERGING_LR = 2.0  # SGD without clipping on this data: the loss is not finite within an epoch
TUNE = """
[tune]
trials = 3
seed = 11
startup_trials = 3
prune_startup_trials = 1
[tune.space]
"optimizer.lr" = { low = 0.02, high = 10.0, log = true }  # 10: the training config's bound
"""


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("tune")
    path = make_config(tmp, name="digits", train_records=48, val_records=12,
                       optimizer={"name": "sgd", "lr": 0.05, "weight_decay": 0.0},
                       schedule={"warmup_steps": 0, "min_lr_ratio": 0.1},
                       train={"epochs": 2, "batch_size": 16, "grad_clip": 0.0},
                       checkpoint={"every_steps": 2, "keep_last": 3, "keep_best": 0, "min_free_gb": 0.0})
    path.write_text(path.read_text() + TUNE)
    return path


def tune(config: Path, out: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(appliance_cmd("tune", str(config), "--out", str(out)), capture_output=True, text=True,
                          timeout=600, **kw)


@pytest.fixture(scope="module")
def study(config) -> dict:
    out = config.parent / "study"
    proc = tune(config, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"out": out, "report": json.loads((out / "report.json").read_text()), "stdout": proc.stdout}


def test_diverging_trials_are_failed_or_pruned_and_every_trial_is_recorded(study):
    report = study["report"]
    trials = report["trials"]
    assert len(trials) == 3 and report["counts"]["running"] == 0
    diverging = [t for t in trials if t["params"]["optimizer.lr"] >= DIVERGING_LR]
    assert diverging, "the seeded space drew no diverging learning rate"
    for t in diverging:
        assert t["state"] in ("fail", "pruned"), t
        if t["state"] == "fail":
            assert "not finite" in t["fail_reason"], t["fail_reason"]
    assert report["counts"]["complete"] >= 1
    for t in trials:
        assert t["seed"] == 7  # the config's [run] seed, recorded per trial
        assert Path(t["run_dir"], "config.toml").is_file()
    best = report["best"]
    complete = [t for t in trials if t["state"] == "complete"]
    assert best["value"] == max(t["value"] for t in complete)
    assert math.isfinite(best["value"]) and best["params"]["optimizer.lr"] < DIVERGING_LR


def test_the_best_config_retrains_to_the_best_trials_metric(study, tmp_path):
    best = study["report"]["best"]
    config = study["out"] / "best.toml"
    text = config.read_text()
    assert f"lr = {best['params']['optimizer.lr']!r}" in text and "seed = 7" in text
    proc = subprocess.run(appliance_cmd("train", str(config), "--quiet"), capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 3), proc.stderr[-2000:]  # 3: trained, the quality gate judged it
    run_dir = Path(text.split('out_dir = "')[1].split('"')[0]) / "digits-tuned"
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"val_acc"' in line]
    assert evals[-1]["val_acc"] == best["value"]


def test_a_killed_study_resumes_and_finishes_as_the_uninterrupted_one(study, config):
    out = config.parent / "killed"
    step = seeded_choice([2, 4], "kill the tuner after trial 0's checkpoint at step")
    proc = subprocess.Popen(appliance_cmd("tune", str(config), "--out", str(out)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    checkpoint = out / "trials" / "0000" / "checkpoints" / f"step-{step:08d}" / "COMMITTED"
    deadline = time.monotonic() + 300
    while not checkpoint.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # the tuner only: its trial gets SIGTERM as its parent dies
    proc.communicate()

    again = tune(config, out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "trial 0 resumed from its newest checkpoint" in again.stderr
    resumed = json.loads((out / "report.json").read_text())
    assert resumed["counts"] == study["report"]["counts"]
    for a, b in zip(study["report"]["trials"], resumed["trials"], strict=True):
        assert (a["number"], a["state"], a["params"], a["value"]) == (b["number"], b["state"], b["params"], b["value"])
    assert resumed["trials"][0]["resumed"] == 1


def test_the_report_renders_offline_with_its_plots(study, tmp_path):
    page = study["out"] / "report.html"
    m = measure(page, tmp_path)
    assert_readable(m, page.name)
    plots = [s for s in m["svgs"] if "plot" in s["cls"]]
    assert len(plots) >= 3  # history, one slice per parameter, the per-epoch curves
    assert any("bars" in s["cls"] for s in m["svgs"]) or "needs two complete trials" in page.read_text()
    text = page.read_text()
    for words in ("Optimisation history", "Slice: val_acc against optimizer.lr", "the pruner&#x27;s view"):
        assert words in text
    manifest = json.loads((study["out"] / "manifest.json").read_text())
    assert {o["path"] for o in manifest["outputs"]} >= {"report.html", "report.json", "best.toml", "study.journal"}
