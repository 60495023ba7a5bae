"""Guards on real torchrun runs (gloo, 2 CPU processes): one run per run directory, a loss that
turns NaN stops every rank and keeps the resume point, a worker's error is its own one line."""

import os
import signal
import subprocess
import time

import pytest

from appliance.train import worker_error
from conftest import appliance_cmd
from train_data import make_config


def _start(config, *args, fault=""):
    env = {**os.environ, "APPLIANCE_TEST_FAULT": fault, "OMP_NUM_THREADS": "1"}
    cmd = appliance_cmd("train", str(config), "--nproc-per-node", "2", *args)
    # Own session: the whole tree (launcher, torchrun, workers) can be killed at once.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=config.parent, start_new_session=True)


def _finish(proc, timeout=240):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"appliance train did not finish in {timeout} s")
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("guards")


def test_second_run_on_one_run_directory_refuses_with_one_line(workdir):
    config = make_config(workdir, name="busy", train={"epochs": 40})
    lock = workdir / "runs" / "busy" / ".lock"
    first = _start(config)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (lock.exists() and lock.read_text().startswith("pid ")):
            time.sleep(0.1)
        assert lock.read_text().startswith(f"pid {first.pid}\n")
        second = subprocess.run(appliance_cmd("train", str(config), "--nproc-per-node", "2"), capture_output=True,
                                text=True, timeout=120, cwd=workdir)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the kernel releases its lock
        first.communicate()
    assert second.returncode == 75
    started = lock.read_text().splitlines()[1].split(" ", 1)[1]
    assert second.stderr == (f"appliance train: error: {workdir / 'runs' / 'busy'}: the run directory is in use by "
                             f"another run (PID {first.pid}, started {started}); wait for it to finish or use "
                             "another directory\n")
    assert not (workdir / "runs" / "busy" / "metrics.jsonl").exists() or "resumed_from" not in (
        workdir / "runs" / "busy" / "metrics.jsonl").read_text()


def test_nan_loss_stops_every_rank_and_the_run_resumes_from_the_last_good_checkpoint(workdir):
    config = make_config(workdir, name="nan", train={"epochs": 1, "max_steps": 8})
    run_dir = workdir / "runs" / "nan"
    status, out, err = _finish(_start(config, fault="nan-loss:7:1"))  # rank 1's loss of step 7 is NaN
    line = (f"{config}: the training loss is not finite (NaN or inf) at step 7 (rank 1); every process stopped "
            "without saving, the newest checkpoint step-00000005 is the resume point; lower [optimizer] lr "
            "or set [train] grad_clip")
    assert status != 0
    assert worker_error.read(run_dir) == line
    assert f"appliance train: error: {line}" in err
    assert "appliance/train/" not in err, err[-3000:]  # no worker traceback
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000005"]
    # Without the fault the same command resumes there and finishes; the stale line is gone.
    status, out, err = _finish(_start(config))
    assert status == 0, err[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step-00000005'} (step 5" in out
    assert "trained 8 steps" in out
    assert worker_error.read(run_dir) is None


def test_worker_error_is_left_as_the_workers_own_line(workdir):
    # Two classes for data labelled 0..2: only a worker meets a record of class 2 (a missing --resume
    # directory, the trigger once, is now refused before torchrun starts).
    config = make_config(workdir, name="label-past-classes", train={"epochs": 1, "max_steps": 8},
                         data={"classes": ["left", "right"]})  # a run of its own: "nan" is the NaN test's
    status, _, err = _finish(_start(config, "--max-restarts", "3"))
    line = worker_error.read(workdir / "runs" / "label-past-classes")
    assert status != 0
    assert line.startswith(str(workdir / "data")) and "label 2 is outside 0..1 (the config has 2 classes)" in line, line
    assert f"appliance train: error: {line}" in err and "appliance/train/" not in err, err[-3000:]
    # A data error is final (worker_error.FINAL_NAME): --max-restarts restarted it three times before its
    # line (a segmentation pipeline with the check off did). Each attempt opens one TensorBoard file.
    assert len(list((workdir / "runs" / "label-past-classes" / "tb").iterdir())) == 1


def test_a_worker_killed_by_a_signal_is_named_as_the_cause_not_its_peer(workdir):
    """Rank 1 SIGKILLed (what the out-of-memory killer does); rank 0 then fails in the next collective
    ("Connection reset by peer"). torchrun named whichever failure had the earlier whole-second
    timestamp, often rank 0; the agent names the killed rank, and the launcher says it was a signal."""
    config = make_config(workdir, name="oom", train={"epochs": 1, "max_steps": 6})
    status, _, err = _finish(_start(config, fault="step:2:1"))
    assert status != 0
    assert "failed (exitcode: -9) local_rank: 1" in err and "failed (exitcode: 1)" not in err, err[-3000:]
    assert err.splitlines()[-1] == (
        "appliance train: error: training failed: a worker was killed by SIGKILL (the kernel's out-of-memory killer "
        "sends it: see `dmesg`); the log above names its rank (exitcode: -9). Checkpoints: "
        f"{workdir / 'runs' / 'oom' / 'checkpoints'}"), err[-3000:]


def test_malformed_test_fault_is_one_line(monkeypatch):
    from appliance.core.errors import ConfigError
    from appliance.train import faults

    monkeypatch.setenv("APPLIANCE_TEST_FAULT", "step:three:1")
    with pytest.raises(ConfigError) as err:
        faults.load()
    assert str(err.value) == ("APPLIANCE_TEST_FAULT='step:three:1' is not POINT:STEP:RANK with POINT one of step, "
                              "checkpoint-write, nan-loss, finished, finished-hang (a test hook: unset it)")
    monkeypatch.setenv("APPLIANCE_TEST_FAULT", "nan-loss:3:0")
    faults.load()
    assert faults.armed("nan-loss", 3, 0) and not faults.armed("nan-loss", 3, 1)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the restart after the fault runs clean
    faults.load()
    assert not faults.armed("nan-loss", 3, 0)


def test_disk_pre_check_in_a_worker_is_one_line_on_its_own_line(workdir):
    # Asks for 100 TB to stay free: the first save (step 5) refuses before writing anything.
    config = make_config(workdir, name="no-room", train={"epochs": 1, "max_steps": 6},
                         checkpoint={"min_free_gb": 100_000.0})
    run_dir = workdir / "runs" / "no-room"
    status, _, err = _finish(_start(config))
    line = worker_error.read(run_dir)
    assert status != 0 and line is not None, err[-3000:]
    assert line.startswith(f"{run_dir / 'checkpoints'}: not enough free disk for a checkpoint: ")
    assert " free, need 97.7 TiB (checkpoint + [checkpoint] min_free_gb); nothing was written." in line
    # The progress bar was closed first: the worker's line starts a line of its own.
    assert f"appliance train: error: {line}" in err.splitlines(), err[-3000:]
    assert "appliance/train/" not in err and not list((run_dir / "checkpoints").iterdir())


def test_a_network_namespace_with_loopback_down_is_one_line_before_torchrun(workdir):
    """`unshare -n` without `ip link set lo up`: the rendezvous cannot run; one line, no torchrun traceback."""
    config = make_config(workdir, name="nolo")
    proc = subprocess.run(["unshare", "-n", *appliance_cmd("train", str(config), "--nproc-per-node", "2")],
                          capture_output=True, text=True, timeout=120, cwd=workdir)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "loopback interface is down" in proc.stderr and "ip link set lo up" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (workdir / "runs" / "nolo" / "checkpoints").exists()

