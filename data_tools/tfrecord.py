"""TFRecord framing: verified reading (lossless past damage, or strict) and atomic writing.

A record on disk is `u64 length | u32 masked crc32c(length) | data | u32 masked crc32c(data)`,
little endian (constants and the CRC mask: data_tools.framing); GZIP and ZLIB files compress the
whole framed stream (data_tools.compression). For compressed files every offset this module
reports is a position in the *decompressed* stream; damage to the compressed stream itself also
carries its compressed offsets.

The reader never returns a record whose two CRCs did not validate. In the default lossless
mode a damaged byte range is reported to `on_damage` and skipped: the reader scans forward to
the next offset where a length and its CRC validate (data_tools.resync, vectorised) and carries
on, so every intact record after the damage still comes out. `strict=True` raises TFRecordError
at the first problem. Memory stays bounded whatever a damaged length claims (LONG_RECORD).
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from google_crc32c import extend as crc32c_extend

from appliance.core.errors import DataError
from appliance.core.inputs import open_regular
from data_tools.compression import DecompressedSource, detect_compression
from data_tools.framing import (
    FOOTER_BYTES,
    FRAME_BYTES,
    HEADER,
    HEADER_BYTES,
    LENGTH_CRCS,
    LONG_RECORD,
    U32,
    crc32c,
    length_crc,
    mask,
    masked_crc,
)
from data_tools.resync import MAX_STREAMED_RECORD, find_next_header
from data_tools.spans import joined, verified_span

__all__ = ["COMPRESSIONS", "FOOTER_BYTES", "FRAME_BYTES", "HEADER_BYTES", "MAX_STREAMED_RECORD", "DamagedRange",
           "TFRecordError", "TFRecordWriter", "detect_compression", "frame", "iter_records_with_offsets",
           "masked_crc", "read_record_spans", "read_records", "write_records"]

COMPRESSIONS = (None, "GZIP", "ZLIB")


class TFRecordError(DataError):
    """A damaged or unreadable TFRecord file; names the file, byte offset and record number."""

    def __init__(self, file, offset: int, record_number: int, reason: str):
        self.file = str(file)
        self.offset = offset
        self.record_number = record_number
        self.reason = reason
        super().__init__(f"{file}: byte {offset} (record {record_number}): {reason}")


@dataclass(frozen=True)
class DamagedRange:
    """Bytes [start, end) that held no verifiable record; record_number is the next record's number.

    For GZIP/ZLIB files start and end are decompressed offsets, and where the compressed stream
    itself was damaged, compressed_start/compressed_end give the compressed bytes that decoded
    to nothing usable (start == end when no decompressed byte was lost, e.g. a bad checksum).
    """

    file: str
    start: int
    end: int
    record_number: int
    reason: str
    compressed_start: int | None = None
    compressed_end: int | None = None

    def __str__(self) -> str:
        where = f"bytes {self.start}-{self.end}"
        if self.compressed_start is not None:
            where = (f"decompressed bytes {self.start}-{self.end}, "
                     f"compressed bytes {self.compressed_start}-{self.compressed_end}")
        return f"{self.file}: {where} (before record {self.record_number}): {self.reason}"


def _check_compression(compression):
    if compression is not None and compression not in ("GZIP", "ZLIB"):
        raise ValueError(f"compression must be None, 'GZIP' or 'ZLIB', not {compression!r}")


# --------------------------------------------------------------------------- reading


class _PlainSource:
    """A whole plain file as one bytes-like buffer (mmap: no copy, bounded memory)."""

    gaps = ()
    stream_problem = None

    def __init__(self, path):
        self._file = open_regular(path, "TFRecord file")
        size = os.fstat(self._file.fileno()).st_size
        self.buf = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        self.base = 0  # absolute offset of buf[0]
        self.eof = True

    def fill(self, need_end: int) -> None:
        """Nothing to do: the whole file is mapped."""

    def drop_before(self, pos: int, *, at_once: bool = False) -> None:
        """Nothing to do: the OS pages the mapping in and out."""

    def next_gap_at(self) -> None:
        return None

    def take_gaps(self, upto: int) -> list:
        return []

    def crc_ahead(self, start: int, length: int, scan_from: int):
        """(crc32c of bytes [start, start+length), the u32 after them, file size, None), copying
        1 MB at a time; the CRCs are None when the file ends first (see DecompressedSource)."""
        end = len(self.buf)
        if start + length + FOOTER_BYTES > end:
            return None, None, end, None
        crc = 0
        for at in range(start, start + length, 1 << 20):
            crc = crc32c_extend(crc, self.buf[at:min(at + (1 << 20), start + length)])
        return crc, U32.unpack_from(self.buf, start + length)[0], end, None

    def close(self):
        if isinstance(self.buf, mmap.mmap):
            self.buf.close()
        self._file.close()


def _open_source(path, compression, strict):
    if compression == "auto":
        compression = detect_compression(path)
    _check_compression(compression)
    if compression is None:
        return _PlainSource(path)
    return DecompressedSource(path, compression, resume=not strict)


def iter_records_with_offsets(
    path: str | os.PathLike,
    *,
    strict: bool = False,
    compression: str | None = "auto",
    on_damage: Callable[[DamagedRange], None] | None = None,
) -> Iterator[tuple[int, int, bytes]]:
    """Yield (record_number, offset, data) for every verified record; see the module docstring."""
    return _records(path, strict, compression, on_damage, with_offsets=True)


def read_records(
    path: str | os.PathLike,
    *,
    strict: bool = False,
    compression: str | None = "auto",
    on_damage: Callable[[DamagedRange], None] | None = None,
) -> Iterator[bytes]:
    """Yield every verified record of a TFRecord file (lossless by default; strict raises)."""
    return _records(path, strict, compression, on_damage, with_offsets=False)


def read_record_spans(
    path: str | os.PathLike,
    *,
    batch: int,
    strict: bool = False,
    compression: str | None = "auto",
    on_damage: Callable[[DamagedRange], None] | None = None,
) -> Iterator[tuple]:
    """Yield runs of up to `batch` verified records as (blob, starts, ends, _) (see data_tools.spans).

    Record r of a run is blob[starts[r]:ends[r]]; the same checks, damage reports and strict
    errors as read_records, one yield per run (what data_tools.batch decodes).
    """
    return _records(path, strict, compression, on_damage, with_offsets=False, batch=batch)


def _records(path, strict, compression, on_damage, with_offsets, batch=None):
    # One generator for every public form: a wrapper generator would cost ~10% of the hot path.
    path = str(path)
    pending = None if batch is None else []
    try:
        src = _open_source(path, compression, strict)
    except OSError as err:
        raise DataError(f"{path}: cannot open: {err.strerror or err}") from None
    record_number = 0
    pos = 0
    damage_start = None
    damage_reason = None
    unpack_header = HEADER.unpack_from
    unpack_u32 = U32.unpack_from
    length_crcs = LENGTH_CRCS
    try:
        while True:
            if not src.eof:
                src.fill(pos + HEADER_BYTES)
                src.drop_before(pos)
            if damage_start is None:
                # Hot path: whole, valid records inside the buffer. Anything else (damage, a record
                # running past the buffer, a long record, the end) breaks out to the careful path below.
                buf, base = src.buf, src.base
                n = len(buf)
                off = pos - base
                if (gap := src.next_gap_at()) is not None:
                    n = min(n, gap - base)  # stop there, so a stream gap is reported in its place
                if pending is not None and src.eof and not src.gaps:
                    # batches from a mapped plain file: whole verified spans (data_tools.spans);
                    # the loop below then meets whatever stopped them, record by record
                    if pending:
                        yield joined(pending)
                        pending = []
                    while (span := verified_span(buf, off, batch)) is not None:
                        yield span
                        record_number += len(span[1])
                        off = span[3]
                while off + HEADER_BYTES <= n:
                    length, stored_crc = unpack_header(buf, off)
                    if length_crcs.get(length) != stored_crc:
                        # the CRC of a length depends on the length alone: each is computed once;
                        # long ones are never cached, so they always take the careful path
                        if length > LONG_RECORD or length_crc(length) != stored_crc:
                            break
                    stop = off + HEADER_BYTES + length + FOOTER_BYTES
                    if stop > n:
                        break
                    data = buf[off + HEADER_BYTES:stop - FOOTER_BYTES]
                    if mask(crc32c(data)) != unpack_u32(buf, stop - 4)[0]:
                        break
                    if pending is None:
                        yield (record_number, base + off, data) if with_offsets else data
                    else:
                        pending.append(data)
                        if len(pending) >= batch:
                            yield joined(pending)
                            pending = []
                    record_number += 1
                    off = stop
                pos = base + off
                if not src.eof:  # the window may end inside the next record: extend it first
                    src.fill(pos + HEADER_BYTES)
            buf, base = src.buf, src.base
            end = base + len(buf)
            if pos >= end:
                if strict and src.stream_problem:
                    problem = src.stream_problem
                else:
                    break
            else:
                problem, data, stop = _check_record(src, pos)
            if problem is None:
                if damage_start is not None:
                    _report(src, path, damage_start, pos, record_number, damage_reason, on_damage)
                    damage_start = None
                for gap in src.take_gaps(pos):  # the stream skipped here, between two whole records
                    _report_gap(path, gap, record_number, on_damage)
                if pending is None:
                    yield (record_number, pos, data) if with_offsets else data
                else:
                    pending.append(data)
                    if len(pending) >= batch:
                        yield joined(pending)
                        pending = []
                record_number += 1
                pos = stop
                continue
            if strict:
                if pending:  # the verified records before the damage come out first, as unbatched
                    yield joined(pending)
                    pending = []
                if src.stream_problem and src.stream_problem != problem:
                    problem = f"{problem} ({src.stream_problem})"
                raise TFRecordError(path, pos, record_number, problem)
            if damage_start is None:
                damage_start, damage_reason = pos, problem
            nxt = find_next_header(src, pos + 1)
            if nxt is None:
                _report(src, path, damage_start, src.base + len(src.buf), record_number, damage_reason, on_damage)
                break
            pos = nxt
        if pending:
            yield joined(pending)
        for gap in src.take_gaps(1 << 63):  # stream damage that cost no record (e.g. a bad checksum)
            _report_gap(path, gap, record_number, on_damage)
    finally:
        src.close()


def _check_record(src, pos):
    """(problem or None, data, stop) for the record at pos, which has at least 1 byte in the window."""
    base = src.base
    end = base + len(src.buf)
    if pos + HEADER_BYTES > end:
        return f"truncated header: {end - pos} of {HEADER_BYTES} bytes left at end of file", None, None
    length, stored_crc = HEADER.unpack_from(src.buf, pos - base)
    if length_crc(length) != stored_crc:
        return "length CRC mismatch", None, None
    stop = pos + HEADER_BYTES + length + FOOTER_BYTES
    if stop > end and not src.eof and length > MAX_STREAMED_RECORD:
        # a GZIP/ZLIB stream: filling that far could hold gigabytes
        return f"absurd record length {length} (over 2 GiB, protobuf's limit)", None, None
    if length > LONG_RECORD:
        # bounded memory whatever the claim; on failure resync from the first header after pos
        # that the check met on its way (a compressed stream is then not decompressed twice)
        crc, stored, have, resume = src.crc_ahead(pos + HEADER_BYTES, length, pos + 1)
        if crc is None or mask(crc) != stored:
            if resume is not None:
                src.restore(resume)
            return ("data CRC mismatch" if crc is not None else _truncated(pos, length, have)), None, None
    if stop > end and not src.eof:
        src.fill(stop)
        base = src.base
        end = base + len(src.buf)
    if stop > end:
        return _truncated(pos, length, end), None, None
    start = pos + HEADER_BYTES - base
    data = src.buf[start:start + length]
    if length <= LONG_RECORD and masked_crc(data) != U32.unpack_from(src.buf, start + length)[0]:
        return "data CRC mismatch", None, None
    return None, data, stop


def _truncated(pos, length, end):
    # the same words for a plain file and the decompressed stream of a GZIP/ZLIB one (where the
    # stream itself broke off, its own reason is added to the report)
    left = max(0, end - pos - FRAME_BYTES)
    return f"truncated record: header says {length} bytes of data, only {left} left in the file"


def _report(src, path, start, end, record_number, reason, on_damage):
    """Report [start, end), with the compressed offsets of any stream gap inside it."""
    inside = []
    for gap in src.take_gaps(end):
        if gap.at < start:
            _report_gap(path, gap, record_number, on_damage)
        else:
            inside.append(gap)
    if on_damage is None:
        return
    if not inside:
        on_damage(DamagedRange(path, start, end, record_number, reason))
        return
    reason = "; ".join([reason] + [gap.reason for gap in inside])
    on_damage(DamagedRange(path, start, end, record_number, reason,
                           inside[0].compressed_start, inside[-1].compressed_end))


def _report_gap(path, gap, record_number, on_damage):
    if on_damage is not None:
        on_damage(DamagedRange(path, gap.at, gap.at, record_number, gap.reason,
                               gap.compressed_start, gap.compressed_end))


# --------------------------------------------------------------------------- writing


def frame(data: bytes) -> bytes:
    """One framed record, exactly as TensorFlow's writer lays it out."""
    length = struct.pack("<Q", len(data))
    return b"".join((length, U32.pack(masked_crc(length)), data, U32.pack(masked_crc(data))))


