"""`appliance demo` end to end under `unshare -n`, and the pipeline's rerun semantics on its output."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from conftest import appliance_cmd, offline_cmd

pytestmark = pytest.mark.slow


def run_offline(*args, timeout=900):
    proc = subprocess.run(offline_cmd(appliance_cmd(*args), loopback=True), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def stage_lines(stderr: str, word: str) -> set[str]:
    """Stage names the pipeline reported as `skipped` or `running`."""
    found = set()
    for line in stderr.splitlines():
        if line.startswith("[pipeline] ") and f": {word}" in line:
            found.add(line.split()[1].rstrip(":"))
    return found


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    proc = run_offline("demo", "--out", str(out))
    return out, proc


def test_demo_offline_meets_the_accuracy_and_agreement_bars(demo):
    out, proc = demo
    summary = json.loads((out / "out" / "summary.json").read_text())
    acc = summary["accuracy"]
    assert acc["fp32_top1"] >= 0.97, acc
    assert acc["fp32_top1"] - acc["int8_top1"] <= 0.01, acc
    assert acc["edge_agreement_with_host"] >= 0.995, acc
    assert summary["verified_samples"] >= 300  # the whole validation split, not a handful
    # The model beat the majority-class baseline by the gate's margin.
    assert summary["quality_gate"]["passed"] and acc["fp32_top1"] > acc["val_majority_baseline_top1"] + 0.5, acc
    # The figures are printed for the user too.
    assert f"{100 * acc['fp32_top1']:.2f} %" in proc.stdout
    # Lineage reaches back to the TFRecord files the demo wrote.
    data_files = {str(p) for p in (out / "data").glob("*.tfrecord")}
    lineage_inputs = {i["path"] for step in summary["lineage"] for i in step["inputs"]}
    assert data_files <= lineage_inputs
    # The edge package's own manifest says what made it and how to remake it: `appliance demo`.
    import shlex
    import tarfile
    with tarfile.open(summary["artifacts"]["package"] + "/edge-package-aarch64.tar") as tar:
        manifest = json.load(tar.extractfile("edge-package/manifest.json"))
    made_by = shlex.join(["appliance", "demo", "--out", str(out)])
    assert manifest["command"] == made_by and manifest["appliance_version"]
    assert [s["stage"] for s in manifest["lineage"]] == ["check", "train", "export", "quantize", "compile"]
    assert all(s["command"] == made_by for s in manifest["lineage"])
    assert data_files <= {i["path"] for i in manifest["lineage"][0]["inputs"]}
    print("demo figures:", json.dumps(acc))
    for stage in ("check", "train", "gate", "export", "quantize", "compile-x86_64", "compile-aarch64", "package", "verify"):
        assert (out / "out" / stage / "manifest.json").is_file(), stage


def test_demo_epochs_below_one_is_one_line(tmp_path):
    proc = subprocess.run(appliance_cmd("demo", "--out", str(tmp_path / "d"), "--epochs", "0"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--epochs: must be at least 1, got 0" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "d").exists()


def test_rerun_with_nothing_changed_redoes_nothing(demo):
    out, _ = demo
    proc = run_offline("pipeline", str(out / "pipeline.toml"))
    assert stage_lines(proc.stderr, "running") == set()
    assert "train" in stage_lines(proc.stderr, "unchanged")


def test_changing_a_training_parameter_redoes_train_and_later_only(demo, tmp_path):
    out, _ = demo
    copy = tmp_path / "demo"
    shutil.copytree(out, copy, symlinks=True)
    config = copy / "pipeline.toml"
    config.write_text(config.read_text().replace("lr = 0.004", "lr = 0.0035"))
    proc = run_offline("pipeline", str(config))
    assert stage_lines(proc.stderr, "unchanged") == {"check"}
    assert stage_lines(proc.stderr, "running") == {
        "train", "gate", "export", "quantize", "compile-x86_64", "compile-aarch64", "package", "verify"}


def test_pipeline_killed_during_training_finishes_with_the_same_model(demo, tmp_path):
    out, _ = demo
    work = tmp_path / "killed"
    (work / "data").mkdir(parents=True)
    for f in (out / "data").iterdir():
        shutil.copy(f, work / "data" / f.name)
    shutil.copy(out / "pipeline.toml", work / "pipeline.toml")
    cmd = offline_cmd(appliance_cmd("pipeline", str(work / "pipeline.toml")), loopback=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    checkpoints = work / "out" / "train" / "checkpoints"
    deadline = time.monotonic() + 600
    try:
        while not any(checkpoints.glob("*/COMMITTED")):
            assert proc.poll() is None, "the pipeline ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (work / "out" / "train" / "model" / "model.safetensors").exists(), "killed too late"
    # torchrun puts workers in sessions of their own; they must die with their agent, not train on.
    deadline = time.monotonic() + 10
    while any(str(work) in " ".join(cmdline) for cmdline in _command_lines()):
        assert time.monotonic() < deadline, "a training worker outlived the killed pipeline"
        time.sleep(0.2)
    run_offline("pipeline", str(work / "pipeline.toml"))
    resumed = (work / "out" / "train" / "model" / "model.safetensors").read_bytes()
    uninterrupted = (out / "out" / "train" / "model" / "model.safetensors").read_bytes()
    assert resumed == uninterrupted


def _command_lines():
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                yield open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
            except OSError:
                continue
