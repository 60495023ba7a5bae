"""Two nodes without a shared filesystem: two torchrun agents over c10d on 127.0.0.1 (gloo, one CPU
process each, offline under `unshare -n`), each with its own run directory, ZeRO on. Checkpoints
commit only with every rank's part, resume is exact, and a node whose part is damaged makes both
fall back together."""

import json
import os
import shlex
import shutil
import socket
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import appliance_cmd, offline_cmd, seeded_choice
from train_data import make_config

STEPS_PER_EPOCH = 8  # 256 records, 2 processes, batch 16
TOTAL_STEPS = 16
OPTIONS = dict(optimizer={"zero_redundancy": True}, train={"epochs": 2},
               checkpoint={"every_steps": 5, "keep_last": 2, "keep_best": 1})


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_configs(workdir, name):
    """One config per node, differing only in [run] out_dir (a shared directory: test_resume.py's two nodes)."""
    base = make_config(workdir, name=name, **OPTIONS)
    text = base.read_text()
    assert 'out_dir = "runs"' in text
    configs = []
    for node in (0, 1):
        path = workdir / f"{name}-node{node}.toml"
        path.write_text(text.replace('out_dir = "runs"', f'out_dir = "node{node}"'))
        configs.append(path)
    return configs


def _two_nodes(workdir, configs, *args, fault="", timeout=300):
    port = _free_port()
    nodes = [appliance_cmd("train", str(configs[r]), "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(r),
                           "--rdzv-endpoint", f"127.0.0.1:{port}", *args) for r in (0, 1)]
    script = f"{shlex.join(nodes[0])} & n0=$!; {shlex.join(nodes[1])}; r1=$?; wait $n0; r0=$?; exit $((r0 | r1))"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "APPLIANCE_TEST_FAULT": fault}
    proc = subprocess.Popen(offline_cmd(["sh", "-c", script], loopback=True), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=workdir, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        pytest.fail(f"two-node run of {configs[0].name} did not finish in {timeout} s")
    return subprocess.CompletedProcess(script, proc.returncode, out, err)


def _run_dirs(workdir, name):
    return [workdir / f"node{n}" / name for n in (0, 1)]


def _final(run_dirs):
    """Final weights (every node writes rank 0's) and both ranks' optimizer shards."""
    models = [load_file(d / "model" / "model.safetensors") for d in run_dirs]
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0]), "the nodes' models differ"
    shards = {}
    for d in run_dirs:
        newest = sorted((d / "checkpoints").glob("step-*"))[-1]
        assert newest.name == f"step-{TOTAL_STEPS:08d}"
        for path in newest.glob("optimizer-rank*.safetensors"):
            shards[path.name] = load_file(path)
    assert sorted(shards) == ["optimizer-rank0.safetensors", "optimizer-rank1.safetensors"]
    return models[0], shards


def _assert_identical(dirs_a, dirs_b):
    (model_a, shards_a), (model_b, shards_b) = _final(dirs_a), _final(dirs_b)
    for a, b in [(model_a, model_b), *((shards_a[k], shards_b[k]) for k in shards_a)]:
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{key} differs"  # atol = 0


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("multinode")


