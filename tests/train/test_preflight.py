"""Network choices (--iface, [distributed] env) and `appliance train --preflight` across two nodes on loopback."""

import shlex
import socket
import subprocess

from safetensors.torch import load_file

from conftest import appliance_cmd, run_appliance
from train_data import make_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dry_run_words(*args) -> tuple[dict, list[str]]:
    proc = run_appliance("train", *args, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    env = dict(w.split("=", 1) for w in words if "=" in w and w.split("=")[0].isupper())
    return env, words[len(env):]


def test_iface_sets_the_interface_for_torchrun_nccl_and_gloo(tmp_path):
    config = make_config(tmp_path, train_records=8, val_records=3,
                         distributed={"env": {"NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}})
    default_env, default_cmd = dry_run_words(str(config))
    env, cmd = dry_run_words(str(config), "--iface", "lo")
    assert cmd == default_cmd  # loopback's address is what the one-node default binds
    assert env["NCCL_SOCKET_IFNAME"] == "lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["NCCL_IB_DISABLE"] == "1" == default_env["NCCL_IB_DISABLE"] and env["NCCL_DEBUG"] == "WARN"
    env, cmd = dry_run_words(str(config), "--iface", "lo", "--nnodes", "2", "--rdzv-endpoint", "10.0.0.5:29400")
    assert cmd[cmd.index("--local-addr") + 1] == "127.0.0.1"  # the interface's address, not the hostname's


def test_an_unknown_interface_is_one_line(tmp_path):
    proc = run_appliance("train", str(make_config(tmp_path, train_records=8, val_records=3)), "--iface", "eth9",
                         "--dry-run")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "network interface 'eth9' does not exist on this node (it has lo" in proc.stderr


def test_training_over_iface_lo_equals_the_default(tmp_path):
    runs = []
    for name, extra in (("plain", []), ("iface", ["--iface", "lo"])):
        config = make_config(tmp_path, name=name, train_records=32, val_records=3, train={"max_steps": 3})
        proc = run_appliance("train", str(config), "--nproc-per-node", "2", "--quiet", *extra, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(load_file(tmp_path / "runs" / name / "model" / "model.safetensors"))
    assert runs[0].keys() == runs[1].keys()
    assert all((runs[0][k] == runs[1][k]).all() for k in runs[0])


def preflight_pair(configs, port, timeout="60"):
    procs = [subprocess.Popen(appliance_cmd("train", str(c), "--preflight", "--nnodes", "2", "--node-rank", str(r),
                                            "--rdzv-endpoint", f"127.0.0.1:{port}", "--preflight-timeout", timeout),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, c in enumerate(configs)]
    return [(p.wait(timeout=300), *p.communicate()) for p in procs]


def test_preflight_two_nodes_agree(tmp_path):
    config = make_config(tmp_path, train_records=8, val_records=3)
    for rank, (rc, out, err) in enumerate(preflight_pair([config, config], free_port())):
        assert rc == 0, err
        assert out.strip() == f"preflight: node {rank} of 2 ready ({config})"


def test_preflight_finds_a_config_that_differs_between_nodes(tmp_path):
    a = make_config(tmp_path, name="a", train_records=8, val_records=3)
    b = make_config(tmp_path, name="b", train_records=8, val_records=3, optimizer={"lr": 0.5})
    for rc, _, err in preflight_pair([a, b], free_port()):
        lines = err.strip().splitlines()
        assert rc == 1 and len(lines) == 1, err
        assert "node 1 (" in lines[0] and "training config (hash)" in lines[0] and "differs from node 0" in lines[0]


def test_preflight_finds_an_unreachable_endpoint(tmp_path):
    config = make_config(tmp_path, train_records=8, val_records=3)
    proc = run_appliance("train", str(config), "--preflight", "--nnodes", "2", "--node-rank", "1",
                         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--preflight-timeout", "1")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "unreachable from node 1 (Connection refused)" in lines[0]


def test_preflight_finds_too_little_disk(tmp_path):
    config = make_config(tmp_path, train_records=8, val_records=3, checkpoint={"min_free_gb": 1e6})
    proc = run_appliance("train", str(config), "--preflight")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "free under" in lines[0] and "the checkpoints need about" in lines[0] and "TiB" in lines[0]
