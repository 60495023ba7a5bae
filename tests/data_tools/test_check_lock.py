"""Two `appliance data check` runs on one --out: the second refuses with one line naming the first."""

import os
import signal
import subprocess
import time

import sys
from pathlib import Path

from conftest import appliance_cmd
from data_tools.tfrecord import write_records

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_data import image_records  # noqa: E402


def test_second_check_on_one_out_directory_refuses_with_one_line(tmp_path):
    # The first check is stopped (SIGSTOP) as soon as it holds its --out, with thousands of records left
    # to decode: it holds the directory for as long as we like. (A named pipe as its input did that
    # once; the check now refuses a pipe at once.)
    data = tmp_path / "many.tfrecord"
    write_records(data, image_records(4000, seed=1))
    out = tmp_path / "out"
    first = subprocess.Popen(appliance_cmd("data", "check", str(data), "--out", str(out), "--no-progress"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lock = out / ".lock"
        deadline = time.time() + 60
        while time.time() < deadline and not (lock.exists() and lock.read_text().startswith("pid ")):
            time.sleep(0.01)
        os.killpg(first.pid, signal.SIGSTOP)
        assert first.poll() is None, "the first check ended before it could be stopped"
        second = subprocess.run(appliance_cmd("data", "check", str(data), "--out", str(out), "--no-progress"),
                                capture_output=True, text=True, timeout=60)
        holder = lock.read_text().splitlines()
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    assert holder[0] == f"pid {first.pid}"
    assert second.returncode == 75
    assert second.stderr == (f"appliance data check: error: {out}: the --out directory is in use by another run "
                             f"(PID {first.pid}, started {holder[1].split(' ', 1)[1]}); wait for it to finish or "
                             "use another directory\n")
    # Once the first is gone (killed: the kernel dropped its lock) the directory is usable again.
    (tmp_path / "empty.tfrecord").write_bytes(b"")
    third = subprocess.run(appliance_cmd("data", "check", str(tmp_path / "empty.tfrecord"), "--out", str(out),
                                         "--no-progress"), capture_output=True, text=True, timeout=120)
    assert "in use by another run" not in third.stderr and (out / "report.json").is_file(), third.stderr
