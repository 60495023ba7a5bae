"""tf.train.Example and SequenceExample encoding and decoding, without TensorFlow or protoc.

The message classes are built at import from a FileDescriptorProto that mirrors
tensorflow/core/example/{feature,example}.proto field for field, so the bytes on the wire are
TensorFlow's. They live in a private descriptor pool under a private package name, so they
never clash with TensorFlow's own classes if both are imported.

Decoded values: bytes_list -> list[bytes], float_list -> np.float32 array,
int64_list -> np.int64 array (a feature with no list set decodes as an empty list).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from appliance.core.errors import DataError

_PACKAGE = "appliance_tfexample"


def _build_classes() -> dict[str, type]:
    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="appliance_tfexample.proto", package=_PACKAGE, syntax="proto3")

    def message(name, *fields, nested=()):
        msg = file.message_type.add(name=name)
        for field in fields:
            msg.field.add().CopyFrom(field)
        for sub in nested:
            msg.nested_type.add().CopyFrom(sub)
        return msg

    def field(name, number, type_, label=F.LABEL_OPTIONAL, type_name=None, oneof=None):
        f = F(name=name, number=number, type=type_, label=label, json_name=name)
        if type_name:
            f.type_name = f".{_PACKAGE}.{type_name}"
        if oneof is not None:
            f.oneof_index = oneof
        return f

    def map_entry(entry_name, value_type):
        entry = descriptor_pb2.DescriptorProto(name=entry_name)
        entry.field.add().CopyFrom(field("key", 1, F.TYPE_STRING))
        entry.field.add().CopyFrom(field("value", 2, F.TYPE_MESSAGE, type_name=value_type))
        entry.options.map_entry = True
        return entry

    rep = F.LABEL_REPEATED
    message("BytesList", field("value", 1, F.TYPE_BYTES, rep))
    message("FloatList", field("value", 1, F.TYPE_FLOAT, rep))  # proto3: packed by default
    message("Int64List", field("value", 1, F.TYPE_INT64, rep))
    feature = message(
        "Feature",
        field("bytes_list", 1, F.TYPE_MESSAGE, type_name="BytesList", oneof=0),
        field("float_list", 2, F.TYPE_MESSAGE, type_name="FloatList", oneof=0),
        field("int64_list", 3, F.TYPE_MESSAGE, type_name="Int64List", oneof=0),
    )
    feature.oneof_decl.add(name="kind")
    message("Features", field("feature", 1, F.TYPE_MESSAGE, rep, "Features.FeatureEntry"),
            nested=[map_entry("FeatureEntry", "Feature")])
    message("FeatureList", field("feature", 1, F.TYPE_MESSAGE, rep, "Feature"))
    message("FeatureLists", field("feature_list", 1, F.TYPE_MESSAGE, rep, "FeatureLists.FeatureListEntry"),
            nested=[map_entry("FeatureListEntry", "FeatureList")])
    message("Example", field("features", 1, F.TYPE_MESSAGE, type_name="Features"))
    message("SequenceExample", field("context", 1, F.TYPE_MESSAGE, type_name="Features"),
            field("feature_lists", 2, F.TYPE_MESSAGE, type_name="FeatureLists"))

    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    names = ("Feature", "Features", "FeatureList", "Example", "SequenceExample")
    return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{n}")) for n in names}


_CLASSES = _build_classes()
Example = _CLASSES["Example"]
SequenceExample = _CLASSES["SequenceExample"]
Feature = _CLASSES["Feature"]

# --------------------------------------------------------------------------- encoding


def _fill_feature(feature, key: str, value: Any) -> None:
    """Set one Feature from a Python/numpy value, inferring bytes, int64 or float."""
    if isinstance(value, (bytes, str, int, float, np.generic)):
        value = [value]
    if isinstance(value, np.ndarray):
        kind = value.dtype.kind
        flat = value.reshape(-1)
        if kind in "iub":
            feature.int64_list.value.extend(flat.astype(np.int64).tolist())
        elif kind == "f":
            feature.float_list.value.extend(flat.astype(np.float32).tolist())
        elif kind in "SO":
            feature.bytes_list.value.extend(_as_bytes(key, v) for v in flat.tolist())
        elif kind == "U":
            feature.bytes_list.value.extend(v.encode() for v in flat.tolist())
        else:
            raise ValueError(f"feature {key!r}: cannot store numpy dtype {value.dtype}")
        if flat.size == 0 and kind in "iub":
            feature.int64_list.SetInParent()
        elif flat.size == 0 and kind == "f":
            feature.float_list.SetInParent()
        elif flat.size == 0:
            feature.bytes_list.SetInParent()
        return
    values = list(value)
    if not values:
        raise ValueError(f"feature {key!r}: empty list has no type; pass np.array([], dtype=...)")
    first = values[0]
    if isinstance(first, (bytes, str)):
        feature.bytes_list.value.extend(_as_bytes(key, v) for v in values)
    elif isinstance(first, (bool, int, np.integer, np.bool_)):
        feature.int64_list.value.extend(int(v) for v in values)
    elif isinstance(first, (float, np.floating)):
        feature.float_list.value.extend(float(v) for v in values)
    else:
        raise ValueError(f"feature {key!r}: cannot store {type(first).__name__} values")


def _as_bytes(key: str, v) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode()
    raise ValueError(f"feature {key!r}: mixes bytes/str with {type(v).__name__}")


def _fill_features(features_msg, features: Mapping[str, Any]) -> None:
    for key, value in features.items():
        _fill_feature(features_msg.feature[key], key, value)


def encode_example(features: Mapping[str, Any]) -> bytes:
    """Serialize a dict to tf.train.Example bytes. Values: bytes/str/int/float, lists or np arrays of them."""
    example = Example()
    _fill_features(example.features, features)
    return example.SerializeToString(deterministic=True)


def encode_sequence_example(
    context: Mapping[str, Any], feature_lists: Mapping[str, Iterable[Any]]
) -> bytes:
    """Serialize a tf.train.SequenceExample: context features plus, per key, a list of per-step values."""
    seq = SequenceExample()
    _fill_features(seq.context, context)
    for key, steps in feature_lists.items():
        flist = seq.feature_lists.feature_list[key]
        flist.SetInParent()
        for step in steps:
            _fill_feature(flist.feature.add(), key, step)
    return seq.SerializeToString(deterministic=True)


# --------------------------------------------------------------------------- decoding

_FLOAT32 = np.float32
_INT64 = np.int64


def feature_value(feature):
    """One Feature message as list[bytes] / np.float32 array / np.int64 array."""
    kind = feature.WhichOneof("kind")
    if kind == "bytes_list":
        return list(feature.bytes_list.value)
    if kind == "int64_list":
        return np.array(feature.int64_list.value, dtype=_INT64)
    if kind == "float_list":
        return np.array(feature.float_list.value, dtype=_FLOAT32)
    return []


def _parse(cls, data: bytes):
    msg = cls()
    try:
        msg.ParseFromString(data)
    except Exception as err:  # protobuf's DecodeError types differ between implementations
        raise DataError(f"record is not a valid tf.train.{cls.__name__}: {err}") from None
    return msg


def decode_example(data: bytes, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """Decode tf.train.Example bytes to {key: value}; keys limits the result, missing keys are absent."""
    if keys is not None and not isinstance(keys, (set, frozenset, dict)):
        keys = set(keys)
    if type(data) is not bytes:
        data = bytes(data)
    try:
        return _decode_example_fast(data, keys)
    except (NotCanonical, IndexError, UnicodeDecodeError, OverflowError):
        pass
    feature_map = _parse(Example, data).features.feature
    if keys is None:
        return {key: feature_value(feature_map[key]) for key in feature_map}
    return {key: feature_value(f) for key, f in feature_map.items() if key in keys}


def decode_sequence_example(data: bytes) -> tuple[dict[str, Any], dict[str, list]]:
    """Decode SequenceExample bytes to (context dict, {key: [per-step value, ...]})."""
    seq = _parse(SequenceExample, data)
    context = {key: feature_value(f) for key, f in seq.context.feature.items()}
    lists = {
        key: [feature_value(f) for f in flist.feature]
        for key, flist in seq.feature_lists.feature_list.items()
    }
    return context, lists


# --------------------------------------------------------------------------- fast path

_f32 = np.dtype("<f4")
_i64 = np.dtype(np.int64)
_frombuffer = np.frombuffer
_array = np.array


class NotCanonical(Exception):
    """A fast decoder (here, or data_tools.batch) met a layout it does not handle; protobuf decides."""


def _varint(data, i):
    result = 0
    shift = 0
    while True:
        b = data[i]
        result |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return result, i
        shift += 7
        if shift > 63:
            raise NotCanonical

# interned feature names (key bytes -> str), shared with data_tools.batch: datasets repeat a few
FEATURE_NAMES: dict[bytes, str] = {}

# The entry headers of the last record decoded, by position: (header bytes, key, list tag,
# payload length). A record of the same dataset usually repeats them byte for byte for every
# feature whose size does not change (labels, formats, fixed-length floats), and then one
# `startswith` checks the whole header (tags, key, and the three nested lengths, which also
# fix where the entry ends) instead of ~40 bytecodes. Entries are replaced, never mutated, so
# a thread reading a stale one still reads a self-consistent header.
_layout: list[tuple[bytes, str, int, int]] = []
_MAX_LAYOUT = 64


def _decode_example_fast(data, keys):
    """Example bytes in the canonical layout TensorFlow writes -> dict; raises NotCanonical otherwise.

    Pure Python over the wire format beats building protobuf objects and reading them back.
    Anything unusual (unknown fields, repeated or unpacked fields) goes to the full parser.
    Lengths are varints; the one- and two-byte cases (< 16384) are inlined because function
    calls dominate the cost here, and a ~3 KB image needs two bytes.
    """
    n = len(data)
    if n == 0:
        return {}
    if data[0] != 0x0A:
        raise NotCanonical
    ln = data[1]
    if ln < 0x80:
        i = 2
    elif data[2] < 0x80:
        ln = (ln & 0x7F) | (data[2] << 7)
        i = 3
    else:
        ln, i = _varint(data, 1)
    if i + ln != n:
        raise NotCanonical
    out = {}
    layout = _layout
    entry = 0
    while i < n:
        if entry < len(layout):
            header, key, tag, size = layout[entry]
            if data.startswith(header, i):
                k = i + len(header)
                i = k + size
                entry += 1
                if i > n:
                    raise NotCanonical
                if keys is not None and key not in keys:
                    continue
                if tag == 0x0A:
                    out[key] = [data[k:i]]
                elif tag == 0x12:
                    out[key] = _frombuffer(data, _f32, size >> 2, k).copy()
                elif size == 1 and data[k] < 0x80:
                    out[key] = _array((data[k],), _i64)
                else:
                    out[key] = packed_int64(data, k, i)
                continue
        start = i
        # map entry: 0x0a LEN { 0x0a LEN key, 0x12 LEN Feature }
        if data[i] != 0x0A:
            raise NotCanonical
        ln = data[i + 1]
        if ln < 0x80:
            i += 2
        elif data[i + 2] < 0x80:
            ln = (ln & 0x7F) | (data[i + 2] << 7)
            i += 3
        else:
            ln, i = _varint(data, i + 1)
        end = i + ln
        if data[i] != 0x0A:
            raise NotCanonical
        kl = data[i + 1]
        if kl < 0x80:
            i += 2
        else:
            kl, i = _varint(data, i + 1)
        kb = data[i:i + kl]
        key = FEATURE_NAMES.get(kb)
        if key is None:
            key = kb.decode()
            if len(FEATURE_NAMES) < 4096:
                FEATURE_NAMES[kb] = key
        i += kl
        if data[i] != 0x12:
            raise NotCanonical
        vl = data[i + 1]
        if vl < 0x80:
            i += 2
        elif data[i + 2] < 0x80:
            vl = (vl & 0x7F) | (data[i + 2] << 7)
            i += 3
        else:
            vl, i = _varint(data, i + 1)
        if i + vl != end:
            raise NotCanonical
        if i == end:  # a Feature with no list set
            if keys is None or key in keys:
                out[key] = []
            i = end
            entry += 1
            continue
        tag = data[i]
        ln = data[i + 1]
        if ln < 0x80:
            j = i + 2
        elif data[i + 2] < 0x80:
            ln = (ln & 0x7F) | (data[i + 2] << 7)
            j = i + 3
        else:
            ln, j = _varint(data, i + 1)
        if j + ln != end or tag not in (0x0A, 0x12, 0x1A):
            raise NotCanonical
        single = False  # exactly one payload (byte string or packed run) filling the list
        if j < end:
            if data[j] != 0x0A:
                raise NotCanonical  # unpacked numbers or an unknown field
            size = data[j + 1]
            if size < 0x80:
                k = j + 2
            elif data[j + 2] < 0x80:
                size = (size & 0x7F) | (data[j + 2] << 7)
                k = j + 3
            else:
                size, k = _varint(data, j + 1)
            single = k + size == end
            if not single and tag != 0x0A:
                raise NotCanonical  # numbers in several packed runs
            if single and tag == 0x12 and size & 3:
                raise NotCanonical
        if single and entry < _MAX_LAYOUT:
            # remember this header for the next record (replace, never mutate: see _layout)
            item = (data[start:k], key, tag, size)
            if entry < len(layout):
                layout[entry] = item
            elif entry == len(layout):
                layout.append(item)
        entry += 1
        i = end
        if keys is not None and key not in keys:
            continue
        if tag == 0x0A:  # bytes_list: repeated 0x0a LEN value
            if single:
                out[key] = [data[k:end]]
                continue
            value = []
            while j < end:
                if data[j] != 0x0A:
                    raise NotCanonical
                ln = data[j + 1]
                if ln < 0x80:
                    j += 2
                elif data[j + 2] < 0x80:
                    ln = (ln & 0x7F) | (data[j + 2] << 7)
                    j += 3
                else:
                    ln, j = _varint(data, j + 1)
                value.append(data[j:j + ln])
                j += ln
            if j != end:
                raise NotCanonical
        elif not single:  # an empty number list
            value = np.zeros(0, np.float32 if tag == 0x12 else _i64)
        elif tag == 0x12:  # float_list: 0x0a LEN packed little-endian float32
            value = _frombuffer(data, _f32, size >> 2, k).copy()
        else:  # int64_list: 0x0a LEN packed varints (two's complement)
            value = packed_int64(data, k, end)
        out[key] = value
    if i != n:
        raise NotCanonical
    return out


def packed_int64(data: bytes, k: int, end: int) -> np.ndarray:
    """The int64 values of the packed varints data[k:end] (two's complement, as TensorFlow writes
    negatives); NotCanonical when the varints do not end exactly at end."""
    if end - k == 1 and data[k] < 0x80:
        return _array((data[k],), _i64)
    vals = []
    while k < end:
        v = data[k]
        if v < 0x80:
            k += 1
        else:
            v, k = _varint(data, k)
        vals.append(v - 0x10000000000000000 if v >> 63 else v)
    if k != end:
        raise NotCanonical
    return _array(vals, _i64)
