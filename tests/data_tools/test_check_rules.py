"""The rules behind `appliance data check`, on values where the right answer is known by construction."""

import numpy as np
import pytest

from appliance.core.errors import ConfigError
from data_tools.check.duplicates import copies_to_quarantine, exact_groups, near_groups
from data_tools.check.gate import evaluate, parse_fail_on
from data_tools.check.image_probe import ImageProblem, probe_image
from data_tools.check.outliers import flag_outliers, outlier_bounds
from data_tools.check.schema import infer_num_classes, infer_schema, validate


def test_mad_rule_finds_the_outlier_that_fools_three_sigma():
    # With n values the largest possible z-score is (n-1)/sqrt(n): 2.67 for n = 9, so 3-sigma
    # can never flag a single extreme value among 9; the median/MAD rule does.
    values = np.array([100, 101, 99, 100, 102, 98, 100, 101, 5000.0])
    flagged = flag_outliers(values, outlier_bounds(values))
    assert flagged == [(8, ["median/MAD"])]


def test_both_rules_agree_on_a_clear_outlier_in_many_values():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.normal(50, 2, 500).clip(44, 56), [200.0]])
    assert flag_outliers(values, outlier_bounds(values)) == [(500, ["3-sigma", "median/MAD"])]


def test_equal_values_have_no_outliers():
    assert flag_outliers(np.full(50, 64.0), outlier_bounds(np.full(50, 64.0))) == []


def test_gate_parses_evaluates_and_rejects_typos():
    conditions = parse_fail_on("corrupt>0, quarantined_fraction>0.05,imbalance>=10")
    result = evaluate(conditions, {"corrupt": 0, "quarantined_fraction": 0.2, "imbalance": 10.0})
    assert result["passed"] is False
    assert [line.split(" (")[0] for line in result["failed"]] == [
        "quarantined_fraction = 0.2 > 0.05", "imbalance = 10 >= 10"]
    with pytest.raises(ConfigError, match="unknown metric 'corupt'"):
        parse_fail_on("corupt>0")
    with pytest.raises(ConfigError, match="is not METRIC>NUMBER"):
        parse_fail_on("corrupt")


def test_near_groups_use_hamming_distance_and_skip_exact_copies():
    base = 0x0123_4567_89AB_CDEF
    items = [((0, 0), base, b"a"), ((0, 1), base ^ 0b111, b"b"),  # 3 bits apart: near
             ((0, 2), base ^ 0xFFFF_0000_0000_0000, b"c"),  # 16 bits apart: not near
             ((0, 3), base, b"a")]  # an exact copy of (0, 0): counted once
    assert near_groups(items, max_distance=4) == [[(0, 0), (0, 1)]]


def test_copies_in_val_of_train_images_are_leakage_other_copies_duplicates():
    groups = exact_groups([((0, 4), b"x"), ((1, 2), b"x"), ((0, 9), b"x"), ((1, 5), b"y"), ((1, 7), b"y")])
    split = {0: "train", 1: "val"}
    rejected = copies_to_quarantine(groups, lambda rid: split[rid[0]])
    assert sorted(rejected) == [((0, 9), "duplicate", (0, 4)), ((1, 2), "leakage", (0, 4)),
                                ((1, 7), "duplicate", (1, 5))]


def test_label_range_comes_from_all_labels_and_strays_are_rare():
    assert infer_num_classes({0: 30, 1: 30, 2: 30, 3: 30, 4: 2, 9: 1}) == 5  # 9 is a stray
    assert infer_num_classes({0: 30, 1: 30, 3: 30}) == 4  # plentiful past a gap: class 2 is empty
    assert infer_num_classes({0: 100, 1: 100, 2: 100, 99: 1}) == 3


def test_validation_names_the_problem():
    schema = infer_schema([{"image/encoded": [b"x"], "image/class/label": np.array([i % 4])} for i in range(40)],
                          "image/encoded", "image/class/label")
    schema["features"]["image/class/label"].update(min=0, max=3)
    assert validate({"image/encoded": [b"x"], "image/class/label": np.array([99])}, schema) == [
        ("label_range", "image/class/label = 99 outside 0..3")]
    assert validate({"image/encoded": np.array([1.0], dtype=np.float32), "image/class/label": np.array([1])},
                    schema) == [("schema", "feature 'image/encoded' is float, schema says bytes")]


