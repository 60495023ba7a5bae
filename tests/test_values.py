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


def _numbers_without_an_upper_bound(sections: dict, exempt=()) -> list[str]:
    """`[section] key` of every int or float config key (alone, or inside a tuple or dict) whose
    Range has no upper bound, or that has no Range at all."""
    import dataclasses
    import typing

    from appliance.core.values import Range

    def unbounded(hint) -> bool:
        if typing.get_origin(hint) is typing.Annotated:
            base, *meta = typing.get_args(hint)
            if base in (int, float):
                ranges = [m for m in meta if isinstance(m, Range)]
                return not any(r.le is not None or r.lt is not None for r in ranges)
            return unbounded(base)
        if hint in (int, float):
            return True
        return any(unbounded(arg) for arg in typing.get_args(hint) if arg is not Ellipsis)

    found = []
    for name, section in sections.items():
        for f in dataclasses.fields(section):
            hint = typing.get_type_hints(section, include_extras=True)[f.name]
            if f.name not in exempt and unbounded(hint):
                found.append(f"[{name}] {f.name}")
    return found


def test_every_numeric_config_key_has_an_upper_bound():
    """`max_steps = 2^63-1` ran, `[optimizer] lr` and `weight_decay` had no bound: every int and float key of
    the training and pipeline configs has a stated upper bound now, named in its refusal."""
    from appliance.pipeline.config import _STAGE_SECTIONS
    from appliance.train.config import _SECTION_TYPES
    from appliance.train.quality import GATE_KEYS  # bounded by quality.check_thresholds, named as the gate's

    assert _numbers_without_an_upper_bound(_SECTION_TYPES, exempt=GATE_KEYS) == []
    assert _numbers_without_an_upper_bound(_STAGE_SECTIONS) == []


@pytest.mark.parametrize("section,key,value,bound", [
    ("train", "max_steps", 2**63 - 1, "at most 1000000000"), ("train", "epochs", 10**6, "at most 100000"),
    ("optimizer", "lr", 11.0, "at most 10"), ("optimizer", "weight_decay", 2.0, "at most 1"),
    ("schedule", "warmup_steps", 2**62, "at most 1000000000"), ("checkpoint", "every_steps", 2**40, "at most"),
])
def test_train_config_refuses_past_the_bound_naming_it(tmp_path, section, key, value, bound):
    from appliance.core.errors import ConfigError
    from appliance.train.config import load_config

    path = tmp_path / "t.toml"
    path.write_text(f'[run]\nname = "t"\n[data]\ntrain = ["x.tfrecord"]\nnum_classes = 2\n[{section}]\n{key} = {value}\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"[{section}] {key}" in str(err.value) and bound in str(err.value), err.value


def _flags(parser, prog=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _flags(sub, (*prog, name))
        elif action.type is not None:
            yield " ".join(prog), action.option_strings[-1] if action.option_strings else action.dest, action.type


def _takes_a_huge_number(kind) -> bool:
    import argparse

    for text in (str(2**62), "1e300"):
        try:
            value = kind(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
    return False


def test_every_numeric_flag_has_an_upper_bound():
    """`--qat-lr-scale` had no bound on the command line (the pipeline caps it at 10), and many counts none:
    every numeric flag refuses 2^62 and 1e300 now, naming its bound."""
    unbounded = [f"{verb} {flag}" for verb, flag, kind in _flags(build_parser()) if _takes_a_huge_number(kind)]
    assert unbounded == []


@pytest.mark.parametrize("argv,expected", [
    (["quantize", "m.onnx", "--calib", "c", "--out", "o", "--qat-lr-scale", "11"], "--qat-lr-scale: must be at most 10"),
    (["quantize", "m.onnx", "--calib", "c", "--out", "o", "--qat-epochs", str(2**63 - 1)], "--qat-epochs: must be at most 100000"),
    (["data", "check", "f", "--out", "o", "--max-pixels", "2000000000"], "--max-pixels: must be at most 1000000000"),
])
def test_numeric_flags_refuse_past_their_bound_in_one_line(capsys, argv, expected):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1, err
