"""Batched decoding: many tf.train.Example records at once into columns (one per feature key).

`read_examples(path, keys=..., batch=256)` reads verified records exactly as `read_records`
does (same CRC checks, same lossless resynchronisation, same `on_damage` reports, same strict
errors) and decodes each batch into columns, like TensorFlow's `parse_example`:

- a float or int64 feature that every record of the batch holds with the same number of values
  n -> a 2-D numpy array of shape (records, n) (np.float32 / np.int64);
- a bytes feature -> a list with one list[bytes] per record;
- otherwise (counts differ, or some records lack the key) -> a list with one value per record,
  None where a record lacks the key.

Row i of every column equals `decode_example(record_i)[key]` (None where the key is absent).
Each batch is an `ExampleBatch`: that dict of columns, plus `.count`, its number of records.
With `keys` given, every requested key has a column (all None where no record holds it).
Why a batch: a pure-Python per-record walk costs ~6 us; here the first record's entries are
parsed once and every other record is checked against that template with a few numpy
operations per feature, so the per-record Python work is slicing out the bytes values.
Batches whose records do not share one canonical layout (same keys in the same order, one
payload per feature) are decoded record by record with `decode_example`: same values, slower.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Iterator

import numpy as np

from data_tools.example import NotCanonical, FEATURE_NAMES, packed_int64, decode_example
from data_tools.spans import joined
from data_tools.tfrecord import DamagedRange, read_record_spans

_U8 = np.uint8
_I64 = np.int64


class ExampleBatch(dict):
    """{key: column} for `count` records (a dict; `count` also holds when there are no columns)."""

    def __init__(self, columns, count: int):
        super().__init__(columns)
        self.count = count


class Irregular(Exception):
    """The batch does not share one canonical layout: decode it record by record."""


def read_examples(
    path: str | os.PathLike,
    keys: Iterable[str] | None = None,
    *,
    batch: int = 256,
    strict: bool = False,
    compression: str | None = "auto",
    on_damage: Callable[[DamagedRange], None] | None = None,
) -> Iterator[ExampleBatch]:
    """Yield {key: column} for each run of up to `batch` verified records (see module docstring).

    keys limits the decoded features (the others are checked, not turned into values); None: all.
    Every column of one batch has the same length: the number of records in that batch.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, not {batch}")
    wanted = None if keys is None else tuple(dict.fromkeys(keys))
    for blob, starts, ends, _ in read_record_spans(path, batch=batch, strict=strict, compression=compression,
                                                   on_damage=on_damage):
        yield _decode_spans_or_each(blob, starts, ends, wanted)


def decode_batch(records: list[bytes], keys: Iterable[str] | None = None) -> ExampleBatch:
    """Columns for a list of serialized tf.train.Example records (see the module docstring)."""
    blob, starts, ends, _ = joined(list(records))
    return _decode_spans_or_each(blob, starts, ends, None if keys is None else tuple(dict.fromkeys(keys)))


def _decode_spans_or_each(blob, starts, ends, keys):
    """keys: None, or the requested keys in order without repeats."""
    count = len(starts)
    wanted = None if keys is None else frozenset(keys)
    columns = None
    if count:
        try:
            columns = decode_spans(blob, starts, ends, wanted)
        except (Irregular, NotCanonical, IndexError):
            pass  # out-of-range positions come from lengths that do not fit: not canonical
    if columns is None:
        columns = _decode_each([blob[a:b] for a, b in zip(starts.tolist(), ends.tolist())], wanted)
    if keys is not None:
        columns = {key: columns[key] if key in columns else [None] * count for key in keys}
    return ExampleBatch(columns, count)


def _decode_each(records, keys):
    """Slow path: decode_example per record, then the same column rules."""
    rows = [decode_example(r, keys) for r in records]
    out = {}
    for key in dict.fromkeys(k for row in rows for k in row):
        values = [row.get(key) for row in rows]
        first = values[0]
        if isinstance(first, np.ndarray) and all(
                isinstance(v, np.ndarray) and v.dtype == first.dtype and v.shape == first.shape for v in values):
            out[key] = np.stack(values)
        else:
            out[key] = values
    return out


def _scalar_varint(blob, i, limit):
    """One varint of up to 3 bytes at blob[i] -> (value, width); Irregular past limit or longer."""
    value = 0
    for width in (1, 2, 3):
        if i + width > limit:
            raise Irregular
        b = blob[i + width - 1]
        value |= (b & 0x7F) << (7 * (width - 1))
        if b < 0x80:
            return value, width
    raise Irregular  # lengths of 2 MiB or more: decode_example handles them


