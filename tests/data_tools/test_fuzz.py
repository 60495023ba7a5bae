"""Fuzzing the reader: seeded random damage to a few hundred plain, GZIP and ZLIB files.

For every file: no exception but TFRecordError (strict) and none at all (lossless); no record
that was not written; every record whose bytes were not touched comes out (plain files); every
record decodable before the first damage comes out, in order (GZIP/ZLIB: the oracle decodes the
damaged stream one byte at a time, independently of the reader); and the records of a gzip
member that the damage did not touch come out too (the reader resumes at the next member).
"""

import struct
import zlib

import numpy as np
import pytest

from data_tools.tfrecord import TFRecordError, frame, masked_crc, read_record_spans, read_records

SEED = 18
PLAIN_FILES = 240
COMPRESSED_FILES = 160


def make_records(rng):
    records = []
    for _ in range(int(rng.integers(1, 40))):
        kind = rng.integers(0, 4)
        size = int(rng.integers(0, 3000))
        if kind == 0:
            records.append(rng.bytes(size))
        elif kind == 1:  # compressible, like protobuf with repeated keys
            records.append((b"image/class/label %d " % rng.integers(0, 10)) * (size // 20 + 1))
        elif kind == 2:
            records.append(bytes(size))
        else:
            records.append(rng.bytes(int(rng.integers(0, 20))))
    return records


def fake_header(rng):
    """A header whose length CRC is valid, claiming a length that does not follow."""
    length = struct.pack("<Q", int(rng.choice([(1 << 31) - 1, 1 << 40, int(rng.integers(1, 1 << 20))])))
    return length + struct.pack("<I", masked_crc(length))


def mutate(rng, data: bytes, spans: list[tuple[int, int]], kinds):
    """Apply 1-4 random mutations; returns the bytes and, per span, whether any mutation touched it."""
    data = bytearray(data)
    spans = [list(s) for s in spans]
    touched = [False] * len(spans)
    for _ in range(int(rng.integers(1, 5))):
        if not data:
            break
        kind = kinds[int(rng.integers(0, len(kinds)))]
        p = int(rng.integers(0, len(data)))
        k = int(rng.integers(1, 64)) if rng.random() < 0.8 else int(rng.integers(64, 20_000))
        if kind in ("flip", "overwrite", "zeros"):
            k = 1 if kind == "flip" else min(k, len(data) - p)
            if kind == "flip":
                data[p] ^= 1 << int(rng.integers(0, 8))
            else:
                data[p:p + k] = rng.bytes(k) if kind == "overwrite" else bytes(k)
            hit, shift_from, shift = (p, p + k), None, 0
        elif kind in ("insert", "fake_header", "duplicate", "zero_block"):
            if kind == "insert":
                junk = rng.bytes(k)
            elif kind == "fake_header":
                junk = fake_header(rng)
            elif kind == "zero_block":
                junk = bytes(int(rng.integers(1, 1 << 18)))
            else:
                a = int(rng.integers(0, len(data)))
                junk = bytes(data[a:a + k])
            data[p:p] = junk
            hit, shift_from, shift = (p, p), p, len(junk)
        elif kind == "delete":
            k = min(k, len(data) - p)
            del data[p:p + k]
            hit, shift_from, shift = (p, p + k), p + k, -k
        else:  # truncate
            del data[p:]
            hit, shift_from, shift = (p, 1 << 62), None, 0
        a, b = hit
        for i, (s, e) in enumerate(spans):
            if (s < b and a < e) if a != b else (s < a < e):
                touched[i] = True
            if shift_from is not None and s >= shift_from:
                spans[i] = [s + shift, e + shift]
    return bytes(data), touched


def is_subsequence(small, big):
    it = iter(big)
    return all(any(x == y for y in it) for x in small)


def read_both_ways(path, compression="auto"):
    """Lossless records and damage, and what strict mode yields before it raises (it may only raise
    TFRecordError, after the same records lossless reading gives first)."""
    damage = []
    got = list(read_records(path, compression=compression, on_damage=damage.append))
    strict = []
    try:
        for record in read_records(path, compression=compression, strict=True):
            strict.append(record)
    except TFRecordError:
        pass
    assert strict == got[:len(strict)]
    return got, damage


@pytest.mark.parametrize("chunk", range(4))
def test_damaged_plain_files(tmp_path, chunk):
    rng = np.random.default_rng([SEED, chunk])
    kinds = ("flip", "overwrite", "zeros", "insert", "fake_header", "duplicate", "zero_block", "delete",
             "truncate")
    for n in range(PLAIN_FILES // 4):
        records = make_records(rng)
        frames = [frame(r) for r in records]
        spans, pos = [], 0
        for f in frames:
            spans.append((pos, pos + len(f)))
            pos += len(f)
        mutated, touched = mutate(rng, b"".join(frames), spans, kinds)
        path = tmp_path / f"{n}.tfrecord"
        path.write_bytes(mutated)
        got, damage = read_both_ways(path, compression=None)
        originals = set(records)
        assert all(r in originals for r in got), n
        assert is_subsequence([r for r, t in zip(records, touched) if not t], got), n
        last = 0
        for d in damage:  # in order, not overlapping, inside the file
            assert last <= d.start < d.end <= len(mutated), (n, d)
            last = d.end
        # the batched path (verified spans) gives the same records and damage
        spans_damage = []
        batched = [blob[a:b] for blob, starts, ends, _ in read_record_spans(
            path, batch=int(rng.integers(1, 9)), compression=None, on_damage=spans_damage.append)
            for a, b in zip(starts.tolist(), ends.tolist())]
        assert batched == got and spans_damage == damage, n


def decodable_prefix(compressed: bytes, wbits: int) -> bytes:
    """What the damaged stream decodes to before its first error, one byte at a time (the oracle)."""
    out, z = [], zlib.decompressobj(wbits)
    for i in range(len(compressed)):
        try:
            out.append(z.decompress(compressed[i:i + 1]))
        except zlib.error:
            break
        if z.eof:
            if wbits == 31 and compressed[i + 1:i + 3] == b"\x1f\x8b":
                z = zlib.decompressobj(wbits)  # the next member of the same stream
            else:
                break
    return b"".join(out)


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_damaged_compressed_files(tmp_path, compression):
    rng = np.random.default_rng([SEED, len(compression)])
    wbits = 31 if compression == "GZIP" else 15
    kinds = ("flip", "flip", "overwrite", "zeros", "insert", "delete", "truncate")
    for n in range(COMPRESSED_FILES // 2):
        records = make_records(rng)
        frames = [frame(r) for r in records]
        body = b"".join(frames)
        # GZIP: 1-3 members, each compressing whole records, as `cat a.gz b.gz` makes
        cuts = sorted(set([0, len(records)] + (rng.integers(0, len(records) + 1, 2).tolist()
                                               if compression == "GZIP" else [])))
        members, member_spans, member_records, pos = [], [], [], 0
        for a, b in zip(cuts, cuts[1:]):
            z = zlib.compressobj(int(rng.integers(1, 10)), zlib.DEFLATED, wbits)
            members.append(z.compress(b"".join(frames[a:b])) + z.flush())
            member_spans.append((pos, pos + len(members[-1])))
            member_records.append(records[a:b])
            pos += len(members[-1])
        mutated, touched = mutate(rng, b"".join(members), member_spans, kinds)
        path = tmp_path / f"{n}.tfrecord"
        path.write_bytes(mutated)
        got, damage = read_both_ways(path)
        originals = set(records)
        assert all(r in originals for r in got), n
        # every record that decodes before the first damage comes out first, in order
        prefix = decodable_prefix(mutated, wbits)
        m = min(len(prefix), len(body))
        differs = np.frombuffer(prefix, np.uint8, m) != np.frombuffer(body, np.uint8, m)
        first_damage = int(np.argmax(differs)) if differs.any() else m
        ends = np.cumsum([len(f) for f in frames])
        k = int(np.searchsorted(ends, first_damage, side="right"))
        assert got[:k] == records[:k], (n, k, len(got))
        # a gzip member after the damage that no mutation touched comes out whole
        first_touched = touched.index(True) if True in touched else len(touched)
        for m in range(first_touched + 1, len(members)):
            if not touched[m]:
                assert is_subsequence(member_records[m], got), (n, m)
        if damage and mutated != b"".join(members):
            assert any(d.compressed_start is not None or d.start < d.end for d in damage)
