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
    from appliance.core.errors import DataError

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


# --------------------------------------------------------------------------- compressed damage (issue 18)


def compressible_records(n, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [(b"image/class/label %d " % (i % 10)) * int(rng.integers(5, 60)) + rng.bytes(8) for i in range(n)]


def decodable_prefix(compressed, wbits):
    """What a damaged stream decodes to before its first error, fed one byte at a time (the oracle)."""
    import zlib

    out, z = [], zlib.decompressobj(wbits)
    for i in range(len(compressed)):
        try:
            out.append(z.decompress(compressed[i:i + 1]))
        except zlib.error:
            break
        if z.eof:
            break
    return b"".join(out)


def records_in(prefix, records):
    """How many of records, framed back to back, lie whole and unchanged in prefix."""
    pos = k = 0
    for r in records:
        f = frame(r)
        if prefix[pos:pos + len(f)] != f:
            break
        pos += len(f)
        k += 1
    return k


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_early_zlib_error_keeps_the_records_before_it_and_names_both_offsets(tmp_path, compression):
    import zlib

    from data_tools.tfrecord import detect_compression

    records = compressible_records(400)
    path = tmp_path / "d.tfrecord.gz"
    write_records(path, records, compression)
    good = path.read_bytes()
    wbits = 31 if compression == "GZIP" else 15
    # the first flip (from byte 2000 on, inside the first 64 KB) that makes zlib raise
    for at in range(2000, len(good)):
        raw = bytearray(good)
        raw[at] ^= 0x55
        try:
            zlib.decompress(bytes(raw), wbits)
        except zlib.error:
            break
    path.write_bytes(raw)
    assert at < 1 << 16 and detect_compression(path) == compression
    k = records_in(decodable_prefix(bytes(raw), wbits), records)
    got, damage = read_lossless(path)
    assert k > 0 and got[:k] == records[:k] and all(r in records for r in got)
    stream = [d for d in damage if d.compressed_start is not None]
    assert stream and at <= stream[0].compressed_start < stream[0].compressed_end <= len(raw)
    assert "compressed stream is corrupt" in stream[0].reason and f"compressed byte {stream[0].compressed_start}" in str(stream[0])
    with pytest.raises(TFRecordError, match="compressed stream is corrupt"):
        list(read_records(path, strict=True))


def test_bad_gzip_checksum_loses_no_record(tmp_path):
    records = compressible_records(20_000)
    path = tmp_path / "d.tfrecord.gz"
    write_records(path, records, "GZIP")
    raw = bytearray(path.read_bytes())
    raw[-6] ^= 0xFF  # the CRC32 in the gzip trailer
    path.write_bytes(raw)
    got, damage = read_lossless(path)
    assert got == records
    size = sum(len(r) + 16 for r in records)
    assert [(d.start, d.end, d.record_number) for d in damage] == [(size, size, len(records))]
    assert len(raw) - 8 <= damage[0].compressed_start < damage[0].compressed_end == len(raw)  # in the trailer
    assert "incorrect data check" in damage[0].reason
    strict = []
    with pytest.raises(TFRecordError, match="incorrect data check"):
        for r in read_records(path, strict=True):
            strict.append(r)
    assert strict == records


def test_damaged_gzip_member_resumes_at_the_next_member(tmp_path):
    import gzip

    first, second = compressible_records(300, 1), compressible_records(300, 2)
    a = gzip.compress(b"".join(frame(r) for r in first))
    b = gzip.compress(b"".join(frame(r) for r in second))
    raw = bytearray(a + b)
    raw[len(a) // 2:len(a) // 2 + 200] = os.urandom(200)
    path = tmp_path / "ab.gz"
    path.write_bytes(raw)
    got, damage = read_lossless(path)
    assert got[-len(second):] == second and all(r in first for r in got[:-len(second)])
    assert any(d.compressed_end == len(a) and "resumed at the next gzip member" in d.reason for d in damage)


def test_gzip_whose_first_magic_byte_is_damaged_is_still_gzip(tmp_path):
    import gzip

    from data_tools.tfrecord import detect_compression

    a = gzip.compress(b"".join(frame(r) for r in RECORDS[:5]))
    b = gzip.compress(b"".join(frame(r) for r in RECORDS[5:]))
    path = tmp_path / "ab.gz"
    path.write_bytes(b"\x00" + a[1:] + b)
    assert detect_compression(path) == "GZIP"
    got, damage = read_lossless(path)
    assert got == RECORDS[5:] and damage[0].compressed_start <= 1 and damage[0].compressed_end == len(a)


def test_damaged_zlib_stream_reports_what_could_not_be_recovered(tmp_path):
    import zlib

    records = compressible_records(2000)
    path = tmp_path / "d.zlib"
    write_records(path, records, "ZLIB")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 64] = bytes(64)
    path.write_bytes(raw)
    k = records_in(decodable_prefix(bytes(raw), 15), records)
    got, damage = read_lossless(path)
    assert got[:k] == records[:k] and len(got) < len(records)
    assert damage[-1].compressed_end == len(raw) and "could be decoded" in damage[-1].reason
    with pytest.raises(zlib.error):
        zlib.decompress(bytes(raw))


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_zero_filled_region_is_one_damaged_range(tmp_path, compression):
    import gzip

    body = b"".join(frame(r) for r in RECORDS[:5]) + bytes(16 << 20) + b"".join(frame(r) for r in RECORDS[5:])
    path = tmp_path / "zeros"
    path.write_bytes(gzip.compress(body, 1) if compression else body)
    got, damage = read_lossless(path)
    start = offsets(RECORDS)[5]
    assert got == RECORDS and [(d.start, d.end) for d in damage] == [(start, start + (16 << 20))]


@pytest.mark.parametrize("strict", [False, True])
def test_long_length_claim_in_a_gzip_bomb_is_checked_in_bounded_memory(tmp_path, strict):
    import tracemalloc
    import zlib

    length = struct.pack("<Q", (1 << 31) - 1)
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [z.compress(frame(b"first") + length + struct.pack("<I", masked_crc(length)))]
    parts += [z.compress(bytes(1 << 20)) for _ in range(96)]  # 96 MiB of zeros: 100 KB compressed
    parts += [z.compress(frame(b"last")), z.flush()]
    path = tmp_path / "bomb.gz"
    path.write_bytes(b"".join(parts))
    got, damage = [], []
    tracemalloc.start()
    try:
        for r in read_records(path, strict=strict, on_damage=damage.append):
            got.append(r)
    except TFRecordError as err:
        assert strict and "truncated record" in str(err)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 48 << 20  # a buffered claim would hold the 96 MiB that the stream has
    assert got == ([b"first"] if strict else [b"first", b"last"])
    if not strict:
        assert [(d.start, d.end) for d in damage] == [(21, 21 + 12 + (96 << 20))]


def test_data_check_scan_lists_compressed_damage_with_both_offsets(tmp_path):
    import gzip

    from data_tools.check.scan import ScanTask, scan_file
    from data_tools.example import encode_example

    records = [encode_example({"id": i, "name": f"r{i}"}) for i in range(200)]
    a = gzip.compress(b"".join(frame(r) for r in records[:100]))
    b = gzip.compress(b"".join(frame(r) for r in records[100:]))
    raw = bytearray(a + b)
    raw[len(a) - 8:len(a)] = bytes(8)  # the first member's trailer
    (tmp_path / "d.gz").write_bytes(raw)
    (tmp_path / "clean").mkdir()
    (tmp_path / "quarantine").mkdir()
    schema = {"features": {}, "label_key": None, "image_key": None}
    result = scan_file(ScanTask(0, str(tmp_path / "d.gz"), None, "d", str(tmp_path), schema, 10**6))
    assert result.compression == "GZIP" and result.error is None
    assert len(result.clean_records) == 200
    assert [(d["start"], d["end"], d["compressed_end"]) for d in result.damaged] == [
        (sum(len(r) + 16 for r in records[:100]),) * 2 + (len(a),)]
    assert len(a) - 8 <= result.damaged[0]["compressed_start"] < len(a)
    # nothing recoverable: one line naming the compression, not "not a TFRecord file"
    (tmp_path / "e.gz").write_bytes(a[:10] + bytes(range(256)) * 4)
    result = scan_file(ScanTask(0, str(tmp_path / "e.gz"), None, "e", str(tmp_path), schema, 10**6))
    assert result.error.startswith("GZIP file: no record could be recovered (")
    assert "compressed stream is corrupt" in result.error


@pytest.mark.parametrize("fill", ["zeros", "random"])
def test_vectorised_header_search_finds_exactly_the_offsets_a_byte_by_byte_check_finds(fill):
    import numpy as np

    from data_tools.resync import header_candidates

    rng = np.random.default_rng(7)
    for _ in range(60):
        data = bytearray(bytes(6000) if fill == "zeros" else rng.bytes(6000))
        for _ in range(int(rng.integers(0, 6))):  # whole frames, zero-length ones too
            f = frame(rng.bytes(int(rng.integers(0, 40))))
            p = int(rng.integers(0, len(data) - len(f)))
            data[p:p + len(f)] = f
        for _ in range(int(rng.integers(0, 12))):  # stray bytes (sparse in the zero case)
            data[int(rng.integers(0, len(data)))] = int(rng.integers(1, 256))
        data = bytes(data)
        want = [i for i in range(len(data) - 11)
                if masked_crc(data[i:i + 8]) == struct.unpack_from("<I", data, i + 8)[0]
                and struct.unpack_from("<Q", data, i)[0] <= len(data) - 16 - i]
        assert header_candidates(data, room=len(data)).tolist() == want
