"""Framing: round trips, TensorFlow's exact bytes, and every kind of damage from the issue."""

import os
import struct

import pytest

from data_tools.tfrecord import (
    DamagedRange,
    TFRecordError,
    TFRecordWriter,
    frame,
    iter_records_with_offsets,
    masked_crc,
    read_records,
    write_records,
)

RECORDS = [f"record {i} ".encode() * (i + 1) for i in range(10)]


def offsets(records):
    out, pos = [], 0
    for r in records:
        out.append(pos)
        pos += len(r) + 16
    return out


def read_lossless(path):
    damage = []
    return list(read_records(path, on_damage=damage.append)), damage


@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
def test_round_trip_detects_compression(tmp_path, compression):
    path = tmp_path / "data.tfrecord"
    assert write_records(path, RECORDS, compression) == len(RECORDS)
    assert list(read_records(path, strict=True)) == RECORDS
    assert list(read_records(path, compression=compression)) == RECORDS


def test_known_masked_crc_and_frame_layout():
    # Masked CRC of the 8-byte length 0, as TensorFlow writes it for an empty record.
    assert frame(b"") == struct.pack("<Q", 0) + struct.pack("<I", masked_crc(bytes(8))) + struct.pack("<I", masked_crc(b""))
    assert masked_crc(b"") == 0xA282EAD8


def test_offsets_are_frame_starts(tmp_path):
    path = tmp_path / "d.tfrecord"
    write_records(path, RECORDS)
    got = list(iter_records_with_offsets(path))
    assert [(n, off) for n, off, _ in got] == list(enumerate(offsets(RECORDS)))


def test_writer_is_atomic_and_keeps_previous_file_on_error(tmp_path):
    path = tmp_path / "d.tfrecord"
    write_records(path, RECORDS[:2])
    with pytest.raises(RuntimeError):
        with TFRecordWriter(path) as w:
            w.write(b"new")
            raise RuntimeError("interrupted")
    assert list(read_records(path)) == RECORDS[:2]
    assert [p.name for p in tmp_path.iterdir()] == ["d.tfrecord"]


def test_empty_file_and_zero_length_record(tmp_path):
    empty = tmp_path / "empty.tfrecord"
    empty.write_bytes(b"")
    assert read_lossless(empty) == ([], [])
    assert list(read_records(empty, strict=True)) == []
    zero = tmp_path / "zero.tfrecord"
    write_records(zero, [b"a", b"", b"c"])
    assert read_lossless(zero) == ([b"a", b"", b"c"], [])


@pytest.mark.parametrize("i", [0, 4, 9])
def test_flipped_data_byte_loses_only_that_record(tmp_path, i):
    path = tmp_path / "d.tfrecord"
    write_records(path, RECORDS)
    raw = bytearray(path.read_bytes())
    start = offsets(RECORDS)[i]
    raw[start + 12 + 3] ^= 0x40
    path.write_bytes(raw)
    records, damage = read_lossless(path)
    assert records == RECORDS[:i] + RECORDS[i + 1:]
    end = start + len(RECORDS[i]) + 16
    assert damage == [DamagedRange(str(path), start, end, i, "data CRC mismatch")]
    with pytest.raises(TFRecordError) as err:
        list(read_records(path, strict=True))
    assert (err.value.offset, err.value.record_number) == (start, i)
    assert str(path) in str(err.value) and f"byte {start}" in str(err.value)


def test_flipped_length_byte_resynchronises(tmp_path):
    path = tmp_path / "d.tfrecord"
    write_records(path, RECORDS)
    raw = bytearray(path.read_bytes())
    start = offsets(RECORDS)[3]
    raw[start] ^= 0x01
    path.write_bytes(raw)
    records, damage = read_lossless(path)
    assert records == RECORDS[:3] + RECORDS[4:]
    assert [(d.start, d.end, d.reason) for d in damage] == [(start, offsets(RECORDS)[4], "length CRC mismatch")]
    with pytest.raises(TFRecordError, match="length CRC mismatch"):
        list(read_records(path, strict=True))


def test_absurd_length_with_valid_crc_is_a_truncation_not_an_allocation(tmp_path):
    path = tmp_path / "d.tfrecord"
    length = struct.pack("<Q", 1 << 62)
    path.write_bytes(frame(b"ok") + length + struct.pack("<I", masked_crc(length)) + b"x" * 100)
    records, damage = read_lossless(path)
    assert records == [b"ok"]
    assert damage[0].start == 18 and damage[0].end == os.path.getsize(path)
    assert "truncated record" in damage[0].reason


