"""CLI behaviour every verb shares: help, version, one-line errors."""

import subprocess
import sys

from appliance import __version__, cli
from appliance.core.errors import DataError
from conftest import run_appliance


def test_help_lists_only_working_verbs():
    proc = run_appliance("--help")
    assert proc.returncode == 0
    assert "doctor" in proc.stdout


def test_python_dash_m_works():
    proc = subprocess.run([sys.executable, "-m", "appliance", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"appliance {__version__}"


def test_unknown_verb_is_rejected():
    proc = run_appliance("frobnicate")
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def test_appliance_error_is_one_line_without_traceback(capsys, monkeypatch):
    # The CLI's error handling is what is tested: a verb that raises our error type.
    def failing(args):
        raise DataError("data/x.tfrecord: offset 16: bad length crc")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["doctor"].set_defaults(func=failing)
    assert cli.main(["doctor"]) == 2
    err = capsys.readouterr().err
    assert err == "appliance doctor: error: data/x.tfrecord: offset 16: bad length crc\n"
    assert cli.main(["doctor", "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_help_imports_no_heavy_dependency():
    # `appliance --help` must work in a minimal install (the bundle self-test) and stay fast:
    # verb modules import numpy, torch, onnx and tvm inside the functions that use them.
    code = ("import sys; from appliance.cli import build_parser; build_parser().format_help(); "
            "heavy = sorted(m for m in ('numpy', 'torch', 'onnx', 'onnxruntime', 'tvm', 'PIL') if m in sys.modules); "
            "print(','.join(heavy))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
