"""`appliance train` with [task] kind = "detection": real torchrun (2 CPU processes, gloo, offline),
Object Detection API records, fcos_tiny, COCO mAP in metrics.jsonl and the report, the box-prior
gate, and exact resume after a SIGKILL mid-run."""

import json

import pytest
import torch
from safetensors.torch import load_file

from det_data import DET_CLASSES, make_det_config
from test_resume import _train


def _config(workdir, name):
    return make_det_config(workdir, name=name, train_records=96, val_records=16,
                           train={"epochs": 4, "batch_size": 8}, optimizer={"lr": 0.01}, data={"image_size": 32},
                           augment={"enabled": True, "crop_scale": [0.6, 1.0], "degrees": 10.0},
                           checkpoint={"every_steps": 3, "keep_last": 3})


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("det")


@pytest.mark.slow
def test_detection_trains_with_coco_map_and_resumes_exactly_after_a_kill(workdir):
    proc = _train(_config(workdir, "reference"), timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    run = workdir / "runs" / "reference"
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_map50" in r]
    assert len(evals) == 4 and "val_acc" not in evals[-1]
    last = evals[-1]
    assert set(last["val_ap50"]) == set(DET_CLASSES) and 0 <= last["val_map"] <= last["val_map50"] <= 1
    assert [len(row) for row in last["val_confusion"]] == [6, 6]  # COCO rows per class
    quality = json.loads((run / "quality.json").read_text())  # 24 steps (6 an epoch): it learned
    assert quality["passed"] and quality["val_map50"] > quality["required_map50"] > quality["baseline_map50"]
    assert "box-prior baseline" in quality["line"]
    report = json.loads((run / "report.json").read_text())
    assert report["detection"]["val_map50"] == [r["val_map50"] for r in evals]
    assert 'id="chart-map"' in (run / "report.html").read_text()
    card = json.loads((run / "model" / "model.json").read_text())
    assert card["architecture"] == "fcos_tiny" and card["extra"]["task"]["kind"] == "detection"

    killed = _train(_config(workdir, "killed"), "--max-restarts", "1", fault="step:5:1", timeout=500)
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "exitcode: -9" in killed.stderr and "(step 3" in killed.stdout
    for name in ("model/model.safetensors",):
        a, b = load_file(run / name), load_file(workdir / "runs" / "killed" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    evals_killed = [r for r in map(json.loads, (workdir / "runs" / "killed" / "metrics.jsonl").read_text().splitlines())
                    if "val_map50" in r]
    assert evals_killed[-1]["val_confusion"] == last["val_confusion"]
