"""Bad inputs to `appliance data check`: one clear line each, and the rest still reported."""

import gzip
import json
import shutil

from check_datasets import jpeg, make_planted
from conftest import run_appliance
from data_tools.check.run import run_check
from data_tools.example import encode_example
from data_tools.tfrecord import write_records


def test_bad_files_get_one_line_each_and_the_rest_is_reported(tmp_path):
    planted = make_planted(tmp_path / "data", per_class=3, minority=3)
    missing = tmp_path / "missing.tfrecord"
    text = tmp_path / "notes.txt"
    text.write_text("these are my notes, not TFRecords\n" * 20)
    empty = tmp_path / "empty.tfrecord"
    empty.touch()
    unreadable_dir = tmp_path / "a_directory"
    unreadable_dir.mkdir()
    out = tmp_path / "out"
    proc = run_appliance("data", "check", str(missing), str(text), str(planted.val), str(empty),
                         str(unreadable_dir), "--out", str(out), "--no-progress")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 4, proc.stderr
    assert lines[0] == f"appliance data check: error: {missing}: cannot read: No such file or directory"
    assert lines[1].startswith(f"appliance data check: error: {text}: not a TFRecord file")
    assert lines[2] == f"appliance data check: error: {empty}: empty file: no records"
    assert lines[3] == f"appliance data check: error: {unreadable_dir}: is a directory, not a TFRecord file"
    report = json.loads((out / "report.json").read_text())
    assert report["records_total"] == report["records_valid"] + report["records_quarantined"] == len(
        planted.val_records)
    assert report["metrics"]["unreadable_files"] == 4
    by_path = {f["path"]: f for f in report["files"]}
    assert by_path[str(planted.val)]["error"] is None and by_path[str(planted.val)]["records"] == len(
        planted.val_records)
    assert by_path[str(text)]["damaged_ranges"] == 1  # the whole file is listed as unreadable bytes
    assert "checked" in proc.stdout


def test_records_of_the_wrong_schema_are_rejected_with_one_line(tmp_path):
    planted = make_planted(tmp_path / "data", per_class=3, minority=3)
    other = tmp_path / "tabular.tfrecord"
    write_records(other, [encode_example({"age": i, "income": float(i * 1000)}) for i in range(12)])
    first = run_appliance("data", "check", str(planted.val), "--out", str(tmp_path / "first"), "--no-progress")
    assert first.returncode == 0, first.stderr
    schema = tmp_path / "first" / "schema.json"
    out = tmp_path / "out"
    proc = run_appliance("data", "check", str(planted.val), str(other), "--schema", str(schema),
                         "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"appliance data check: error: {other}: every record rejected (12 x schema, "
                     "e.g. missing required feature 'image/class/label')"]
    report = json.loads((out / "report.json").read_text())
    assert report["records_quarantined"] == 12 and report["records_valid"] == len(planted.val_records)
    assert report["schema_source"] == f"given: {schema}"


def test_malformed_schema_file_is_one_line(tmp_path):
    planted = make_planted(tmp_path / "data", per_class=2, minority=2)
    schema = tmp_path / "schema.json"
    schema.write_text('{"features": {"image/encoded": {"dtype": "bytes"},}}')
    proc = run_appliance("data", "check", str(planted.val), "--schema", str(schema), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert proc.stderr == f"appliance data check: error: {schema}: line 1: schema is not valid JSON: " \
                          "Expecting property name enclosed in double quotes\n"


def test_unknown_gate_metric_is_one_line(tmp_path):
    proc = run_appliance("data", "check", "x.tfrecord", "--out", str(tmp_path), "--fail-on", "corupt>0")
    assert proc.returncode == 2
    assert proc.stderr.startswith("appliance data check: error: --fail-on: unknown metric 'corupt'")


def test_gzip_input_gives_the_same_result_and_serial_equals_parallel(tmp_path):
    planted = make_planted(tmp_path / "data", per_class=6, minority=2)
    packed = tmp_path / "train.tfrecord.gz"
    with open(planted.train, "rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    plain, status = run_check([(str(planted.train), None), (str(planted.val), None)], tmp_path / "plain",
                              progress=False, jobs=2)
    serial, _ = run_check([(str(packed), None), (str(planted.val), None)], tmp_path / "gz", progress=False, jobs=1)
    for key in ("records_total", "records_valid", "records_quarantined", "checks", "labels"):
        assert plain[key] == serial[key], key
    assert serial["files"][0]["compression"] == "GZIP"
    assert (tmp_path / "gz" / "clean" / "train.tfrecord").read_bytes() == (
        tmp_path / "plain" / "clean" / "train.tfrecord").read_bytes()


def test_rerun_replaces_previous_output(tmp_path):
    planted = make_planted(tmp_path / "data", per_class=3, minority=3)
    out = tmp_path / "out"
    run_check([(str(planted.train), None)], out, progress=False)
    assert (out / "clean" / "train.tfrecord").exists()
    write_records(tmp_path / "small.tfrecord", [encode_example({"image/encoded": jpeg(__import__("numpy").random.default_rng(1)),
                                                                "image/class/label": 0})])
    report, status = run_check([(str(tmp_path / "small.tfrecord"), None)], out, progress=False)
    assert status == 0 and report["records_valid"] == 1
    assert sorted(p.name for p in (out / "clean").iterdir()) == [
        "small.tfrecord", "small.tfrecord.index", "small.tfrecord.index.json"]
    assert not any(p.name.startswith(".") for p in out.iterdir())


def test_binary_schema_file_is_one_line(tmp_path):
    import pytest

    from appliance.core.errors import ConfigError
    from data_tools.check.schema import load_schema

    schema = tmp_path / "schema.json"
    schema.write_bytes(bytes(range(128, 256)))
    with pytest.raises(ConfigError) as err:
        load_schema(schema)
    assert str(err.value) == f"{schema}: not a schema file (byte 0 is not UTF-8 text)"
    schema.write_text('{"features": {"image/encoded": {"dtype": "bytes"}}, "num_classes": "ten"}')
    with pytest.raises(ConfigError, match="num_classes must be an integer in 0..100000, got 'ten'"):
        load_schema(schema)
