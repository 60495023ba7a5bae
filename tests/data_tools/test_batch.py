"""read_examples / decode_batch: every row equals decode_example's value for that record, on
regular files (the numpy path), irregular ones (the per-record path), and damaged ones (the
same records, damage reports and strict errors as read_records)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.core.errors import DataError
from data_tools.batch import ExampleBatch, decode_spans, decode_batch, read_examples
from data_tools.example import decode_example, encode_example
from data_tools.spans import joined
from data_tools.tfrecord import TFRecordError, read_records, write_records


def rows(batches):
    """Per-record dicts out of column batches (None marks a key the record lacks)."""
    out = []
    for b in batches:
        assert isinstance(b, ExampleBatch)
        for col in b.values():
            assert len(col) == b.count
        for r in range(b.count):
            out.append({k: col[r] for k, col in b.items() if col[r] is not None})
    return out


def assert_same_rows(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert list(g) == list(w) or set(g) == set(w)
        for key, value in w.items():
            if isinstance(value, np.ndarray):
                assert isinstance(g[key], np.ndarray) and g[key].dtype == value.dtype
                assert np.array_equal(g[key], value)
            else:
                assert g[key] == value and all(type(x) is bytes for x in g[key])


def expected(path, keys=None):
    return [decode_example(r, keys) for r in read_records(path)]


def image_records(n, seed=0, sizes=(2400, 3400)):
    rng = np.random.default_rng(seed)
    return [encode_example({
        "image/encoded": rng.bytes(int(rng.integers(*sizes))),
        "image/format": b"jpeg",
        "image/class/label": i % 300 - 20,  # negative, one- and two-byte varints
        "image/class/text": f"class_{i % 300}",
        "image/bbox": rng.random(16, dtype=np.float32),
    }) for i in range(n)]


def test_regular_file_takes_the_numpy_path_and_matches_decode_example(tmp_path):
    path = tmp_path / "images.tfrecord"
    write_records(path, image_records(70))
    batches = list(read_examples(path, batch=32))
    assert [b.count for b in batches] == [32, 32, 6]
    assert batches[0]["image/bbox"].shape == (32, 16) and batches[0]["image/bbox"].dtype == np.float32
    assert batches[0]["image/class/label"].shape == (32, 1) and batches[0]["image/class/label"].dtype == np.int64
    assert_same_rows(rows(batches), expected(path))
    # the fast path really accepts this layout (a silent fallback would hide a broken fast path)
    records = image_records(8)
    blob, starts, ends, _ = joined(records)
    assert set(decode_spans(blob, starts, ends, None)) == set(decode_example(records[0]))


def test_keys_limit_the_columns_and_absent_keys_are_none(tmp_path):
    path = tmp_path / "images.tfrecord"
    write_records(path, image_records(10))
    batches = list(read_examples(path, ["image/class/label", "nope", "image/encoded"], batch=4))
    assert all(list(b) == ["image/class/label", "nope", "image/encoded"] for b in batches)
    assert all(b["nope"] == [None] * b.count for b in batches)
    assert_same_rows(rows(batches), expected(path, {"image/class/label", "image/encoded"}))


def test_irregular_records_fall_back_with_the_same_values(tmp_path):
    records = [
        encode_example({"a": [1, 2, 3], "b": [b"x", b"yy"]}),     # several byte strings
        encode_example({"a": np.array([], np.int64), "c": 1.5}),  # empty list, another key
        encode_example({"b": b"z" * 20000, "a": [7]}),            # other order, 3-byte varints
        b"",                                                      # an empty Example
        encode_example({"a": [2 ** 63 - 1, -(2 ** 63)], "f": np.arange(3, dtype=np.float32)}),
        encode_example({"a": [5], "f": np.arange(5, dtype=np.float32)}),
    ]
    path = tmp_path / "mixed.tfrecord"
    write_records(path, records)
    for batch in (1, 2, 4, 6):
        assert_same_rows(rows(read_examples(path, batch=batch)), expected(path))


def test_mixed_varint_widths_and_varying_counts(tmp_path):
    rng = np.random.default_rng(1)
    records = [encode_example({
        "image": rng.bytes(int(rng.choice([100, 200, 20000]))),  # 1-, 2-, 3-byte lengths
        "scores": rng.random(int(rng.integers(1, 40)), dtype=np.float32),
        "ids": rng.integers(-5, 10 ** 12, size=3),
    }) for _ in range(40)]
    path = tmp_path / "varied.tfrecord"
    write_records(path, records)
    got = rows(read_examples(path, batch=16))
    assert_same_rows(got, expected(path))
    # lengths of one, two and three varint bytes in one batch still take the numpy path
    blob, starts, ends, _ = joined(records)
    assert set(decode_spans(blob, starts, ends, None)) == {"image", "scores", "ids"}


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_compressed_files(tmp_path, compression):
    path = tmp_path / "images.tfrecord"
    write_records(path, image_records(20), compression)
    assert_same_rows(rows(read_examples(path, batch=8)), expected(path))


def damaged_file(tmp_path, sizes=(200, 400)):
    records = image_records(30, sizes=sizes)
    path = tmp_path / "damaged.tfrecord"
    write_records(path, records)
    data = bytearray(path.read_bytes())
    sizes = [len(r) + 16 for r in records]
    data[sum(sizes[:7]) + 40] ^= 0x10          # inside record 7's data
    data[sum(sizes[:15]) + 3] ^= 0x01          # record 15's length field
    data[sum(sizes[:22]):sum(sizes[:22])] = b"garbage" * 9  # junk before record 22
    path.write_bytes(bytes(data[:-5]))         # and a truncated tail (record 29)
    return path


@pytest.mark.parametrize("batch", [1, 4, 256])
@pytest.mark.parametrize("sizes", [(200, 400), (20000, 30000)])  # lengths of 2 and 3 varint bytes
def test_damaged_file_gives_the_same_records_and_reports(tmp_path, batch, sizes):
    path = damaged_file(tmp_path, sizes)
    want_damage, got_damage = [], []
    want = [decode_example(r) for r in read_records(path, on_damage=want_damage.append)]
    got = rows(read_examples(path, batch=batch, on_damage=got_damage.append))
    assert len(want) == 27  # 30 written: records 7, 15 and 29 damaged; the junk hits none
    assert_same_rows(got, want)
    assert got_damage == want_damage and len(want_damage) == 4


def test_strict_yields_the_records_before_the_damage_then_raises(tmp_path):
    path = damaged_file(tmp_path)
    got = []
    with pytest.raises(TFRecordError) as err:
        for b in read_examples(path, batch=4, strict=True):
            got.append(b)
    assert sum(b.count for b in got) == 7  # records 0-6, the ones read_records gives first
    assert err.value.record_number == 7
    assert_same_rows(rows(got), [decode_example(r) for r in list(read_records(path))[:7]])


def test_a_record_that_is_not_an_example_is_a_data_error(tmp_path):
    path = tmp_path / "junk.tfrecord"
    write_records(path, [encode_example({"a": 1}), b"\xff\xff\xff not protobuf"])
    with pytest.raises(DataError):
        list(read_examples(path))
    with pytest.raises(ValueError):
        list(read_examples(path, batch=0))


def test_decode_batch_of_nothing_and_of_empty_examples():
    assert decode_batch([]) == {} and decode_batch([]).count == 0
    b = decode_batch([b"", b""], keys=["a"])
    assert b.count == 2 and b["a"] == [None, None]


# --------------------------------------------------------------------------- property

values = st.one_of(
    st.binary(max_size=40).map(lambda b: [b]),
    st.lists(st.binary(max_size=5), min_size=1, max_size=3),
    st.lists(st.integers(-(2 ** 63), 2 ** 63 - 1), min_size=1, max_size=4).map(lambda v: np.array(v, np.int64)),
    st.lists(st.floats(width=32, allow_nan=False), max_size=5).map(lambda v: np.array(v, np.float32)),
)


@st.composite
def datasets(draw):
    """Records of one schema (the numpy path) with, sometimes, per-record deviations."""
    keys = draw(st.lists(st.sampled_from(["a", "b", "image/x", "é"]), min_size=1, max_size=4, unique=True))
    kinds = {k: draw(st.sampled_from(["bytes", "int", "float"])) for k in keys}
    n = draw(st.integers(1, 12))
    records = []
    for _ in range(n):
        feats = {}
        for k in keys:
            if draw(st.integers(0, 9)) == 0:
                continue  # a record lacking a key
            kind = kinds[k]
            if kind == "bytes":
                feats[k] = draw(st.binary(max_size=draw(st.sampled_from([3, 200]))))
            elif kind == "int":
                feats[k] = np.array(draw(st.lists(st.integers(-(2 ** 63), 2 ** 63 - 1), min_size=1, max_size=2)))
            else:
                feats[k] = np.array(draw(st.lists(st.floats(width=32, allow_nan=False), max_size=3)), np.float32)
        if draw(st.integers(0, 19)) == 0:
            feats["z"] = draw(values)
        records.append(encode_example(feats))
    return records


@settings(max_examples=150)
@given(datasets(), st.integers(1, 5), st.integers(0, 10 ** 6), st.sampled_from(["none", "flip", "cut"]))
def test_property_rows_equal_decode_example_even_when_damaged(tmp_path_factory, records, batch, where, damage):
    path = tmp_path_factory.mktemp("batch") / "p.tfrecord"
    write_records(path, records)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[where % len(data)] ^= 0x04
    elif damage == "cut":
        data = data[:where % len(data)]
    path.write_bytes(bytes(data))
    want_damage, got_damage = [], []
    want = [decode_example(r) for r in read_records(path, on_damage=want_damage.append)]
    got = rows(read_examples(path, batch=batch, on_damage=got_damage.append))
    assert_same_rows(got, want)
    assert got_damage == want_damage


def test_records_of_very_different_sizes_in_one_span(tmp_path):
    # small records, then large ones: spans of mixed sizes, template checks that fail midway
    records = [encode_example({"x": b"s" * 10})] * 20 + [encode_example({"x": b"L" * 50000})] * 20
    path = tmp_path / "growing.tfrecord"
    write_records(path, records)
    got = rows(read_examples(path, batch=8))
    assert_same_rows(got, expected(path))
    assert [r["x"][0][:1] for r in got] == [b"s"] * 20 + [b"L"] * 20
