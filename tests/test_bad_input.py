"""What a new user types by mistake: one line naming the file and the problem, exit 2, nothing written."""

import os
import sys
from pathlib import Path

import pytest

from conftest import run_appliance

sys.path.insert(0, str(Path(__file__).resolve().parent / "train"))
from train_data import make_config  # noqa: E402


def one_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    return lines[0]


@pytest.mark.parametrize("verb", ["cat", "index"])
def test_data_verbs_on_a_directory(tmp_path, verb):
    line = one_line(run_appliance("data", verb, str(tmp_path)))
    assert line == f"appliance data {verb}: error: {tmp_path}: is a directory, not a file"


@pytest.mark.parametrize("verb", ["train", "pipeline", "tune"])
def test_config_verbs_on_a_directory(tmp_path, verb):
    line = one_line(run_appliance(verb, str(tmp_path)))
    assert line.startswith(f"appliance {verb}: error: {tmp_path}: is a directory, not a ")
    assert list(tmp_path.iterdir()) == []


def test_a_text_file_listed_as_training_data_stops_before_torchrun(tmp_path):
    config = make_config(tmp_path, train_records=8, val_records=3)
    notes = tmp_path / "data" / "train-notes.tfrecord"  # matched by the config's train-*.tfrecord glob
    notes.write_text("these are my notes, not TFRecords\n")
    proc = run_appliance("train", str(config))
    line = one_line(proc)
    assert line.startswith(f"appliance train: error: {notes}: not a TFRecord file")
    assert "torch.distributed" not in proc.stdout + proc.stderr  # no process was started
    assert not (tmp_path / "runs").exists()


def test_a_worker_error_is_the_workers_one_line(tmp_path):
    # Two classes for data labelled 0..2: only a worker meets a record of class 2 (a missing --resume
    # directory, the trigger once, is now refused before torchrun starts).
    config = make_config(tmp_path, train_records=8, val_records=3, data={"classes": ["left", "right"]})
    proc = run_appliance("train", str(config), "--nproc-per-node", "2", "--quiet", timeout=300)
    line = one_line(proc)
    assert line.startswith(f"appliance train: error: {tmp_path / 'data'}") and "label 2 is outside 0..1" in line, line
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr


def _pickle_that_runs_code(path, marker):
    import torch

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"0.0.weight": Payload()}, path)


@pytest.mark.parametrize("init, expected", [
    ("cnn.safetensors", "cnn.safetensors: weights do not fit resnet18: first mismatched keys conv1.weight (missing)"),
    ("model.pth", "model.pth: not a weights-only file (its pickle would run code, so it is not loaded)"),
    ("torchvision:resnet50", "[model] init 'torchvision:resnet50': torchvision:resnet50: no such pretrained weights"),
])
def test_fine_tuning_weights_that_cannot_be_used_stop_before_torchrun(tmp_path, init, expected):
    import torch
    from safetensors.torch import save_file

    from appliance.models import build_model

    save_file(build_model("small_cnn", 3, 1).state_dict(), str(tmp_path / "cnn.safetensors"))
    marker = tmp_path / "the-pickle-ran"
    _pickle_that_runs_code(tmp_path / "model.pth", marker)
    torch.manual_seed(0)
    config = make_config(tmp_path, train_records=8, val_records=3,
                         model={"architecture": "resnet18" if init.endswith(".safetensors") else "small_cnn",
                                "init": init})
    proc = run_appliance("train", str(config), env={**os.environ, "APPLIANCE_WEIGHTS_DIR": str(tmp_path / "no-weights")})
    line = one_line(proc)
    assert line.startswith("appliance train: error: ") and expected in line, line
    assert "--weights resnet50" in line or not init.startswith("torchvision:")
    assert not marker.exists() and not (tmp_path / "runs").exists()