@pytest.fixture(scope="module")
def reference(workdir):
    """An uninterrupted two-node run, each node with its own run directory."""
    proc = _two_nodes(workdir, _node_configs(workdir, "reference"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _run_dirs(workdir, "reference"), proc


def test_each_node_holds_its_own_part_and_every_node_lists_all(reference):
    run_dirs, proc = reference
    assert "no shared filesystem was detected" in proc.stdout, proc.stdout[-2000:]
    for d in run_dirs:  # each node has the trained model and a manifest saying how it stored checkpoints
        assert json.loads((d / "manifest.json").read_text())["params"]["checkpoint_storage"] == "per-node"
    newest = [sorted((d / "checkpoints").glob("step-*"))[-1] for d in run_dirs]
    sums = [(n / "SHA256SUMS").read_text() for n in newest]
    assert sums[0] == sums[1]  # the complete list, gathered from both ranks, on both nodes
    listed = {line.split("  ")[1] for line in sums[0].splitlines()}
    assert {"model.safetensors", "trainer.json", "rng-rank0.json", "rng-rank1.json",
            "optimizer-rank0.safetensors", "optimizer-rank1.safetensors"} <= listed
    held = [{p.name for p in n.iterdir()} - {"SHA256SUMS", "COMMITTED"} for n in newest]
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == listed  # each file on exactly one node
    for n, files in zip(newest, held):
        marker = json.loads((n / "COMMITTED").read_text())
        assert marker["storage"] == "per-node" and set(marker["here"]) == files
    assert not [p for d in run_dirs for p in (d / "checkpoints").iterdir() if p.name.startswith(".")]


def test_killed_node_resumes_bit_identical(workdir, reference):
    # Off the checkpoint steps (every 5, epoch end 8): the work since the last one is redone.
    step = seeded_choice([s for s in range(6, TOTAL_STEPS - 1) if s % STEPS_PER_EPOCH and s % 5])
    proc = _two_nodes(workdir, _node_configs(workdir, "killed"), "--max-restarts", "1", fault=f"step:{step}:1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr, f"step {step}: no SIGKILL happened\n{proc.stderr[-3000:]}"
    resumed_from = max(s for s in range(1, step + 1) if s % 5 == 0 or s % STEPS_PER_EPOCH == 0)
    assert f"step-{resumed_from:08d} (step {resumed_from}" in proc.stdout, (step, proc.stdout[-2000:])
    _assert_identical(reference[0], _run_dirs(workdir, "killed"))


def test_the_nodes_left_continue_when_one_node_is_killed_and_comes_back(workdir, reference):
    """benchmarks/node_failure.py's real kill as a test: with --nnodes 1:2 --max-restarts 3, node 1's
    whole process tree (launcher, agent, worker) gets SIGKILL after the first committed checkpoint, as a
    machine losing power would, and is started again with the same command; node 0 keeps its own
    launcher, re-rendezvouses, both finish with exit 0, bit-identical to the uninterrupted run."""
    configs, dirs, port = _node_configs(workdir, "node-lost"), _run_dirs(workdir, "node-lost"), _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def start(node):
        cmd = appliance_cmd("train", str(configs[node]), "--nproc-per-node", "1", "--nnodes", "1:2", "--node-rank",
                            str(node), "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "3")
        return subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    nodes = [start(0), start(1)]
    try:
        committed = [d / "checkpoints" / "step-00000005" / "COMMITTED" for d in dirs]
        deadline = time.time() + 120
        while not all(c.is_file() for c in committed):
            assert time.time() < deadline and all(p.poll() is None for p in nodes), "no checkpoint at step 5"
            time.sleep(0.02)
        os.killpg(nodes[1].pid, signal.SIGKILL)  # its worker follows (PR_SET_PDEATHSIG)
        killed_log = nodes[1].communicate()[0]
        assert nodes[1].returncode == -signal.SIGKILL and "trained 16 steps" not in killed_log
        nodes[1] = start(1)
        logs = [p.communicate(timeout=240)[0] for p in nodes]
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(log[-2000:] for log in logs)
    assert "resumed from " in "".join(logs), logs[0][-2000:]
    _assert_identical(reference[0], dirs)


def test_damaged_part_on_one_node_makes_both_fall_back_together(workdir, reference):
    for src, dst in zip(reference[0], _run_dirs(workdir, "damaged")):
        shutil.copytree(src, dst)
    dirs = _run_dirs(workdir, "damaged")
    # The node without global rank 0: its part is only its own rank's files.
    holder = next(d for d in dirs if (sorted((d / "checkpoints").glob("step-*"))[-1] / "model.safetensors").exists())
    other = next(d for d in dirs if d is not holder)
    newest = sorted((other / "checkpoints").glob("step-*"))[-1]
    previous = sorted((holder / "checkpoints").glob("step-*"))[-2]
    shard = next(newest.glob("optimizer-rank*.safetensors"))
    blob = bytearray(shard.read_bytes())
    blob[-5] ^= 0x40  # one flipped bit in this node's optimizer shard
    shard.write_bytes(bytes(blob))
    proc = _two_nodes(workdir, _node_configs(workdir, "damaged"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"warning: checkpoint {newest} skipped: {shard.name} fails its sha256 check "
            "(damaged or changed after saving)") in proc.stdout, proc.stdout[-3000:]
    # The node whose part was good sets its newer step aside too: no node runs ahead of the other.
    assert "is not held by every node" in proc.stdout
    # Rank 0 says it (the new agents' ranks follow their process ids, so it may run on either node).
    assert "resumed from " in proc.stdout and f"/{previous.name} (step " in proc.stdout, proc.stdout[-3000:]
    assert (other / "checkpoints" / f"damaged-{newest.name}").is_dir()
    assert (holder / "checkpoints" / f"partial-{newest.name}").is_dir()
    _assert_identical(reference[0], dirs)


def test_nnodes_min_max_reaches_torchrun_as_an_elastic_range(tmp_path):
    config = make_config(tmp_path, name="elastic")
    proc = subprocess.run(appliance_cmd("train", str(config), "--dry-run", "--nnodes", "1:2", "--max-restarts", "3",
                                        "--rdzv-endpoint", "10.0.0.5:29400"), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    assert words[words.index("--nnodes") + 1] == "1:2" and words[words.index("--max-restarts") + 1] == "3"
    bad = subprocess.run(appliance_cmd("train", str(config), "--dry-run", "--nnodes", "2:1"), capture_output=True, text=True)
    assert bad.returncode != 0 and "--nnodes: must be N or MIN:MAX with 1 <= MIN <= MAX, got '2:1'" in bad.stderr
