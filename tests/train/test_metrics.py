"""Metrics a reviewer asks for: per-class figures from confusion counts, and a real run whose
metrics.jsonl, TensorBoard events and report.html carry gradient norms, training accuracy,
per-class precision/recall and the confusion matrix."""

import html
import json
import os
import re
import subprocess

import pytest

from appliance.train.metrics import per_class
from appliance.train.report import training_report, write_training_report
from conftest import appliance_cmd, offline_cmd
from train_data import CLASSES, make_config


def test_per_class_precision_and_recall_from_confusion_counts():
    # rows: true left/right/top; columns: predicted.
    figures = per_class([[8, 2, 0], [1, 6, 3], [0, 0, 0]], CLASSES)
    assert figures["recall"] == {"left": 0.8, "right": 0.6, "top": 0.0}  # no "top" samples: 0.0, not a crash
    assert figures["precision"] == {"left": 8 / 9, "right": 0.75, "top": 0.0}  # "top" predicted 3 times, never right
    assert list(per_class([[1, 0], [0, 1]])["recall"]) == ["0", "1"]  # no names: class numbers
    with pytest.raises(ValueError, match="square"):
        per_class([[1, 2], [3]])


def test_report_counts_a_step_logged_twice_once(tmp_path):
    # A resumed run repeats the steps a lost attempt had logged: the later line wins.
    lines = [{"step": 4, "epoch": 0, "loss": 2.0, "lr": 1e-3, "train_acc": 0.25, "grad_norm": 3.0, "clipped_fraction": 1.0},
             {"step": 8, "epoch": 0, "loss": 9.0, "lr": 1e-3, "train_acc": 0.1, "grad_norm": 9.0, "clipped_fraction": 1.0},
             {"step": 4, "epoch": 0, "resumed_from": "checkpoints/step-00000004"},
             {"step": 8, "epoch": 0, "loss": 1.0, "lr": 5e-4, "train_acc": 0.5, "grad_norm": 0.5, "clipped_fraction": 0.0},
             {"step": 8, "epoch": 0, "val_loss": 0.9, "val_acc": 0.6, "val_confusion": [[3, 1], [1, 0]]}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = training_report(tmp_path / "metrics.jsonl", ("cat", "dog"))
    assert report["train"]["step"] == [4, 8] and report["train"]["loss"] == [2.0, 1.0]
    assert report["confusion"]["recall"] == {"cat": 0.75, "dog": 0.0}
    write_training_report(tmp_path, ("cat", "dog"))
    written = json.loads((tmp_path / "report.json").read_text())
    assert {k: v for k, v in written.items() if k != "created"} == {k: v for k, v in report.items() if k != "created"}
    assert 'id="confusion"' in (tmp_path / "report.html").read_text()


def test_train_window_leaves_out_non_finite_norms_and_counts_clipped_steps(tmp_path):
    import torch
    import torch.distributed as dist

    from appliance.train.loop import TrainWindow

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        window = TrainWindow(torch.device("cpu"), clip=1.0)
        for norm in (3.0, float("inf"), 0.5, 1.5):  # inf: an fp16 step the scaler skipped
            window.count_step(torch.tensor(norm))
        window.count_predictions(torch.tensor([[2.0, 1.0], [0.0, 1.0], [5.0, 0.0]]), torch.tensor([0, 0, 0]))
        assert window.figures() == {"grad_norm": 5.0 / 3, "grad_norm_max": 3.0, "clipped_fraction": 0.5,
                                    "nonfinite_grad_steps": 1, "train_acc": 2 / 3, "loss_sum": 0.0}
    finally:
        dist.destroy_process_group()


def test_without_clipping_the_norm_is_still_measured(tmp_path):
    config = make_config(tmp_path, name="unclipped", train={"epochs": 1, "grad_clip": 0.0})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(offline_cmd(appliance_cmd("train", str(config), "--nproc-per-node", "1"), loopback=True),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    windows = [r for r in map(json.loads, (tmp_path / "runs" / "unclipped" / "metrics.jsonl").read_text().splitlines())
               if "loss" in r]
    assert len(windows) == 4 and all(w["clipped_fraction"] == 0.0 and w["grad_norm"] > 0 for w in windows)
    assert windows[0]["grad_norm_max"] > 1.0  # as large as with clipping on: measured before any clipping


def _tensorboard_scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the run's event files, as TensorBoard itself loads them (its EventAccumulator,
    the reader behind `tensorboard --logdir`), so a file TensorBoard cannot read fails here."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(tb_dir.glob("events.out.tfevents.*"))
    assert files, f"no event files in {tb_dir}"
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in files:
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})  # 0: keep every point
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return scalars


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("metrics")
    # 256 records, batch 16: 16 steps an epoch; 2 epochs, a log line every 4 steps; clipping at 0.5
    # so some steps are clipped and some (later, smaller gradients) may not be.
    config = make_config(tmp_path, name="reviewed", train={"epochs": 2, "grad_clip": 0.5})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(offline_cmd(appliance_cmd("train", str(config), "--nproc-per-node", "1"), loopback=True),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp_path / "runs" / "reviewed"


def test_metrics_jsonl_has_gradient_norm_train_accuracy_and_per_class_figures(finished_run):
    records = [json.loads(line) for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_acc" in r]
    assert [w["step"] for w in windows] == list(range(4, 33, 4)) and len(evals) == 2
    for w in windows:
        assert 0 < w["grad_norm"] <= w["grad_norm_max"]
        assert w["nonfinite_grad_steps"] == 0
        assert w["clipped_fraction"] in (0.0, 0.25, 0.5, 0.75, 1.0)  # 4 steps a window
        if w["clipped_fraction"] == 1.0:  # every step's norm was above the clip, so their mean is too
            assert w["grad_norm"] > 0.5
        if w["clipped_fraction"] == 0.0:
            assert w["grad_norm_max"] <= 0.5
        assert 0 <= w["train_acc"] <= 1
        assert (w["train_acc"] * 4 * 16) == pytest.approx(round(w["train_acc"] * 4 * 16))  # hits of 64 records
    assert windows[0]["clipped_fraction"] == 1.0  # the first steps of a fresh model have large gradients
    assert windows[-1]["clipped_fraction"] == 0.0 and windows[-1]["grad_norm"] < windows[0]["grad_norm"]
    assert windows[-1]["train_acc"] >= max(windows[0]["train_acc"], 0.9)  # the data is learnable in two epochs
    last = evals[-1]
    assert set(last["val_recall"]) == set(last["val_precision"]) == set(CLASSES)
    confusion = last["val_confusion"]
    for c, name in enumerate(CLASSES):
        assert last["val_recall"][name] == pytest.approx(confusion[c][c] / sum(confusion[c]))
        predicted = sum(row[c] for row in confusion)
        assert last["val_precision"][name] == pytest.approx(confusion[c][c] / predicted if predicted else 0.0)
    correct = sum(confusion[c][c] for c in range(len(CLASSES)))
    assert last["val_acc"] == pytest.approx(correct / 33)


def test_tensorboard_sees_the_new_scalars(finished_run):
    scalars = _tensorboard_scalars(finished_run / "tb")
    records = [json.loads(line) for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "loss" in r]
    for tag, key in (("train/grad_norm", "grad_norm"), ("train/clipped_fraction", "clipped_fraction"),
                     ("train/acc", "train_acc")):
        assert [s for s, _ in scalars[tag]] == [w["step"] for w in windows], tag
        assert [v for _, v in scalars[tag]] == pytest.approx([w[key] for w in windows], rel=1e-6), tag
    last = [r for r in records if "val_acc" in r][-1]
    for name in CLASSES:
        assert scalars[f"val/recall/{name}"][-1][1] == pytest.approx(last["val_recall"][name], rel=1e-6)
        assert scalars[f"val/precision/{name}"][-1][1] == pytest.approx(last["val_precision"][name], rel=1e-6)


def test_training_report_renders_its_charts_and_confusion_matrix(finished_run, tmp_path):
    from test_reports_html import assert_readable, measure

    report = json.loads((finished_run / "report.json").read_text())
    assert report["confusion"]["counts"] == [r for r in map(json.loads, (finished_run / "metrics.jsonl").read_text()
                                                          .splitlines()) if "val_acc" in r][-1]["val_confusion"]
    manifest = json.loads((finished_run / "manifest.json").read_text())
    assert {"report.html", "report.json"} <= {os.path.basename(o["path"]) for o in manifest["outputs"]}
    page = tmp_path / "report.html"
    page.write_text((finished_run / "report.html").read_text())
    m = measure(page, tmp_path)
    assert_readable(m, "report.html")
    charts = {svg["id"] for svg in m["svgs"]}
    assert {"chart-loss", "chart-acc", "chart-lr", "chart-grad-norm", "chart-clipped"} <= charts
    # Laid out by the browser: each line has as many points as there are logging windows (or evaluations).
    dom = subprocess.run(["unshare", "-n", "/usr/bin/chromium", "--headless", "--no-sandbox", "--disable-gpu",
                          f"--user-data-dir={tmp_path / 'profile2'}", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    lines = re.findall(r'<polyline class="series" data-name="([^"]+)" data-points="(\d+)"[^>]*points="([^"]+)"', dom)
    assert len(lines) == 7  # loss x2, accuracy x2, lr, grad norm, clipped
    for name, count, points in lines:
        assert int(count) == len(points.split()) == (2 if name == "validation" else 8), name
    assert "true \\ predicted" in html.unescape(dom) and "left" in m["text"] and "recall" in m["text"]
