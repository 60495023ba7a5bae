"""`appliance data check` on generated datasets with planted problems: each found exactly, nothing lost."""

import json
from collections import Counter

import pytest

from check_datasets import CLASSES, make_planted
from conftest import run_appliance
from data_tools.example import decode_example
from data_tools.index import load_index
from data_tools.tfrecord import FRAME_BYTES, read_records

FAIL_ON = "corrupt>0,imbalance>10,quarantined_fraction>0.5"


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """One offline CLI run over the planted train/val split, shared by the tests below."""
    tmp = tmp_path_factory.mktemp("check")
    planted = make_planted(tmp / "data")
    out = tmp / "out"
    proc = run_appliance("data", "check", "--train", str(planted.train), "--val", str(planted.val),
                         "--out", str(out), "--fail-on", FAIL_ON, offline=True)
    report = json.loads((out / "report.json").read_text())
    lines = [json.loads(line) for line in (out / "quarantine" / "reasons.jsonl").read_text().splitlines()]
    return planted, out, proc, report, lines[0], lines[1:]


def _split_path(planted, split):
    return str(planted.train if split == "train" else planted.val)


def _offsets(records):
    offsets, pos = [], 0
    for r in records:
        offsets.append(pos)
        pos += len(r) + FRAME_BYTES
    return offsets


def test_every_planted_problem_is_quarantined_with_its_reason(checked):
    planted, out, proc, report, header, reasons = checked
    expected = {(check, _split_path(planted, s), n) for check, where in planted.bad.items() for s, n in where}
    expected.add(("duplicate", _split_path(planted, planted.duplicate[0]), planted.duplicate[1]))
    expected |= {("leakage", _split_path(planted, s), n) for s, n in planted.leaked}
    found = {(r["check"], r["file"], r["record_number"]) for r in reasons if r["check"] != "framing"}
    assert found == expected
    assert "made_by" in header
    # Offsets point at the records' real positions in the input files.
    for r in reasons:
        if r["check"] == "framing":
            continue
        records = planted.train_records if r["file"] == str(planted.train) else planted.val_records
        assert r["offset"] == _offsets(records)[r["record_number"]]
        assert r["detail"]


def test_quarantined_bytes_are_the_rejected_records(checked):
    planted, out, proc, report, header, reasons = checked
    for r in reasons:
        if r["check"] == "framing":
            continue
        records = planted.train_records if r["file"] == str(planted.train) else planted.val_records
        shard = list(read_records(out / r["quarantine_shard"], strict=True))
        assert bytes(shard[r["quarantine_position"]]) == records[r["record_number"]]


def test_corrupt_record_is_an_unreadable_range_with_offsets(checked):
    planted, out, proc, report, header, reasons = checked
    start = _offsets(planted.train_records)[planted.corrupt_record]
    damaged = report["damaged_ranges"]
    assert len(damaged) == 1
    assert damaged[0]["file"] == str(planted.train) and damaged[0]["start"] == start
    assert damaged[0]["end"] == start + len(planted.train_records[planted.corrupt_record]) + FRAME_BYTES
    assert [r for r in reasons if r["check"] == "framing"][0]["offset"] == start
    assert report["checks"]["framing"] == 1


def test_counts_add_up(checked):
    planted, out, proc, report, header, reasons = checked
    readable = len(planted.train_records) - 1 + len(planted.val_records)  # one record's bytes are damaged
    assert report["records_total"] == readable
    assert report["records_valid"] + report["records_quarantined"] == report["records_total"]
    assert sum(f["records"] for f in report["files"]) == report["records_total"]
    assert sum(f["valid"] for f in report["files"]) == report["records_valid"]
    quarantined_records = {(r["file"], r["record_number"]) for r in reasons if r["check"] != "framing"}
    assert report["records_quarantined"] == len(quarantined_records)
    checks = Counter(r["check"] for r in reasons)
    for check, count in checks.items():
        assert report["checks"][check] == count
    assert report["checks"]["parse"] == 1 and report["metrics"]["corrupt"] == 2


def test_clean_records_are_never_lost(checked):
    planted, out, proc, report, header, reasons = checked
    rejected = {(r["file"], r["record_number"]) for r in reasons if r["check"] != "framing"}
    for path, records in ((planted.train, planted.train_records), (planted.val, planted.val_records)):
        expected = [rec for n, rec in enumerate(records)
                    if (str(path), n) not in rejected and not (path == planted.train and n == planted.corrupt_record)]
        clean = out / "clean" / path.name
        assert [bytes(r) for r in read_records(clean, strict=True)] == expected
        assert len(load_index(clean)) == len(expected)
        assert (out / "clean" / f"{path.name}.index").exists()


def test_huge_image_is_reported_as_outlier_and_kept(checked):
    planted, out, proc, report, header, reasons = checked
    huge = (str(planted.train), planted.huge[1])
    def flagged(stat):
        return {(o["file"], o["record_number"]) for o in report["outliers"] if o["statistic"] == stat}

    assert flagged("width") == flagged("height") == {huge}  # every other image is 64x64
    assert huge in flagged("encoded_size")
    width = [o for o in report["outliers"] if o["statistic"] == "width"][0]
    assert width["value"] == 1600 and "median/MAD" in width["rules"]
    assert huge not in {(r["file"], r["record_number"]) for r in reasons}


def test_near_duplicates_reported_not_quarantined(checked):
    planted, out, proc, report, header, reasons = checked
    groups = [{(m["split"], m["record_number"]) for m in g} for g in report["duplicates"]["near_groups"]]
    assert set(planted.near) in groups
    assert report["metrics"]["near_duplicates"] == len(groups)


def test_label_balance_and_gate(checked):
    planted, out, proc, report, header, reasons = checked
    clean = [decode_example(bytes(r))["image/class/label"][0] for name in ("train.tfrecord", "val.tfrecord")
             for r in read_records(out / "clean" / name)]
    assert report["labels"]["histogram"] == {str(k): v for k, v in sorted(Counter(map(int, clean)).items())}
    assert report["labels"]["histogram"][str(planted.minority_class)] == 2
    assert report["labels"]["class_names"] == {str(i): name for i, name in enumerate(CLASSES)}
    assert report["schema"]["num_classes"] == 5  # the stray label 9 did not widen the range
    assert proc.returncode == 3, proc.stderr
    # Progress off a terminal: plain lines with rate, no \r frames; the last says 100 %.
    progress = [line for line in proc.stderr.splitlines() if line.startswith("data check: ")]
    assert progress and "(100.0 %)" in progress[-1] and "B/s" in progress[-1] and "records" in progress[-1]
    assert "\r" not in proc.stderr
    failed = [line for line in proc.stderr.splitlines() if line.startswith("gate failed:")]
    assert len(failed) == 2 and failed[0].startswith("gate failed: corrupt = 2 > 0")
    assert failed[1].startswith("gate failed: imbalance = ")
    assert report["gate"]["passed"] is False and len(report["gate"]["failed"]) == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "check" and {i["path"] for i in manifest["inputs"]} == {
        str(planted.train), str(planted.val)}


def test_passing_gate_exits_zero(tmp_path):
    planted = make_planted(tmp_path / "data", per_class=4, minority=4)
    proc = run_appliance("data", "check", str(planted.val), "--out", str(tmp_path / "out"),
                         "--fail-on", "corrupt>0,imbalance>10", "--quiet", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["gate"] == {"passed": True, "conditions": ["corrupt>0", "imbalance>10"], "failed": []}
    assert json.loads(proc.stdout) == report  # --json: one object on stdout
    assert proc.stderr.startswith("checked ") and "data check: " not in proc.stderr  # --quiet: no progress
