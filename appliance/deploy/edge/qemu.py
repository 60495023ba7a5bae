"""Running an edge package's aarch64 programs on this x86 host, under qemu-aarch64 (user mode).

Shared by `edge verify` (native runner, self-test, bench) and the arm64 Python sysroot
(`edge_sysroot.py`), so neither imports the other.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from appliance.core.errors import DataError, EnvironmentProblem

DEFAULT_SYSROOT = "/usr/aarch64-linux-gnu"


def find_qemu() -> str:
    qemu = shutil.which("qemu-aarch64")
    if qemu is None:
        raise EnvironmentProblem("qemu-aarch64: not found on PATH (install Debian's qemu-user, "
                                 "e.g. `installer/bootstrap.sh --system`)")
    return qemu


def check_sysroot(sysroot) -> str:
    if not Path(sysroot, "lib", "ld-linux-aarch64.so.1").exists():
        raise EnvironmentProblem(f"{sysroot}: no aarch64 libc here (install libc6-arm64-cross or pass --sysroot)")
    return str(sysroot)


def run_counting_samples(cmd: list[str], total: int, desc: str, env=None) -> tuple[int, str]:
    """Run a runner that prints one JSON line per sample, with a progress bar (emulated ResNets
    take tens of seconds per sample). Returns (exit status, stderr)."""
    from tqdm import tqdm

    with tempfile.TemporaryFile("w+") as err, tqdm(total=total, desc=f"{desc} under qemu", unit="sample",
                                                    disable=None) as bar:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        for line in proc.stdout:
            if line.startswith('{"sample"'):
                bar.update(1)
        proc.wait()
        err.seek(0)
        return proc.returncode, err.read()


def run_json(cmd: list[str], what: str, ok_codes=(0, 1), timeout: float = 3600, env=None) -> tuple[int, dict]:
    """(exit status, the JSON object a `bin/run ... --json` printed); one line naming `what` otherwise."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise DataError(f"{what}: ran past {timeout:.0f} s under qemu") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode not in ok_codes or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise DataError(f"{what}: failed under qemu (exit {done.returncode}): {tail}")
    try:
        return done.returncode, json.loads(lines[-1])
    except json.JSONDecodeError:
        raise DataError(f"{what}: printed no JSON object under qemu ({lines[-1][:80]!r})") from None
