"""Real torchrun runs (gloo, 2 CPU processes, offline under `unshare -n`): exact resume after SIGKILL,
kills during a checkpoint write, two nodes over c10d, and the run directory a user gets."""

import json
import os
import shlex
import socket
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from conftest import appliance_cmd, offline_cmd, seeded_choice
from train_data import make_config

STEPS_PER_EPOCH = 8  # 256 records, 2 processes, batch 16
TOTAL_STEPS = 24


def _train(config, *args, fault="", offline=True, timeout=240):
    # One thread per process on any box, so every run here sums in the same order.
    env = {**os.environ, "APPLIANCE_TEST_FAULT": fault, "OMP_NUM_THREADS": "1"}
    cmd = appliance_cmd("train", str(config), "--nproc-per-node", "2", *args)
    if offline:
        cmd = offline_cmd(cmd, loopback=True)
    # Own session: on a timeout the whole tree (launcher, torchrun, workers) is killed, not just the launcher.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=config.parent, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        pytest.fail(f"appliance train {config.name} did not finish in {timeout} s")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _tensors(run_dir):
    """Final weights, and the final checkpoint's optimizer tensors."""
    ckpt = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    assert ckpt.name == f"step-{TOTAL_STEPS:08d}"
    return load_file(run_dir / "model" / "model.safetensors"), load_file(ckpt / "optimizer.safetensors")


