"""appliance compile --tune N --rpc HOST:PORT: candidates timed by a real TVM RPC server (`python -m
tvm.exec.rpc_server`, started here on loopback), and an address nobody serves refused in one line."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

from conftest import ROOT, appliance_cmd, run_appliance

TRIALS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def rpc_server(log_path, env=None, python=sys.executable, start_timeout=120):
    """TVM's RPC server on 127.0.0.1:PORT, as a device runs it; yields 'HOST:PORT'."""
    port = free_port()
    with open(log_path, "w") as log:  # its own process group: the server forks a worker per session
        proc = subprocess.Popen([str(python), "-s", "-m", "tvm.exec.rpc_server", "--host", "127.0.0.1",
                                 "--port", str(port), "--port-end", str(port + 1)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout
        while f"bind to 127.0.0.1:{port}" not in log_path.read_text():
            assert proc.poll() is None, f"RPC server exited: {log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"RPC server did not start: {log_path.read_text()[-2000:]}"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_tuning_over_rpc_times_candidates_on_the_server(tmp_path, exported, val_npz):
    model = exported / "model.onnx"
    log = tmp_path / "rpc-server.log"
    with rpc_server(log) as address:
        proc = run_appliance("compile", str(model), "--target", "x86_64", "--out", str(tmp_path / "tuned"),
                             "--tune", str(TRIALS), "--rpc", address, "--samples", str(val_npz))
    assert proc.returncode == 0, proc.stderr
    assert f"on the device at {address} over RPC" in proc.stdout and "tuning: tasks done" in proc.stdout
    db = tmp_path / "tuned" / "tuning"
    header = json.loads((db / "tuning.json").read_text())
    assert header["measured_on"]["rpc"] == address and "over RPC" in header["search"]
    records = (db / "database_tuning_record.json").read_text().splitlines()
    assert len(records) == header["records"] >= header["tasks"] > 0
    # Every record's timings came from the server: it loaded at least one uploaded kernel per record.
    loads = re.findall(r"load_module \S+kernel\.so", log.read_text())
    assert header["measured_on"]["candidates_timed"] == len(loads) >= len(records)
    info = json.loads((tmp_path / "tuned" / "compile.json").read_text())
    assert info["tuned_tasks"] == header["tasks"] and info["tuning"]["measured_on"]["rpc"] == address
    assert info["check"]["passed"] and info["check"]["max_abs_diff"] <= 1e-4 and info["check"]["top1_agreement"] == 1.0


def arm_python(tmp_path) -> tuple[Path, dict]:
    """An aarch64 CPython 3.11 with the edge wheels (TVM runtime only), run by qemu-aarch64, as a program
    this host can exec: the RPC server starts its worker with sys.executable, and there is no binfmt
    handler here for aarch64 ELF files, so sys.executable is a script that runs qemu."""
    from appliance.deploy.edge.sysroot import build_python_sysroot
    from appliance.deploy.edge.qemu import find_qemu

    wheels = tmp_path / "edge" / "wheels"
    wheels.mkdir(parents=True)
    for wheel in (ROOT / "wheelhouse" / "edge-aarch64").glob("*.whl"):
        (wheels / wheel.name).symlink_to(wheel)
    sysroot, site = build_python_sysroot(ROOT / "wheelhouse" / "edge-sysroot-arm64", tmp_path / "edge",
                                         tmp_path / "arm")
    # TVM's RPC server pickles its worker's start function with cloudpickle: the edge lock's wheel.
    (cloudpickle,) = (ROOT / "wheelhouse" / "edge-aarch64").glob("cloudpickle-*.whl")
    zipfile.ZipFile(cloudpickle).extractall(site)
    python = tmp_path / "python-aarch64"
    python.write_text(f"#!/bin/sh\nexec {find_qemu()} -L {sysroot} -0 {python} {sysroot}/usr/bin/python3.11 \"$@\"\n")
    python.chmod(0o755)
    env = {**os.environ, "PYTHONHOME": f"{sysroot}/usr", "PYTHONPATH": str(site), "TVM_USE_RUNTIME_LIB": "1"}
    return python, env


def test_tuning_aarch64_over_rpc_under_qemu(tmp_path, exported, val_npz):
    """The ARM route end to end on this host: the aarch64 TVM wheel's RPC server under qemu-aarch64 times
    cross-compiled candidates. Emulated timings say nothing about a real device (the ranking is
    meaningless); what is checked is that the records come from there and the tuned build runs there."""
    import numpy as np

    from appliance.deploy.onnx_model import ort_session, run_ort

    python, env = arm_python(tmp_path)
    model = exported / "model.onnx"
    log = tmp_path / "rpc-server.log"
    with rpc_server(log, env=env, python=python, start_timeout=300) as address:
        proc = run_appliance("compile", str(model), "--target", "aarch64", "--out", str(tmp_path / "arm"),
                             "--tune", str(TRIALS), "--rpc", address)
    assert proc.returncode == 0, proc.stderr
    header = json.loads((tmp_path / "arm" / "tuning" / "tuning.json").read_text())
    assert header["target"] == "aarch64" and header["measured_on"]["rpc"] == address
    loads = re.findall(r"load_module \S+kernel\.so", log.read_text())
    assert header["measured_on"]["candidates_timed"] == len(loads) >= header["records"] >= header["tasks"] > 0
    info = json.loads((tmp_path / "arm" / "compile.json").read_text())
    assert info["tuned_tasks"] == header["tasks"]

    # The tuned aarch64 library runs on the emulated device and agrees with onnxruntime here.
    x = np.load(val_npz)["x"][:1]
    np.save(tmp_path / "x.npy", x)
    run = ("import sys, numpy as np, tvm; from tvm.runtime.vm import VirtualMachine; "
           "vm = VirtualMachine(tvm.runtime.load_module(sys.argv[1]), tvm.cpu()); "
           "np.save(sys.argv[3], vm['main'](tvm.runtime.tensor(np.load(sys.argv[2]))).numpy())")
    done = subprocess.run([str(python), "-s", "-c", run, str(tmp_path / "arm" / "model.so"), str(tmp_path / "x.npy"),
                           str(tmp_path / "y.npy")], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = run_ort(ort_session(model, optimize=False), x)
    assert np.abs(np.load(tmp_path / "y.npy") - expected).max() <= 1e-4


def test_unreachable_rpc_server_is_one_line(tmp_path, exported):
    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    proc = run_appliance("compile", str(exported / "model.onnx"), "--target", "aarch64", "--out", str(tmp_path / "o"),
                         "--tune", "2", "--rpc", address)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"--rpc {address}: cannot reach a TVM RPC server" in proc.stderr
    assert "python3 -m tvm.exec.rpc_server --host 0.0.0.0 --port 9090" in proc.stderr
    # The plain socket's refusal, at once: TVM's own connect would retry for a minute and say something else
    # (a bound on seconds would flake on a loaded box; the reason proves which path answered).
    assert "(Connection refused)" in proc.stderr and not (tmp_path / "o" / "model.so").exists()
    proc = run_appliance("compile", str(exported / "model.onnx"), "--target", "aarch64", "--out", str(tmp_path / "o"),
                         "--rpc", address)
    assert proc.returncode != 0 and "add --tune N" in proc.stderr


def test_server_lost_mid_search_is_one_line_and_leaves_no_database(tmp_path, exported):
    log = tmp_path / "rpc-server.log"
    with rpc_server(log) as address:
        proc = subprocess.Popen(appliance_cmd("compile", str(exported / "model.onnx"), "--target", "x86_64",
                                              "--out", str(tmp_path / "o"), "--tune", "4", "--rpc", address),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for line in proc.stdout:  # the search has started on the server: take the server away
            if line.startswith("tuning: tasks done 1/"):
                break
    out, err = proc.communicate(timeout=600)
    # stderr also holds TVM's own C++ warnings printed during the search; ours is the one last line
    ours = [line for line in err.splitlines() if line.startswith("appliance compile:")]
    assert proc.returncode != 0 and ours == err.strip().splitlines()[-1:], err
    assert f"--rpc {address}: cannot reach a TVM RPC server" in ours[0]
    assert not (tmp_path / "o" / "tuning").exists() and not (tmp_path / "o" / "model.so").exists()