@pytest.mark.parametrize("cut", [1, 5, 14, 20])
def test_truncated_tail(tmp_path, cut):
    path = tmp_path / "d.tfrecord"
    write_records(path, RECORDS)
    raw = path.read_bytes()
    path.write_bytes(raw[:-cut])
    records, damage = read_lossless(path)
    assert records == RECORDS[:-1]
    assert (damage[0].start, damage[0].end, damage[0].record_number) == (offsets(RECORDS)[-1], len(raw) - cut, 9)
    with pytest.raises(TFRecordError, match="truncated"):
        list(read_records(path, strict=True))


def test_garbage_between_records(tmp_path):
    path = tmp_path / "d.tfrecord"
    garbage = os.urandom(5000)
    body = b"".join(frame(r) for r in RECORDS[:5]) + garbage + b"".join(frame(r) for r in RECORDS[5:])
    path.write_bytes(body)
    records, damage = read_lossless(path)
    assert records == RECORDS
    garbage_start = offsets(RECORDS)[5]
    assert [(d.start, d.end) for d in damage] == [(garbage_start, garbage_start + len(garbage))]


def test_random_bytes_file(tmp_path):
    path = tmp_path / "noise.tfrecord"
    path.write_bytes(os.urandom(200_000))
    records, damage = read_lossless(path)
    assert records == []
    assert (damage[0].start, damage[-1].end) == (0, 200_000)
    with pytest.raises(TFRecordError):
        list(read_records(path, strict=True))


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_truncated_compressed_file_keeps_intact_prefix(tmp_path, compression):
    path = tmp_path / "d.tfrecord.gz"
    write_records(path, [os.urandom(3000) for _ in range(50)], compression)
    full = list(read_records(path))
    path.write_bytes(path.read_bytes()[: os.path.getsize(path) // 2])
    records, damage = read_lossless(path)
    assert 0 < len(records) < 50 and records == full[: len(records)]
    assert damage and "compressed stream" in damage[-1].reason
    with pytest.raises(TFRecordError):
        list(read_records(path, strict=True))


def test_missing_file_is_a_one_line_data_error(tmp_path):
    from appliance.errors import DataError

    with pytest.raises(DataError, match="cannot open"):
        list(read_records(tmp_path / "nope.tfrecord"))


def test_damaged_plain_file_that_starts_like_gzip_is_still_read_as_plain(tmp_path):
    path = tmp_path / "d.tfrecord"
    path.write_bytes(b"\x1f\x8b\x08" + b"".join(frame(r) for r in RECORDS))
    records, damage = read_lossless(path)
    assert records == RECORDS and [(d.start, d.end) for d in damage] == [(0, 3)]


def test_absurd_length_in_gzip_stream_is_not_buffered(tmp_path):
    # 10 MB of records after the bad header: more than the reader decompresses in one step,
    # so only the length bound stops it from buffering the rest of the stream for one record.
    import gzip

    length = struct.pack("<Q", 1 << 40)
    rest = [bytes(100_000)] * 100
    body = frame(b"first") + length + struct.pack("<I", masked_crc(length)) + b"".join(frame(r) for r in rest)
    path = tmp_path / "d.tfrecord.gz"
    path.write_bytes(gzip.compress(body))
    records, damage = read_lossless(path)
    assert records == [b"first"] + rest
    assert "absurd record length" in damage[0].reason and (damage[0].start, damage[0].end) == (21, 33)


def test_concatenated_gzip_members_read_as_one_stream(tmp_path):
    a, b, both = tmp_path / "a.gz", tmp_path / "b.gz", tmp_path / "ab.gz"
    write_records(a, RECORDS[:4], "GZIP")
    write_records(b, RECORDS[4:], "GZIP")
    both.write_bytes(a.read_bytes() + b.read_bytes())  # what `cat a.gz b.gz` makes
    assert read_lossless(both) == (RECORDS, [])


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_large_compressed_file_crosses_window_boundaries(tmp_path, compression):
    # ~12 MB decompressed, record sizes chosen so records and headers straddle the 4 MB steps
    records = [bytes([i % 251]) * (1000 + (i * 7919) % 60000) for i in range(400)]
    path = tmp_path / "big"
    write_records(path, records, compression)
    assert read_lossless(path) == (records, [])
    # a header straddling the end of the first 4 MB decompression step
    from data_tools.compression import CHUNK

    records = [bytes(CHUNK - 6 - 16), b"second", b"third"]
    write_records(path, records, compression)
    assert read_lossless(path) == (records, [])
