"""Example / SequenceExample encoding: values survive, and the fast decoder agrees with protobuf."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.core.errors import DataError
from data_tools.example import (
    Example,
    decode_example,
    decode_sequence_example,
    encode_example,
    encode_sequence_example,
    feature_value,
)


def protobuf_decode(data):
    msg = Example()
    msg.ParseFromString(data)
    return {k: feature_value(f) for k, f in msg.features.feature.items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], list):
            assert a[k] == b[k], k
        else:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def test_multi_valued_features_round_trip():
    data = encode_example({
        "image/encoded": b"\x89PNG...",
        "names": ["a", "bé", ""],
        "label": 7,
        "ids": [1, -2, 2**62, -(2**63)],
        "score": 0.5,
        "box": np.array([[0.1, 0.2], [0.3, 0.4]], dtype=np.float64),
        "empty_floats": np.array([], dtype=np.float32),
    })
    got = decode_example(data)
    assert got["image/encoded"] == [b"\x89PNG..."]
    assert got["names"] == [b"a", "bé".encode(), b""]
    assert got["label"].tolist() == [7] and got["label"].dtype == np.int64
    assert got["ids"].tolist() == [1, -2, 2**62, -(2**63)]
    assert got["score"].dtype == np.float32 and got["score"].tolist() == [0.5]
    np.testing.assert_array_equal(got["box"], np.float32([0.1, 0.2, 0.3, 0.4]))
    assert got["empty_floats"].size == 0
    assert_same(got, protobuf_decode(data))
    assert decode_example(data, keys=["label", "missing"]).keys() == {"label"}


def test_non_canonical_wire_layout_falls_back_to_protobuf():
    # Unpacked int64 (tag 0x08) and a repeated map key: legal protobuf the fast path does not take.
    # entry value Feature{int64_list{value: 5 (unpacked), value: 6 (unpacked)}}
    feature = bytes([0x1A, 4, 0x08, 5, 0x08, 6])
    entry = bytes([0x0A, 1]) + b"x" + bytes([0x12, len(feature)]) + feature
    features = bytes([0x0A, len(entry)]) + entry
    example = bytes([0x0A, len(features)]) + features
    assert decode_example(example)["x"].tolist() == [5, 6]


def test_garbage_is_a_data_error():
    with pytest.raises(DataError, match="not a valid tf.train.Example"):
        decode_example(b"\x0a\xff\xff\xff\x0f garbage")


def test_empty_list_needs_a_dtype():
    with pytest.raises(ValueError, match="empty list"):
        encode_example({"x": []})


def test_sequence_example_round_trip():
    data = encode_sequence_example(
        {"id": b"clip-1", "length": 3},
        {"tokens": [[1, 2], [3], [4, 5, 6]], "frames": [b"a", b"b", b"c"], "w": [[0.5], [1.5, 2.5], [3.0]]},
    )
    context, lists = decode_sequence_example(data)
    assert context["id"] == [b"clip-1"] and context["length"].tolist() == [3]
    assert [v.tolist() for v in lists["tokens"]] == [[1, 2], [3], [4, 5, 6]]
    assert lists["frames"] == [[b"a"], [b"b"], [b"c"]]
    assert [v.tolist() for v in lists["w"]] == [[0.5], [1.5, 2.5], [3.0]]


# Records decoded one after another share the layout cache; small key and value spaces make
# neighbouring records often, but not always, share entry headers.
small_values = st.one_of(
    st.binary(max_size=3),
    st.lists(st.binary(max_size=2), min_size=0, max_size=2),
    st.integers(-3, 200),
    st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=2),
    st.lists(st.floats(width=32, allow_nan=False), min_size=0, max_size=2),
)
small_examples = st.dictionaries(st.sampled_from(["a", "b", "image/encoded"]), small_values, max_size=3)


@settings(max_examples=150)
@given(st.lists(small_examples, min_size=1, max_size=8), st.sampled_from([None, ["a"], ["b", "image/encoded"]]))
def test_sequences_of_records_decode_like_protobuf(dicts, keys):
    for d in dicts:
        if any(isinstance(v, list) and not v for v in d.values()):
            continue  # an empty Python list has no type to encode
        data = encode_example(d)
        want = protobuf_decode(data)
        if keys is not None:
            want = {k: v for k, v in want.items() if k in keys}
        assert_same(decode_example(data, keys), want)
        # the same bytes cut short must never decode from a cached header
        if len(data) > 2:
            try:
                cut = decode_example(data[:-1], keys)
            except DataError:
                continue
            assert_same(cut, {k: v for k, v in protobuf_decode_or_none(data[:-1]).items()
                              if keys is None or k in keys})


def protobuf_decode_or_none(data):
    try:
        return protobuf_decode(data)
    except Exception:
        return {}


def test_encoding_is_byte_deterministic_whatever_the_key_order_or_hash_seed():
    """An Example's features are a protobuf map: without deterministic serialization its order
    follows the insertion order and the process's hash seed, so the same images converted twice
    gave shards with other bytes (and other sha256 in every manifest downstream)."""
    import os
    import subprocess
    import sys

    features = {"image/encoded": b"\x89PNG" * 8, "image/format": b"png", "image/class/label": 3,
                "image/height": 5, "image/width": 7, "image/mean": [0.5, 0.25]}
    reordered = dict(reversed(list(features.items())))
    assert encode_example(features) == encode_example(reordered)
    assert encode_sequence_example(features, {"b": [1, 2], "a": [3, 4]}) == \
        encode_sequence_example(reordered, {"a": [3, 4], "b": [1, 2]})
    code = ("import hashlib; from data_tools.example import encode_example; "
            f"print(hashlib.sha256(encode_example({features!r})).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2", "3")}
    assert len(digests) == 1, digests