class TFRecordWriter:
    """Write records to `path` atomically: a temp file next to it, fsynced, renamed on close.

    If the `with` block raises, the temp file is removed and any previous file at `path` stays.
    """

    def __init__(self, path: str | os.PathLike, compression: str | None = None):
        _check_compression(compression)
        self.path = Path(path)
        self.compression = compression
        self.count = 0
        self._tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._file = open(self._tmp, "wb")
        self._z = None
        if compression == "GZIP":
            self._z = zlib.compressobj(6, zlib.DEFLATED, 31)
        elif compression == "ZLIB":
            self._z = zlib.compressobj(6, zlib.DEFLATED, 15)

    def write(self, data: bytes) -> None:
        framed = frame(bytes(data))
        self._file.write(self._z.compress(framed) if self._z else framed)
        self.count += 1

    def close(self) -> None:
        """Finish the file and move it into place."""
        if self._file.closed:
            return
        if self._z:
            self._file.write(self._z.flush())
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def abort(self) -> None:
        """Drop what was written; the previous file at path, if any, is untouched."""
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "TFRecordWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_records(
    path: str | os.PathLike, records: Iterable[bytes], compression: str | None = None
) -> int:
    """Write all records to path (atomically); returns how many."""
    with TFRecordWriter(path, compression) as writer:
        for record in records:
            writer.write(record)
    return writer.count
