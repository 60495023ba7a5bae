"""A seeded fuzz of what users write: configs (types, ranges, unicode, NUL, nesting, sizes, unknown
keys) for `appliance train --dry-run` and `appliance pipeline`, and schemas and flags for
`appliance data check`. Every case either works or is one `appliance VERB: error: ...` line:
never a traceback, never "internal error". In-process and seeded: a failure replays by its seed.
"""

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from appliance.cli import main
from appliance.core.errors import ApplianceError
from appliance.pipeline.config import _STAGE_SECTIONS, load_pipeline_config
from appliance.train.config import _SECTION_TYPES

sys.path.insert(0, str(Path(__file__).resolve().parent / "train"))
from train_data import make_config  # noqa: E402

SEED = 3131
CASES = 120


def toml_value(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)  # JSON strings, numbers and booleans are TOML


def toml(config: dict) -> str:
    """Top-level values first (a "section" that is not a table), then the tables."""
    top = "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in config.items() if not isinstance(v, dict))
    return top + "".join(f"[{json.dumps(name)}]\n" + "".join(f"{json.dumps(k)} = {toml_value(v)}\n"
                                                           for k, v in table.items())
                         for name, table in config.items() if isinstance(table, dict))


def strange_value(rng, depth: int = 0):
    kind = int(rng.integers(0, 18))
    if kind == 0:
        return int(rng.choice([0, 1, -1, 2**31, 2**32, 2**63 - 1, -(2**63), 10**30]))
    if kind == 1:
        return float(rng.choice([0.0, -0.0, 1e-320, 1e300, -1e300, math.inf, -math.inf, math.nan, 0.5]))
    if kind == 2:
        return bool(rng.integers(0, 2))
    if kind == 3:
        return str(rng.choice(["", " ", "a\u0000b", "ü/../..", "name with spaces", "/dev/zero", "-", "x" * 5000,
                               "\u202e\u200b", "runs/../../etc", "A=B", "banana", "onnx", "auto", "."]))
    if kind == 4 and depth < 3:
        return [strange_value(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]
    if kind == 5 and depth < 3:
        return {str(rng.choice(["a", "A=B", "", "x\u0000"])): strange_value(rng, depth + 1)}
    if kind == 6:
        return "9" * int(rng.integers(20, 500))  # a number in a string
    if kind == 7:
        return int(rng.integers(-5, 100_000))
    if kind == 8:
        nested = []
        for _ in range(int(rng.integers(1, 60))):
            nested = [nested]
        return nested
    return float(rng.normal() * 10.0 ** int(rng.integers(-3, 8)))


def mutate(rng, config: dict, sections: dict) -> dict:
    config = json.loads(json.dumps(config))
    for _ in range(int(rng.integers(1, 4))):
        name = str(rng.choice(list(sections) + ["unknown_section"]))
        if name == "unknown_section":
            config[name] = {"k": 1}
            continue
        keys = [f.name for f in dataclasses.fields(sections[name])] + ["not_a_key"]
        key = str(rng.choice(keys))
        table = config.setdefault(name, {})
        if rng.random() < 0.1:
            config[name] = strange_value(rng)  # a section that is not a table
        elif isinstance(table, dict):
            table[key] = strange_value(rng)
    return config


def assert_one_line_or_ok(status: int, err: str, what: str) -> None:
    lines = err.strip().splitlines()
    assert "Traceback" not in err and "internal error" not in err, (what, err[-2000:])
    assert status == 0 or (status == 2 and len(lines) == 1 and ": error: " in lines[0]), (what, status, err[-2000:])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A good training config (dict) on small real data, with absolute paths."""
    directory = tmp_path_factory.mktemp("fuzz")
    path = make_config(directory, train_records=8, val_records=3)
    import tomllib

    config = tomllib.loads(path.read_text())
    config["data"]["train"] = [str(directory / "data" / "train-*.tfrecord")]
    config["data"]["val"] = [str(directory / "data" / "val-*.tfrecord")]
    config["run"]["out_dir"] = str(directory / "runs")
    return directory, config


def test_fuzzed_training_configs_are_accepted_or_one_line(base, tmp_path, capsys):
    _, good = base
    rng = np.random.default_rng(SEED)
    outcomes = {0: 0, 2: 0}
    for case in range(CASES):
        config = mutate(rng, good, _SECTION_TYPES)
        path = tmp_path / f"case-{case}.toml"
        path.write_text(toml(config))
        status = main(["train", str(path), "--dry-run"])
        captured = capsys.readouterr()
        assert_one_line_or_ok(status, captured.err, f"seed {SEED} case {case}: {path.read_text()[:3000]}")
        outcomes[status] += 1
    assert outcomes[2] > CASES // 2  # the fuzz does reach the checks


def test_fuzzed_pipeline_configs_are_accepted_or_one_line(base, tmp_path):
    _, good = base
    rng = np.random.default_rng(SEED + 1)
    sections = {**_SECTION_TYPES, **_STAGE_SECTIONS}
    refused = 0
    for case in range(CASES):
        config = mutate(rng, good, sections)
        path = tmp_path / f"pipeline-{case}.toml"
        path.write_text(toml(config))
        try:
            load_pipeline_config(path)  # what `appliance pipeline` does before any stage runs
        except ApplianceError as err:
            assert "\n" not in str(err), str(err)
            refused += 1
    assert refused > CASES // 2


def test_fuzzed_schemas_and_keys_for_data_check_are_accepted_or_one_line(base, tmp_path, capsys):
    directory, _ = base
    rng = np.random.default_rng(SEED + 2)
    data = str(directory / "data" / "val-0.tfrecord")
    good = {"num_classes": 3, "features": {"image/encoded": {"dtype": "bytes", "required": True},
                                           "image/class/label": {"dtype": "int64", "required": True}}}
    for case in range(40):
        schema = json.loads(json.dumps(good))
        target = schema if rng.random() < 0.3 else schema["features"][str(rng.choice(list(good["features"])))]
        target[str(rng.choice(["num_classes", "dtype", "required", "min", "max", "min_count", "max_count",
                               "features", "label_key"]))] = strange_value(rng)
        path = tmp_path / f"schema-{case}.json"
        path.write_text(json.dumps(schema, allow_nan=True))
        flags = [str(rng.choice(["--image-key", "--label-key", "--near-distance", "--max-pixels", "--fail-on"])),
                 str(strange_value(rng))] if rng.random() < 0.3 else []
        try:
            status = main(["data", "check", data, "--out", str(tmp_path / f"out-{case}"), "--schema", str(path),
                           "--no-progress", "--jobs", "1", *flags])
        except SystemExit as exit_:  # argparse: one line too
            status = 2 if exit_.code == 2 else exit_.code
        captured = capsys.readouterr()
        err = "\n".join(line for line in captured.err.splitlines() if not line.startswith("gate failed: "))
        assert_one_line_or_ok(0 if status in (0, 3) else status, err if status == 2 else "",
                              f"seed {SEED + 2} case {case}: {path.read_text()[:2000]} {flags}: {captured.err[-2000:]}")


# Every verb that reads an input (not doctor, demo, `edge sysroot`, `bundle build`: they do a whole job
# or reach a mirror), with a junk input and one fuzzed flag value: one line or success, never a traceback.
FLAG_VERBS = (["data", "index"], ["data", "cat"], ["data", "convert"], ["data", "check"], ["data", "preview"],
              ["train"], ["export"], ["quantize"], ["compile"], ["package"], ["edge", "verify"], ["pipeline"],
              ["bundle", "audit"])


def _options(verb: list[str]) -> list[str]:
    import argparse

    from appliance.cli import build_parser

    parser = build_parser()
    for word in verb:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return [a.option_strings[-1] for a in parser._actions if a.option_strings and a.nargs != 0 and a.dest != "help"]


def test_fuzzed_flags_of_every_verb_are_accepted_or_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a fuzzed relative --out lands here, not in the checkout
    rng = np.random.default_rng(SEED + 3)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00not a model, a config, a record or a tar\xff" * 8)
    for case in range(len(FLAG_VERBS) * 8):
        verb = FLAG_VERBS[case % len(FLAG_VERBS)]
        options = _options(verb)
        flags = []
        if options:
            value = strange_value(rng)
            text = (json.dumps(value) if isinstance(value, (list, dict)) else str(value)).replace("\x00", "")
            flags = [f"{rng.choice(options)}={text}"]  # a NUL cannot reach argv; "=" keeps "-1" a value
        out = ["--out", str(tmp_path / f"out-{case}")] if "--out" in options and not flags[0].startswith("--out=") \
            else []
        argv = [*verb, str(junk), *out, *flags]
        if verb == ["train"]:
            argv.append("--dry-run")
        if verb == ["data", "check"]:
            argv.append("--no-progress")
        try:
            status = main(argv)
        except SystemExit as exit_:  # argparse: one line too
            status = 2 if exit_.code == 2 else exit_.code
        captured = capsys.readouterr()
        if verb == ["data", "check"] and status in (1, 3):  # damage found, the gate failed: a report, not an error
            status = 0
        what, lines = f"seed {SEED + 3} case {case}: appliance {' '.join(argv)}", captured.err.strip().splitlines()
        assert "Traceback" not in captured.err and "internal error" not in captured.err, (what, captured.err[-2000:])
        assert status == 0 or (status in (1, 2, 3) and len(lines) == 1 and lines[0].startswith("appliance ")), \
            (what, status, captured.err[-2000:])