def _assert_identical(run_a, run_b):
    for a, b in zip(_tensors(run_a), _tensors(run_b)):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{key} differs"  # atol = 0


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def reference(workdir):
    """An uninterrupted run, offline: the network namespace has only loopback."""
    config = make_config(workdir, name="reference", data={"num_workers": 1})
    proc = _train(config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir / "runs" / "reference", proc


def test_offline_run_produces_the_run_directory(reference):
    run_dir, proc = reference
    assert f"trained {TOTAL_STEPS} steps" in proc.stdout
    for path in ("model/model.safetensors", "model/model.json", "metrics.jsonl", "manifest.json"):
        assert (run_dir / path).is_file(), path
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [line for line in lines if "val_acc" in line]
    assert [e["epoch"] for e in evals] == [0, 1, 2]
    assert evals[-1]["val_acc"] > 0.9  # the images are easy: it really learned
    train_lines = [line for line in lines if "loss" in line]
    assert {"lr", "samples_per_s", "data_wait_pct", "peak_memory_mb"} <= train_lines[0].keys()
    card = json.loads((run_dir / "model" / "model.json").read_text())
    assert card["class_names"] == ["left", "right", "top"] and card["mean"] == [0.3] and card["channel_order"] == "L"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stage"] == "train"
    assert sorted(os.path.basename(i["path"]) for i in manifest["inputs"]) == [
        "reference.toml", "train-0.tfrecord", "train-1.tfrecord", "val-0.tfrecord"]
    # retention keep_last 2 + best 1: the last two and the best epoch end (lowest val_loss)
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert len(kept) in (2, 3) and kept[-1] == f"step-{TOTAL_STEPS:08d}"


def test_sigkill_mid_epoch_then_elastic_restart_is_bit_identical(workdir, reference):
    # A random step that is neither an epoch end nor a checkpoint step: work since the last
    # checkpoint is lost and must be redone identically.
    step = seeded_choice([s for s in range(6, TOTAL_STEPS - 1) if s % STEPS_PER_EPOCH and s % 5])
    config = make_config(workdir, name="killed", data={"num_workers": 1})
    proc = _train(config, "--max-restarts", "1", fault=f"step:{step}:1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr, f"step {step}: no SIGKILL happened\n{proc.stderr[-3000:]}"
    resumed_from = max(s for s in range(1, step + 1) if s % 5 == 0 or s % STEPS_PER_EPOCH == 0)
    assert f"step-{resumed_from:08d} (step {resumed_from}" in proc.stdout, (step, proc.stdout[-2000:])
    _assert_identical(reference[0], workdir / "runs" / "killed")


def test_kill_during_checkpoint_write_keeps_previous_checkpoint_and_resumes_exactly(workdir, reference):
    config = make_config(workdir, name="killed-writing", data={"num_workers": 1})
    # Rank 0, the one that commits, dies with its files written into the temporary directory.
    proc = _train(config, "--max-restarts", "1", fault="checkpoint-write:10:0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr
    # The step-10 write never committed: the restart resumed from step 8 (the epoch end), redid 9
    # and 10, and wrote step 10 properly.
    assert "resumed from" in proc.stdout and "step-00000008 (step 8" in proc.stdout, proc.stdout[-2000:]
    assert not list((workdir / "runs" / "killed-writing" / "checkpoints").glob(".tmp-*"))
    _assert_identical(reference[0], workdir / "runs" / "killed-writing")


@pytest.mark.parametrize("signum", [15, 2])
def test_sigterm_or_ctrl_c_saves_a_checkpoint_and_stops_cleanly(workdir, reference, signum):
    # Loader worker processes get the signal too (one process group), and must not crash the stop.
    config = make_config(workdir, name=f"stopped-{signum}", train={"epochs": 40}, data={"num_workers": 1})
    cmd = appliance_cmd("train", str(config), "--nproc-per-node", "2")
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    metrics = workdir / "runs" / f"stopped-{signum}" / "metrics.jsonl"
    import time
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.stat().st_size > 0):
        time.sleep(0.2)
    os.killpg(proc.pid, signum)  # what Ctrl-C or a scheduler's preemption sends to the whole job
    time.sleep(0.5)
    os.killpg(proc.pid, signum)  # and again, as an impatient user or a scheduler's second notice does
    out, err = proc.communicate(timeout=120)
    assert "stopped by signal at step" in out, err[-2000:]
    step = int(out.split("stopped by signal at step ")[1].split(";")[0])
    assert (workdir / "runs" / f"stopped-{signum}" / "checkpoints" / f"step-{step:08d}" / "COMMITTED").is_file()
    assert "run the same command to resume" in err and proc.returncode == 128 + signum
    # torchrun's agent prints its own SignalException traceback; no worker may have crashed.
    assert "appliance/train/" not in err and "DataLoader worker" not in err and "[rank" not in err, err[-3000:]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_over_c10d_match_one_node(workdir, reference):
    config = make_config(workdir, name="two-nodes", data={"num_workers": 1})
    port = _free_port()
    nodes = [appliance_cmd("train", str(config), "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(r),
                           "--rdzv-endpoint", f"127.0.0.1:{port}") for r in (0, 1)]
    # Both "machines" in one network namespace with only loopback, like two hosts on one switch.
    script = f"{shlex.join(nodes[0])} & n0=$!; {shlex.join(nodes[1])}; r1=$?; wait $n0; r0=$?; exit $((r0 | r1))"
    # CPU kernels sum in an order that depends on the thread count: one thread per process, as
    # the single-node run on this 2-core box got from the launcher.
    proc = subprocess.run(offline_cmd(["sh", "-c", script], loopback=True), capture_output=True, text=True,
                          timeout=240, cwd=workdir, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_identical(reference[0], workdir / "runs" / "two-nodes")
    # One run directory for both nodes: the shared filesystem is detected and the run behaves as one
    # machine (this was test_multinode's shared-directory run, a second two-node run of its own).
    run_dir = workdir / "runs" / "two-nodes"
    assert "a shared filesystem was detected" in proc.stdout, proc.stdout[-2000:]
    assert json.loads((run_dir / "manifest.json").read_text())["params"]["checkpoint_storage"] == "shared"
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    assert json.loads((newest / "COMMITTED").read_text())["storage"] == "shared"
    assert {"model.safetensors", "optimizer.safetensors", "rng-rank0.json", "rng-rank1.json"} <= {
        p.name for p in newest.iterdir()}  # every rank's part in the one directory


def test_damaged_newest_checkpoint_falls_back_and_still_ends_bit_identical(workdir, reference):
    import shutil
    run_dir = workdir / "runs" / "damaged"
    shutil.copytree(reference[0], run_dir)
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    blob = bytearray((newest / "model.safetensors").read_bytes())
    blob[-5] ^= 0x40  # one flipped bit in the weights
    (newest / "model.safetensors").write_bytes(bytes(blob))
    previous = sorted((run_dir / "checkpoints").glob("step-*"))[-2]
    config = make_config(workdir, name="damaged", data={"num_workers": 1})
    proc = _train(config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"warning: checkpoint {newest} skipped: model.safetensors fails its sha256 check "
            "(damaged or changed after saving)") in proc.stdout
    assert f"resumed from {previous}" in proc.stdout
    _assert_identical(reference[0], run_dir)


def test_options_zero_accumulation_activation_checkpointing_resume_exactly(workdir):
    """ZeRO-sharded SGD (per-rank optimizer files), grad accumulation, activation checkpointing,
    a frozen first block, bf16 autocast, seeded augmentation, and DDP buckets of 0.01 MiB (several
    instead of one) whose gradients are bucket views: killed and resumed equals uninterrupted."""
    options = dict(augment={"enabled": True, "crop_scale": [0.5, 1.0]},
                   distributed={"bucket_cap_mb": 0.01, "gradient_as_bucket_view": True},
                   model={"activation_checkpointing": True, "frozen_prefixes": ["0."]},
                   optimizer={"name": "sgd", "lr": 0.05, "zero_redundancy": True},
                   train={"epochs": 2, "grad_accum": 2, "precision": "bf16"},
                   checkpoint={"every_steps": 3, "keep_last": 1, "keep_best": 0})
    plain = make_config(workdir, name="options", **options)
    killed = make_config(workdir, name="options-killed", **options)
    step = seeded_choice([4, 5, 7])  # 4 steps per epoch: mid-epoch, off the checkpoint steps
    first = _train(plain)
    second = _train(killed, "--max-restarts", "1", fault=f"step:{step}:0")
    assert first.returncode == 0 and second.returncode == 0, (first.stderr[-2000:], second.stderr[-2000:])
    assert "exitcode: -9" in second.stderr and "resumed from" in second.stdout
    for name in ("options", "options-killed"):
        ckpt = sorted((workdir / "runs" / name / "checkpoints").glob("step-*"))[-1]
        assert {p.name for p in ckpt.glob("optimizer-rank*.safetensors")} == {
            "optimizer-rank0.safetensors", "optimizer-rank1.safetensors"}
    final = [load_file(workdir / "runs" / n / "model" / "model.safetensors") for n in ("options", "options-killed")]
    for key in final[0]:
        assert torch.equal(final[0][key], final[1][key]), f"{key} differs"
    opt = [load_file(sorted((workdir / "runs" / n / "checkpoints").glob("step-*"))[-1] / f"optimizer-rank{r}.safetensors")
           for n in ("options", "options-killed") for r in (0, 1)]
    for a, b in ((opt[0], opt[2]), (opt[1], opt[3])):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_refuses_to_mix_runs(workdir, reference):
    """A changed learning rate cannot continue the reference's checkpoints; nor can --resume none."""
    import shutil
    run_dir = workdir / "runs" / "changed"
    shutil.copytree(reference[0], run_dir)
    changed = make_config(workdir, name="changed", optimizer={"lr": 0.01})
    proc = _train(changed, offline=False)
    assert proc.returncode != 0
    assert f"appliance train: error: {changed}: differs from the config that made " in proc.stderr
    same = make_config(workdir, name="changed")
    proc = _train(same, "--resume", "none", offline=False)
    assert proc.returncode != 0
    assert "already holds checkpoints of an earlier run; use --resume auto to continue it" in proc.stderr


def test_label_outside_the_classes_is_one_clear_line(workdir):
    config = make_config(workdir, name="two-classes", data={"classes": ["left", "right"], "num_workers": 1})
    proc = _train(config, offline=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("appliance train: error: ")]
    assert errors and "/data/train-" in errors[0] and ": label 2 is outside 0..1 (the config has 2 classes)" in errors[0]
    # The worker's line is the one line: no second "training failed", no torchrun stack.
    assert len(errors) == 1 and "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr
    assert "internal error" not in proc.stderr


def test_a_run_whose_every_checkpoint_is_set_aside_is_not_started_over(workdir, reference):
    import shutil

    run_dir, _ = reference
    config = make_config(workdir, name="all-damaged", data={"num_workers": 1})
    damaged = workdir / "runs" / "all-damaged"
    shutil.copytree(run_dir / "checkpoints", damaged / "checkpoints")
    steps = sorted(p.name for p in (damaged / "checkpoints").glob("step-*"))
    assert steps
    for name in steps:  # every checkpoint's weights damaged: none verifies
        weights = damaged / "checkpoints" / name / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-64])
    proc = _train(config, "--resume", "auto")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "no checkpoint verifies" in proc.stderr and "refusing to start over on top of them" in proc.stderr
    assert "Traceback" not in proc.stderr
    left = sorted(p.name for p in (damaged / "checkpoints").iterdir())
    assert not [n for n in left if n.startswith("step-")], left  # nothing trained or saved over them
    assert len([n for n in left if n.startswith("damaged-step-")]) == len(steps), left  # all kept, set aside


def test_the_per_node_lock_refuses_a_second_start_of_the_same_node(workdir):
    from appliance.core.dirlock import directory_lock

    config = make_config(workdir, name="node-locked", data={"num_workers": 1})
    run_dir = workdir / "runs" / "node-locked"
    with directory_lock(run_dir, "run directory", ".lock-node0"):  # node 0 of this run is running
        proc = subprocess.run(appliance_cmd("train", str(config), "--nproc-per-node", "1", "--nnodes", "2",
                                            "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29431"),
                              capture_output=True, text=True, cwd=config.parent, timeout=120)
    assert proc.returncode != 0 and "in use by another run" in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
