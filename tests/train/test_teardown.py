"""A finished run ends as finished (issue 31, item 5): short real 2-process CPU torchrun runs,
repeated under load, end with exit 0 every time; each worker leaves with its process group
destroyed, its DataLoader workers and Python threads joined; a worker that dies after the final
model and manifest are committed is named, and the run still counts as finished."""

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import appliance_cmd
from train_data import make_config

ROUNDS = 5  # two runs at a time (each the other's load on a 2-core box): 10 runs, ~60 s
STEPS = 2


def _config(workdir, name):
    # The smallest run the train tests use: 8x8 images, 2 steps, persistent loader workers (the
    # processes and threads a success has to join), no checkpoint but the final one.
    return make_config(workdir, name=name, train_records=64, val_records=8,
                       train={"epochs": 1, "max_steps": STEPS}, data={"num_workers": 1},
                       checkpoint={"every_steps": 100})


def _start(config, teardown_dir, fault=""):
    env = {**os.environ, "APPLIANCE_TEST_FAULT": fault, "APPLIANCE_TEST_TEARDOWN": str(teardown_dir),
           "OMP_NUM_THREADS": "1", "APPLIANCE_TEST_LATE_HANG_S": "10"}
    return subprocess.Popen(appliance_cmd("train", str(config), "--nproc-per-node", "2"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=config.parent, start_new_session=True)


def _dump_stacks(teardown_dir) -> list[int]:
    """SIGUSR1 to the run's workers and their loader workers (APPLIANCE_TEST_TEARDOWN set: each prints
    its threads' Python stacks on stderr, faulthandler), so a run that does not end says where it waits."""
    signalled = []
    for entry in os.listdir("/proc"):
        try:
            environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0") if entry.isdigit() else []
        except OSError:
            continue
        if f"APPLIANCE_TEST_TEARDOWN={teardown_dir}".encode() in environ and any(e.startswith(b"RANK=") for e in environ):
            try:
                os.kill(int(entry), signal.SIGUSR1)
                signalled.append(int(entry))
            except OSError:
                pass
    time.sleep(3)
    return signalled


def _finish(proc, timeout=120, teardown_dir=None):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        signalled = _dump_stacks(teardown_dir) if teardown_dir is not None else []
        # torchrun's workers live in their own process groups: a hung one outlives the launcher's
        # group and holds our pipes, so every process of this run (its config on the command line) goes.
        os.killpg(proc.pid, signal.SIGKILL)
        config = proc.args[proc.args.index("train") + 1]
        subprocess.run(["pkill", "-9", "-f", config], check=False)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        return None, out, f"did not finish in {timeout} s; stacks of {signalled} (SIGUSR1):\n{err[-8000:]}"
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("teardown")


def _abnormal(status, err) -> bool:
    return (status != 0 or "warning: the run finished" in err or "SIGABRT" in err or "Traceback" in err
            or "Exception ignored" in err)


def test_repeated_short_runs_all_end_as_finished_with_an_orderly_teardown(workdir):
    abnormal, teardowns = [], []
    for round_ in range(ROUNDS):
        procs = []
        for i in range(2):
            name = f"r{round_}-{i}"
            state = workdir / f"{name}-teardown"
            state.mkdir()
            procs.append((name, state, _start(_config(workdir, name), state)))
        for name, state, proc in procs:
            status, _, err = _finish(proc, teardown_dir=state)
            if _abnormal(status, err):
                abnormal.append(f"{name}: exit {status}: {err[-8000:] if status is None else err[-1500:]}")
            teardowns += [(name, json.loads(p.read_text())) for p in sorted(state.glob("rank-*.json"))]
    print(f"teardown: {2 * ROUNDS} runs, {len(abnormal)} abnormal exits")
    assert not abnormal, "\n".join(abnormal)
    assert len(teardowns) == 2 * 2 * ROUNDS  # both ranks of every run reached the end of main()
    for name, state in teardowns:
        # the loaders' workers (1 each, training and validation) were forked while the rank had one thread
        assert state == {"process_group": False, "threads": [], "children": [], "threads_at_fork": [1, 1]}, (name, state)


def test_a_worker_dying_after_the_commit_is_named_and_the_run_counts_as_finished(workdir):
    """A real late crash: rank 1 SIGABRTs itself after the model, the manifest and the finished
    mark are committed (the SIGABRT a C++ destructor raised at interpreter teardown)."""
    config = _config(workdir, "late")
    run_dir = workdir / "runs" / "late"
    state = workdir / "late-teardown"
    state.mkdir()
    status, out, err = _finish(_start(config, state, fault=f"finished:{STEPS}:1"))
    assert status == 0, err[-3000:]
    assert (f"appliance train: warning: the run finished (model and manifest committed), then a worker was killed "
            f"by SIGABRT while shutting down; the results in {run_dir} are complete") in err.splitlines(), err[-3000:]
    assert "quality gate passed" in out
    assert (run_dir / "model").is_dir() and json.loads((run_dir / "manifest.json").read_text())
    assert [p.name for p in state.iterdir()] == ["rank-0.json"]  # rank 1 died before leaving


def test_a_worker_hanging_after_the_commit_is_killed_named_and_the_run_counts_as_finished(workdir):
    """A real late hang: rank 1 never leaves after the model, the manifest and the finished mark are
    committed (the hang issue 31 saw). The launcher gives the run's processes the late-hang time to
    leave, then kills every one of them and names the one that hung; nothing of the run outlives it."""
    config = _config(workdir, "hang")
    run_dir = workdir / "runs" / "hang"
    state = workdir / "hang-teardown"
    state.mkdir()
    proc = _start(config, state, fault=f"finished-hang:{STEPS}:1")
    status, out, err = _finish(proc, timeout=300)
    assert status == 0, err[-3000:]
    warnings = [line for line in err.splitlines() if line.startswith("appliance train: warning:")]
    assert len(warnings) == 1, err[-3000:]
    prefix = "appliance train: warning: the run finished (model and manifest committed), then rank 1 (pid "
    assert warnings[0].startswith(prefix), warnings
    assert warnings[0].endswith(f") hung while shutting down and was killed; the results in {run_dir} are complete")
    pid = int(warnings[0][len(prefix):].split(")", 1)[0])
    assert not os.path.exists(f"/proc/{pid}"), "the hung worker outlived the launcher"
    assert "quality gate passed" in out
    assert (run_dir / "model").is_dir() and json.loads((run_dir / "manifest.json").read_text())
    assert [p.name for p in state.iterdir()] == ["rank-0.json"]  # rank 1 never left


def test_a_worker_under_the_teardown_hook_prints_its_stacks_on_sigusr1(tmp_path):
    """What _dump_stacks relies on when a repeated run does not end: the worker (and a fork of it, as a
    loader worker is) prints every thread's stack on SIGUSR1 and carries on."""
    import sys

    code = ("import os, signal, sys\n"
            "from appliance.train import faults\n"
            "faults.stacks_on_sigusr1()\n"
            "pid = os.fork()\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "print('child alive' if pid == 0 else 'parent alive', flush=True)\n"
            "os._exit(0) if pid == 0 else os.waitpid(pid, 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "APPLIANCE_TEST_TEARDOWN": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split("\n")[:2]) == ["child alive", "parent alive"]
    assert proc.stderr.count("most recent call first") >= 2, proc.stderr