def _entry_layout(blob, pos, limit):
    """Row 0's map entry at pos, parsed in Python: the template the other rows are checked against.

    Canonical single-payload layout only: 0a L1 {0a KL key 12 L2 {tag L3 {0a S payload}}}.
    Returns (header length, key bytes, tag, payload size S, [(column, width)] of L1 L2 L3 S).
    """
    if pos >= limit or blob[pos] != 0x0A:
        raise Irregular
    varints = []
    i = pos + 1
    l1, w = _scalar_varint(blob, i, limit)
    varints.append((i - pos, w))
    i += w
    entry_end = i + l1
    if entry_end > limit or i + 2 > entry_end or blob[i] != 0x0A or blob[i + 1] >= 0x80:
        raise Irregular
    kl = blob[i + 1]
    key = blob[i + 2:i + 2 + kl]
    i += 2 + kl
    if i >= entry_end or blob[i] != 0x12:
        raise Irregular
    l2, w = _scalar_varint(blob, i + 1, entry_end)
    varints.append((i + 1 - pos, w))
    i += 1 + w
    if i + l2 != entry_end or i >= entry_end:
        raise Irregular  # a Feature with no list set, or trailing fields
    tag = blob[i]
    if tag not in (0x0A, 0x12, 0x1A):
        raise Irregular
    l3, w = _scalar_varint(blob, i + 1, entry_end)
    varints.append((i + 1 - pos, w))
    i += 1 + w
    if i + l3 != entry_end or i >= entry_end or blob[i] != 0x0A:
        raise Irregular  # an empty list, unpacked numbers or an unknown field
    size, w = _scalar_varint(blob, i + 1, entry_end)
    varints.append((i + 1 - pos, w))
    i += 1 + w
    if i + size != entry_end:
        raise Irregular  # several byte strings or several packed runs
    if tag == 0x12 and size & 3:
        raise Irregular
    return i - pos, key, tag, size, varints


_ARANGE = np.arange(64)
_ONE_TO_3 = np.arange(1, 4)


def decode_spans(blob, starts, ends, keys):
    """Fast path: every record blob[starts[r]:ends[r]] has row 0's layout; raises Irregular otherwise.

    Row 0 is parsed in Python into a template per feature entry; every other row is checked
    against it in a few numpy operations per entry: headers identical byte for byte (fixed-size
    features), or identical except the four length varints, which are then decoded and checked
    to describe exactly the same nesting (variable-size features). Everything is bounded by
    where each record ends, so the accepted layout is a subset of what decode_example's fast
    path accepts and the values are its values.
    """
    buf = np.frombuffer(blob, _U8)
    first_end = int(ends[0])
    if not (ends > starts).all():
        raise Irregular  # an empty record decodes to {}
    # Example.features: 0a LEN, the LEN (1-3 bytes, widths may differ) running to the record's end
    if not (buf[starts] == 0x0A).all():
        raise Irregular
    head = buf[starts[:, None] + _ONE_TO_3].astype(_I64)
    c0 = head[:, 0] >= 0x80
    c01 = c0 & (head[:, 1] >= 0x80)
    if (c01 & (head[:, 2] >= 0x80)).any():
        raise Irregular
    length = (head[:, 0] & 0x7F) | np.where(c0, (head[:, 1] & 0x7F) << 7, 0) | np.where(c01, head[:, 2] << 14, 0)
    o = starts + 2 + c0 + c01
    if not (o + length == ends).all():
        raise Irregular
    out = {}
    seen = set()
    while True:
        p = int(o[0])
        if p >= first_end:
            break
        h, kb, tag, size, varints = _entry_layout(blob, p, first_end)
        key = FEATURE_NAMES.get(kb)
        if key is None:
            try:
                key = kb.decode()
            except UnicodeDecodeError:
                raise Irregular from None
        if key in seen:
            raise Irregular  # a repeated key: the last one wins, leave that to decode_example
        seen.add(key)
        cols = _ARANGE[:h] if h <= 64 else np.arange(h)
        window = buf[o[:, None] + cols]
        if (window == window[0]).all():
            k = o + h
            sizes = None
            o = k + size
        else:
            k, sizes = _variable_entry(blob, buf, o, ends, window, h, kb, tag, varints)
            o = k + sizes
        if keys is not None and key not in keys:
            continue
        out[key] = _column(blob, buf, tag, k, o, size, sizes)
    if not (o == ends).all():
        raise Irregular  # some record holds more or fewer features than row 0
    return out


