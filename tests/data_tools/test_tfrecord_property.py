"""Property: whatever a mutation does to a file, the reader neither crashes nor hangs, and delivers
every record the mutation did not touch (and nothing that was not written)."""

import gzip
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from data_tools.tfrecord import frame, read_records

records_st = st.lists(st.binary(min_size=0, max_size=300), min_size=0, max_size=12)


@st.composite
def mutated_files(draw):
    records = draw(records_st)
    frames = [frame(r) for r in records]
    body = b"".join(frames)
    spans, pos = [], 0
    for f in frames:
        spans.append((pos, pos + len(f)))
        pos += len(f)
    kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "overwrite", "zero_length"]))
    p = draw(st.integers(0, len(body)))
    if kind == "flip" and not body:
        kind = "insert"
    if kind == "flip":
        p = min(p, len(body) - 1)
        bit = draw(st.integers(0, 7))
        mutated = body[:p] + bytes([body[p] ^ (1 << bit)]) + body[p + 1:]
        touched = (p, p + 1)
    elif kind == "insert":
        junk = draw(st.binary(min_size=1, max_size=400))
        mutated = body[:p] + junk + body[p:]
        touched = (p, p)  # a record is touched when the insertion lands strictly inside it
    elif kind in ("delete", "overwrite"):
        k = draw(st.integers(1, 64))
        if kind == "delete":
            mutated = body[:p] + body[p + k:]
        else:
            mutated = body[:p] + draw(st.binary(min_size=k, max_size=k)) + body[p + k:]
        touched = (p, p + k)
    elif kind == "truncate":
        mutated = body[:p]
        touched = (p, len(body) + 1)
    else:  # a 16-byte zero-length record spliced in at a record boundary is a valid record
        bounds = [0] + [end for _, end in spans]
        p = draw(st.sampled_from(bounds))
        mutated = body[:p] + frame(b"") + body[p:]
        records = records[: bounds.index(p)] + [b""] + records[bounds.index(p):]
        return records, mutated, [False] * len(records)
    a, b = touched
    hit = [(s < b and a < e) if a != b else (s < a < e) for s, e in spans]
    return records, mutated, hit


def is_subsequence(small, big):
    it = iter(big)
    return all(any(x == y for y in it) for x in small)


@settings(max_examples=200)
@given(mutated_files())
def test_mutations_never_lose_an_untouched_record(tmp_path_factory, case):
    records, mutated, hit = case
    path = tmp_path_factory.mktemp("prop") / "m.tfrecord"
    path.write_bytes(mutated)
    damage = []
    got = list(read_records(path, compression=None, on_damage=damage.append))
    intact = [r for r, h in zip(records, hit) if not h]
    assert is_subsequence(intact, got)
    assert is_subsequence(got, records)  # never a record that was not written
    for d in damage:
        assert 0 <= d.start < d.end <= len(mutated)
    # the same bytes inside a GZIP stream read the same (offsets are in the decompressed stream)
    gz = path.with_suffix(".gz")
    gz.write_bytes(gzip.compress(mutated))
    gz_damage = []
    assert list(read_records(gz, compression="GZIP", on_damage=gz_damage.append)) == got
    assert [(d.start, d.end, d.reason) for d in gz_damage] == [(d.start, d.end, d.reason) for d in damage]


@settings(max_examples=50)
@given(st.binary(min_size=0, max_size=5000))
def test_arbitrary_bytes_never_crash(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("junk") / "j.tfrecord"
    path.write_bytes(data)
    damage = []
    list(read_records(path, on_damage=damage.append))
    assert sum(d.end - d.start for d in damage) <= len(data)
    assert all(0 <= d.start <= d.end for d in damage)  # an empty range: a compressed stream broke off there


def test_large_random_file_scans_quickly(tmp_path):
    path = tmp_path / "noise"
    path.write_bytes(os.urandom(8 << 20))
    damage = []
    assert list(read_records(path, on_damage=damage.append)) == []
    assert damage[0].start == 0 and damage[-1].end == 8 << 20