def test_probe_measures_and_rejects(tmp_path):
    from check_datasets import blank_jpeg, jpeg

    probe = probe_image(jpeg(np.random.default_rng(0), size=(80, 60)))
    assert (probe.format, probe.width, probe.height, probe.channels) == ("jpeg", 80, 60, 3)
    with pytest.raises(ImageProblem) as err:
        probe_image(blank_jpeg())
    assert err.value.check == "blank_image"
    with pytest.raises(ImageProblem) as err:
        probe_image(jpeg(np.random.default_rng(0), size=(300, 300)), max_pixels=200 * 200)
    assert err.value.check == "image_too_large" and "300x300" in err.value.detail


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares its size and holds no pixels: what a decompression bomb shows at open()."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def test_the_check_keeps_pillows_bomb_guard_for_the_process_and_names_a_bomb_too_large():
    """Importing the probe once turned Pillow's guard off for every later decode in the process (the
    pipeline decodes calibration and verification images in it); a bomb past Pillow's own refusal at
    open() is image_too_large, one line, like one past --max-pixels."""
    from PIL import Image

    assert Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < 200_000_000
    for width, height in ((20_000, 10_000), (12_000, 8_000)):  # past Pillow's error, past its warning only
        with pytest.raises(ImageProblem) as err:
            probe_image(_png_header(width, height))
        assert err.value.check == "image_too_large", err.value.detail
    assert Image.MAX_IMAGE_PIXELS is not None


def test_declared_format_that_disagrees_with_the_bytes_is_reported_not_rejected():
    import io

    from PIL import Image

    from check_datasets import example
    from data_tools.check.scan import check_record

    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(png, "PNG")
    schema = {"features": {"image/encoded": {"dtype": "bytes", "required": True}},
              "image_key": "image/encoded", "label_key": "image/class/label"}
    problems, summary = check_record(example(png.getvalue(), 1, fmt=b"jpeg"), schema, 10**6)
    assert problems == []
    assert summary["note"] == ("format_mismatch", "image/format says b'jpeg', the bytes are png")
    assert summary["label"] == 1


def test_training_can_require_a_passing_report(tmp_path):
    import json

    from appliance.core.errors import DataError
    from data_tools.check.gate import require_passing_report

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"gate": {"passed": False, "conditions": ["corrupt>0"],
                                           "failed": ["corrupt = 2 > 0 (damaged byte ranges ...)"]}}))
    with pytest.raises(DataError, match=r"report.json: data check gate failed: corrupt = 2 > 0"):
        require_passing_report(report)
    report.write_text(json.dumps({"gate": {"passed": True, "conditions": [], "failed": []}}))
    with pytest.raises(DataError, match="without --fail-on"):
        require_passing_report(report)
    report.write_text(json.dumps({"gate": {"passed": True, "conditions": ["corrupt>0"], "failed": []}}))
    assert require_passing_report(report)["gate"]["passed"] is True


def test_per_record_memory_is_a_small_constant(tmp_path):
    import pickle

    from check_datasets import example, jpeg
    from data_tools.check.scan import ScanTask, scan_file
    from data_tools.check.schema import infer_schema
    from data_tools.example import decode_example
    from data_tools.tfrecord import write_records

    rng = np.random.default_rng(0)
    records = [example(jpeg(rng, size=(32, 32)), i % 3) for i in range(600)]
    write_records(tmp_path / "d.tfrecord", records)
    schema = infer_schema([decode_example(r) for r in records[:50]], "image/encoded", "image/class/label")
    (tmp_path / "clean").mkdir()
    (tmp_path / "quarantine").mkdir()
    result = scan_file(ScanTask(0, str(tmp_path / "d.tfrecord"), None, "d.tfrecord", str(tmp_path), schema, 10**6))
    assert len(result.clean_records) == 600
    # What the parent holds per record (summaries travel pickled from the workers): no images.
    assert len(pickle.dumps(result)) / 600 < 200
