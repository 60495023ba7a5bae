"""The quality gate on the trained model: figures from confusion counts, and real runs that pass
and fail it (`appliance train`, and `appliance pipeline` stopping before export)."""

import json
import os

import pytest

from appliance.core.errors import ConfigError, GateFailed
from appliance.train.config import load_config
from appliance.train.quality import Thresholds, quality_figures, require_quality, summary_line
from conftest import appliance_cmd, offline_cmd
from train_data import CLASSES, make_config


def test_constant_prediction_fails_on_baseline_and_collapse():
    # 30 validation samples, 12/10/8 by class; the model answers "left" for every one.
    confusion = [[12, 0, 0], [10, 0, 0], [8, 0, 0]]
    figures = quality_figures(confusion, CLASSES)
    assert figures["val_acc"] == figures["majority_baseline"] == 12 / 30
    assert figures["top_predicted_class"] == "left" and figures["top_predicted_share"] == 1.0
    assert figures["passed"] is False and len(figures["failures"]) == 2
    assert "predicts class 'left' for 100.0 % of the samples" in figures["failures"][1]
    assert figures["class_recall"] == {"left": 1.0, "right": 0.0, "top": 0.0}
    with pytest.raises(GateFailed) as err:
        require_quality("runs/r", figures)
    assert err.value.exit_code == 3
    line = str(err.value)
    assert "\n" not in line and line.startswith("run runs/r: ")
    assert "val top-1 40.0 %" in line and "baseline 40.0 %" in line


def test_a_model_that_learned_passes_and_floors_can_still_fail_it():
    confusion = [[10, 1, 0], [0, 9, 2], [1, 0, 10]]  # 29 of 33
    figures = quality_figures(confusion, CLASSES)
    assert figures["passed"], figures["failures"]
    assert summary_line("r", figures).endswith("quality gate passed")
    assert not quality_figures(confusion, CLASSES, Thresholds(min_val_acc=0.95))["passed"]
    low = quality_figures(confusion, CLASSES, Thresholds(min_class_recall=0.85))
    assert low["failures"] == ["class recall below min_class_recall 85.0 %: 'right' 81.8 %"]


def test_imbalanced_validation_set_majority_answer_is_not_enough():
    # 90 % of the samples are "left": 90 % top-1 by always answering "left" is no model.
    figures = quality_figures([[90, 0], [10, 0]], ("left", "right"))
    assert figures["majority_baseline"] == 0.9 and not figures["passed"]
    # Predicting "left" 91 % of the time is not a collapse here, and 95 % top-1 closes half the gap.
    good = quality_figures([[89, 1], [4, 6]], ("left", "right"))
    assert good["passed"], good["failures"]


def test_thresholds_are_checked_and_do_not_change_the_training_hash(tmp_path):
    plain = load_config(make_config(tmp_path, name="plain"))
    strict = load_config(make_config(tmp_path, name="plain", train={"min_val_acc": 0.9, "baseline_margin": 0.5}))
    assert plain.training_hash() == strict.training_hash()  # resuming with a stricter gate is allowed
    with pytest.raises(ConfigError, match=r"\[train\] min_class_recall is a fraction in \[0, 1\], got 2.0"):
        load_config(make_config(tmp_path, name="plain", train={"min_class_recall": 2.0}))


def _run(cmd, cwd, timeout=300):
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(offline_cmd(cmd, loopback=True), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)


def test_small_cnn_run_passes_the_gate_and_reports_its_figures(tmp_path):
    config = make_config(tmp_path, name="learns")
    proc = _run(appliance_cmd("train", str(config), "--nproc-per-node", "1"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "learns"
    quality = json.loads((run_dir / "quality.json").read_text())
    assert quality["passed"] and quality["samples"] == 33
    assert quality["majority_baseline"] == pytest.approx(11 / 33)
    assert quality["line"] in proc.stdout and "quality gate passed" in proc.stdout
    last_eval = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                 if "val_acc" in line][-1]
    confusion = last_eval["val_confusion"]
    assert sum(map(sum, confusion)) == 33
    assert sum(confusion[i][i] for i in range(3)) / 33 == pytest.approx(last_eval["val_acc"])


PIPELINE = """
[pipeline]
out = "out"
nproc_per_node = "1"
max_restarts = 0
[check]
enabled = false
[run]
name = "ignored"
seed = 7
[data]
train = ["data/train-*.tfrecord"]
val = ["data/val-*.tfrecord"]
classes = ["left", "right", "top"]
image_size = 8
channels = 1
mean = [0.3]
std = [0.25]
num_workers = 0
[optimizer]
lr = 1e-9
[train]
epochs = 1
batch_size = 16
precision = "fp32"
[checkpoint]
min_free_gb = 0.0
[compile]
targets = ["aarch64"]
"""


def test_pipeline_that_cannot_learn_stops_at_the_gate_with_exit_3(tmp_path):
    make_config(tmp_path, train_records=64, val_records=33)  # writes tmp_path/data
    (tmp_path / "pipeline.toml").write_text(PIPELINE)
    proc = _run(appliance_cmd("pipeline", str(tmp_path / "pipeline.toml")), tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    line = errors[0]
    assert str(tmp_path / "out" / "train") in line and "quality gate failed" in line
    assert "val top-1" in line and "majority-class baseline 33.3 %" in line
    assert not (tmp_path / "out" / "export").exists()  # nothing after the gate ran
    assert json.loads((tmp_path / "out" / "gate" / "quality.json").read_text())["passed"] is False