def _variable_entry(blob, buf, o, ends, window, h, kb, tag, varints):
    """Payload starts and sizes of an entry whose size varies: row 0's template except the lengths.

    Rows whose lengths have other widths (sizes on both sides of 128 or 16384 bytes, as JPEGs
    are) get a template of their own, parsed from the first such row: up to four templates.
    """
    ok, sizes = _fit(window, varints, h)
    k = o + h
    todo = ~ok
    for _ in range(3):
        rows = np.flatnonzero(todo)
        if not len(rows):
            return k, sizes
        r = int(rows[0])
        h2, kb2, tag2, _, varints2 = _entry_layout(blob, int(o[r]), int(ends[r]))
        if kb2 != kb or tag2 != tag:
            raise Irregular
        at = o[rows]
        ok2, sizes2 = _fit(buf[at[:, None] + np.arange(h2)], varints2, h2)
        if not ok2[0]:
            raise Irregular
        done = rows[ok2]
        k[done] = at[ok2] + h2
        sizes[done] = sizes2[ok2]
        todo[done] = False
    if todo.any():
        raise Irregular
    return k, sizes


def _fit(window, varints, h):
    """Which rows equal row 0 except at the varints L1 L2 L3 S, with row 0's widths, and nest
    exactly (each Lx equals S plus the header bytes after it); and every row's S."""
    varcols = [c + i for c, w in varints for i in range(w)]
    const = np.ones(window.shape[1], bool)
    const[varcols] = False
    ok = (window[:, const] == window[0, const]).all(axis=1)
    raw = window[:, varcols].astype(_I64)
    cont = raw >= 0x80
    ok &= (cont == cont[0]).all(axis=1)
    values = []
    j = 0
    for c, w in varints:
        v = raw[:, j] & 0x7F
        for i in range(1, w):
            v = v | ((raw[:, j + i] & 0x7F) << (7 * i))
        values.append(v)
        j += w
    size = values[-1]
    for (c, w), v in zip(varints[:-1], values[:-1]):
        ok &= v - size == h - (c + w)
    return ok, size


def _column(blob, buf, tag, k, end, size, sizes):
    """One feature's column; sizes is None when every row's payload is `size` bytes."""
    if sizes is not None and tag != 0x0A and (sizes == sizes[0]).all():
        size, sizes = int(sizes[0]), None  # one size after all (lengths written with extra bytes)
    if tag == 0x0A:  # bytes: one list[bytes] per record
        return [[blob[a:b]] for a, b in zip(k.tolist(), end.tolist())]
    if sizes is not None:  # numbers whose counts vary: one array per record
        if tag == 0x12:
            if (sizes & 3).any():
                raise Irregular  # not whole float32s: decode_example's protobuf path decides
            return [np.frombuffer(blob, "<f4", (b - a) >> 2, a).astype(np.float32)
                    for a, b in zip(k.tolist(), end.tolist())]
        return _stack_if_even([packed_int64(blob, a, b) for a, b in zip(k.tolist(), end.tolist())])
    raw = buf[k[:, None] + (_ARANGE[:size] if size <= 64 else np.arange(size))]
    if tag == 0x12:  # float32, packed little endian
        return raw.view("<f4").astype(np.float32, copy=False)
    cont = raw >= 0x80
    if size and (cont == cont[0]).all() and not cont[0, -1]:
        # every row splits into varints at the same places: decode all rows at once (uint64
        # arithmetic wraps exactly like the two's complement TensorFlow writes for negatives)
        ends_at = np.flatnonzero(~cont[0])
        values = np.zeros((len(k), len(ends_at)), np.uint64)
        begin = 0
        for col, last in enumerate(ends_at.tolist()):
            for i in range(begin, last + 1):
                values[:, col] |= (raw[:, i].astype(np.uint64) & np.uint64(0x7F)) << np.uint64(7 * (i - begin))
            begin = last + 1
        if not (ends_at - np.concatenate(([-1], ends_at[:-1])) <= 10).all():
            raise Irregular  # a varint over 10 bytes is not an int64
        return values.view(_I64)
    return _stack_if_even([packed_int64(blob, a, b) for a, b in zip(k.tolist(), end.tolist())])


def _stack_if_even(values):
    """Equal counts in every row -> one 2-D array, as the column rules say; else the list."""
    if all(len(v) == len(values[0]) for v in values):
        return np.stack(values)
    return values
