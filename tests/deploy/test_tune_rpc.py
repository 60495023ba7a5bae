"""appliance compile --tune N --rpc HOST:PORT: candidates timed by a real TVM RPC server (`python -m
tvm.exec.rpc_server`, started here on loopback), and an address nobody serves refused in one line."""

import json
import re
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

from conftest import run_appliance

TRIALS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def rpc_server(log_path, env=None, command=None):
    """TVM's RPC server on 127.0.0.1:PORT, as a device runs it; yields 'HOST:PORT'."""
    port = free_port()
    command = command or [sys.executable, "-m", "tvm.exec.rpc_server"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port), "--port-end", str(port + 1)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while f"bind to 127.0.0.1:{port}" not in log_path.read_text():
            assert proc.poll() is None, f"RPC server exited: {log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"RPC server did not start: {log_path.read_text()[-2000:]}"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
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


def test_unreachable_rpc_server_is_one_line(tmp_path, exported):
    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    start = time.monotonic()
    proc = run_appliance("compile", str(exported / "model.onnx"), "--target", "aarch64", "--out", str(tmp_path / "o"),
                         "--tune", "2", "--rpc", address)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"--rpc {address}: cannot reach a TVM RPC server" in proc.stderr
    assert "python3 -m tvm.exec.rpc_server --host 0.0.0.0 --port 9090" in proc.stderr
    assert time.monotonic() - start < 120 and not (tmp_path / "o" / "model.so").exists()
    proc = run_appliance("compile", str(exported / "model.onnx"), "--target", "aarch64", "--out", str(tmp_path / "o"),
                         "--rpc", address)
    assert proc.returncode != 0 and "add --tune N" in proc.stderr
