"""`appliance edge verify` of an x86_64-openvino server package, on this host: the package's own
python/run.py (OpenVINO, the wheel of this environment) on the samples, its `--selftest` (golden
samples, gated) and `--bench` under the LATENCY and THROUGHPUT hints (measured here, reported, never
gated). verify.py compares the runner's outputs with onnxruntime's as it does an edge runner's."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from appliance.core.errors import DataError
from appliance.deploy.openvino_route import RUNTIME, require_openvino

RUNNER = "OpenVINO runner (python/run.py, this host)"
TIMEOUT_S = 1800


def is_server_package(info: dict) -> bool:
    return info.get("runtime") == RUNTIME


def _run(root: Path, args: list[str], what: str, ok_codes=(0,)) -> subprocess.CompletedProcess:
    """python/run.py ARGS with this environment's Python (and so its openvino wheel)."""
    require_openvino(what)
    try:
        done = subprocess.run([sys.executable, str(root / "python" / "run.py"), *args], capture_output=True,
                              text=True, timeout=TIMEOUT_S, cwd=root)
    except subprocess.TimeoutExpired:
        raise DataError(f"{what}: ran past {TIMEOUT_S} s") from None
    if done.returncode not in ok_codes:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise DataError(f"{what}: failed (exit {done.returncode}): {tail}")
    return done


def _json(done: subprocess.CompletedProcess, what: str) -> dict:
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise DataError(f"{what}: printed no JSON object ({(lines or [''])[-1][:80]!r})") from None


def run_server_runner(root: Path, x: np.ndarray) -> tuple[np.ndarray, float]:
    """The runner's outputs for the whole batch in one process (a segmentation model's class maps go
    to verify-masks/, as the edge runner's do)."""
    np.save(root / "verify-input.npy", x)
    start = time.perf_counter()
    _run(root, ["--input", str(root / "verify-input.npy"), "--output", str(root / "verify-output.npy"),
                "--top-k", "1", "--masks", str(root / "verify-masks")], f"{root / 'python' / 'run.py'}")
    return np.load(root / "verify-output.npy"), time.perf_counter() - start


def selftest_and_bench(root: Path, bench_runs: int) -> tuple[dict, dict | None]:
    """`run.py --selftest --json` (exit 3 is a failed self-test, reported) and, unless bench_runs is 0,
    `run.py --bench` under both hints."""
    what = f"{root / 'python' / 'run.py'} --selftest"
    selftest = _json(_run(root, ["--selftest", "--json"], what, ok_codes=(0, 3)), what)
    if bench_runs <= 0:
        return selftest, None
    bench = {}
    for hint in ("LATENCY", "THROUGHPUT"):
        what = f"{root / 'python' / 'run.py'} --bench --hint {hint}"
        bench[hint] = _json(_run(root, ["--bench", "--json", "--hint", hint, "--runs", str(bench_runs)], what), what)
    return selftest, {**bench["LATENCY"], "hints": bench, "emulated": False, "gated": False,
                      "note": "measured on this host with its openvino wheel; a server's own run.py --bench says more"}
