"""Flags are range-checked when parsed; sizes print in units; the directory lock names its holder."""

import os
import subprocess
import sys

import pytest

from appliance.cli import build_parser
from appliance.core.dirlock import DirectoryInUse, directory_lock
from appliance.core.values import human_bytes


def _parse_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(list(argv))
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["quantize", "m.onnx", "--calib", "c", "--out", "o", "--max-drop", "nan"],
     "argument --max-drop: must be a finite number, got nan"),
    (["quantize", "m.onnx", "--calib", "c", "--out", "o", "--calib-samples", "-5"],
     "argument --calib-samples: must be at least 1, got -5"),
    (["compile", "m.onnx", "--target", "x86_64", "--out", "o", "--tolerance=-1e-3"],
     "argument --tolerance: must be at least 0, got -0.001"),
    (["edge", "verify", "p.tar", "--min-agreement", "nan"],
     "argument --min-agreement: must be a finite number, got nan"),
    (["edge", "verify", "p.tar", "--min-agreement", "1.5"], "argument --min-agreement: must be at most 1, got 1.5"),
    (["data", "check", "f", "--out", "o", "--max-pixels", "-1"], "argument --max-pixels: must be at least 1, got -1"),
    (["data", "check", "f", "--out", "o", "--jobs", "two"], "argument --jobs: must be an integer, got 'two'"),
    (["train", "t.toml", "--max-restarts", "-3"], "argument --max-restarts: must be at least 0, got -3"),
    (["data", "preview", "f", "--hue", "nan"], "argument --hue: must be a finite number, got nan"),
    (["data", "convert", "d", "--out", "o", "--shards", "0"], "argument --shards: must be at least 1, got 0"),
    (["export", "run", "--out", "o", "--max-rel-error", "inf"],
     "argument --max-rel-error: must be a finite number, got inf"),
])
def test_bad_numbers_in_flags_are_refused_when_parsed(capsys, argv, message):
    assert f"error: {message} (see appliance " in _parse_error(capsys, *argv)


def test_out_that_is_a_file_is_refused_naming_it(capsys, tmp_path):
    file = tmp_path / "report"
    file.write_text("x")
    line = _parse_error(capsys, "data", "check", "f", "--out", str(file))
    assert f"error: argument --out: {file} exists and is not a directory (see " in line


def test_sizes_are_printed_in_units():
    assert [human_bytes(n) for n in (0, 512, 1536, 6 * 2**20, 9.76 * 2**20, 3 * 2**40)] == [
        "0 B", "512 B", "1.5 KiB", "6 MiB", "9.76 MiB", "3 TiB"]


HOLD = """
import sys, time
from appliance.core.dirlock import directory_lock
with directory_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_lock_refuses_a_second_holder_naming_its_pid_and_is_freed_when_it_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "d")], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(DirectoryInUse) as err:
            with directory_lock(tmp_path / "d", "run directory"):
                pass
        assert str(err.value).startswith(f"{tmp_path / 'd'}: the run directory is in use by another run "
                                         f"(PID {holder.pid}, started 20")
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, the kernel drops the lock
        holder.wait()
    with directory_lock(tmp_path / "d") as lock:
        assert lock.path.read_text().startswith(f"pid {os.getpid()}\nstarted ")  # the killed holder's lines replaced
    assert list((tmp_path / "d").iterdir()) == []  # a finished holder leaves no trace
