"""TFRecord framing: verified reading (lossless past damage, or strict) and atomic writing.

A record on disk is `u64 length | u32 masked crc32c(length) | data | u32 masked crc32c(data)`,
little endian; GZIP and ZLIB files compress the whole framed stream. For compressed files every
offset this module reports is a position in the *decompressed* stream.

The reader never returns a record whose two CRCs did not validate. In the default lossless
mode a damaged byte range is reported to `on_damage` and skipped: the reader scans forward to
the next offset where a length and its CRC validate and carries on, so every intact record
after the damage still comes out. `strict=True` raises TFRecordError at the first problem.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
from google_crc32c import value as _crc32c

from appliance.errors import DataError
from data_tools.compression import DecompressedSource
from data_tools.spans import joined, verified_span

HEADER_BYTES = 12  # u64 length + u32 masked crc of the length
FOOTER_BYTES = 4  # u32 masked crc of the data
FRAME_BYTES = HEADER_BYTES + FOOTER_BYTES
COMPRESSIONS = (None, "GZIP", "ZLIB")
_MASK_DELTA = 0xA282EAD8
# Largest record read from a GZIP/ZLIB stream (protobuf's own limit): the stream's length is
# unknown until it is decompressed, so this bounds the memory a damaged length can claim.
# Plain files need no bound: a length past the end of the mapped file is simply a truncation.
MAX_STREAMED_RECORD = (1 << 31) - 1
_LEN = struct.Struct("<QI")
_LENGTH_CRCS: dict[int, int] = {}  # length -> masked CRC of its 8 bytes, filled as lengths verify
_U32 = struct.Struct("<I")


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC32C: rotate right by 15 and add a constant (so CRCs of CRCs differ)."""
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


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
    """Bytes [start, end) that held no verifiable record; record_number is the next record's number."""

    file: str
    start: int
    end: int
    record_number: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: bytes {self.start}-{self.end} (before record {self.record_number}): {self.reason}"


def detect_compression(path: str | os.PathLike) -> str | None:
    """None, "GZIP" or "ZLIB", from the first bytes.

    A valid plain record header wins; a compression header counts only if the bytes after it
    really decompress, so a damaged plain file is never mistaken for a compressed one.
    """
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    if len(head) >= HEADER_BYTES:
        length, crc = _LEN.unpack_from(head)
        if masked_crc(head[:8]) == crc:
            return None
    if head[:3] == b"\x1f\x8b\x08":
        kind, wbits = "GZIP", 31
    elif len(head) >= 2 and head[0] & 0x0F == 8 and head[0] >> 4 <= 7 and (head[0] << 8 | head[1]) % 31 == 0:
        kind, wbits = "ZLIB", 15
    else:
        return None
    try:
        zlib.decompressobj(wbits).decompress(head, 1 << 16)
    except zlib.error:
        return None
    return kind


def _check_compression(compression):
    if compression is not None and compression not in ("GZIP", "ZLIB"):
        raise ValueError(f"compression must be None, 'GZIP' or 'ZLIB', not {compression!r}")


# --------------------------------------------------------------------------- reading


class _PlainSource:
    """A whole plain file as one bytes-like buffer (mmap: no copy, bounded memory)."""

    def __init__(self, path):
        self._file = open(path, "rb")
        size = os.fstat(self._file.fileno()).st_size
        self.buf = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        self.base = 0  # absolute offset of buf[0]
        self.eof = True

    def fill(self, need_end: int) -> None:
        """Nothing to do: the whole file is mapped."""

    def drop_before(self, pos: int) -> None:
        """Nothing to do: the OS pages the mapping in and out."""

    def close(self):
        if isinstance(self.buf, mmap.mmap):
            self.buf.close()
        self._file.close()


def _open_source(path, compression):
    if compression == "auto":
        compression = detect_compression(path)
    _check_compression(compression)
    return _PlainSource(path) if compression is None else DecompressedSource(path, compression)


def _find_next_header(src, start: int) -> int | None:
    """The first offset >= start where a length field and its masked CRC validate, or None.

    Vectorised: candidate lengths at every offset are assembled with numpy, and only offsets
    whose length fits in the bytes left get a CRC check, so scanning garbage stays fast.
    """
    step = 1 << 20
    pos = start
    while True:
        src.fill(pos + step + HEADER_BYTES)
        src.drop_before(pos)
        end = src.base + len(src.buf)
        avail = end - pos
        if avail < HEADER_BYTES:
            return None
        n = min(avail, step + HEADER_BYTES) - HEADER_BYTES + 1  # offsets with a whole header here
        window = bytes(src.buf[pos - src.base: pos - src.base + n + HEADER_BYTES - 1])
        raw = np.frombuffer(window, dtype=np.uint8)
        lengths = np.zeros(n, dtype=np.uint64)
        for k in range(8):  # the little-endian u64 at every offset
            lengths |= raw[k:k + n].astype(np.uint64) << np.uint64(8 * k)
        if src.eof:
            left = avail - np.arange(n, dtype=np.int64) - FRAME_BYTES  # data bytes that could follow
            fits = (left >= 0) & (lengths <= np.clip(left, 0, None).astype(np.uint64))
        else:
            fits = lengths <= np.uint64(MAX_STREAMED_RECORD)
        for i in np.flatnonzero(fits).tolist():
            if masked_crc(window[i:i + 8]) == _U32.unpack_from(window, i + 8)[0]:
                return pos + i
        pos += n


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


def _records(path, strict, compression, on_damage, with_offsets, batch=None):
    # One generator for both public forms: a wrapper generator would cost ~10% of the hot path.
    # With batch=N it yields runs of up to N records instead, as (blob, starts, ends, _) (see
    # data_tools.spans; data_tools.batch reads that way): the same checks, damage reports and
    # strict errors, one yield per run.
    path = str(path)
    pending = None if batch is None else []
    try:
        src = _open_source(path, compression)
    except OSError as err:
        raise DataError(f"{path}: cannot open: {err.strerror or err}") from None
    record_number = 0
    pos = 0
    damage_start = None
    damage_reason = None
    unpack_header = _LEN.unpack_from
    unpack_u32 = _U32.unpack_from
    crc32c = _crc32c
    length_crcs = _LENGTH_CRCS
    try:
        while True:
            if not src.eof:
                src.fill(pos + HEADER_BYTES)
                src.drop_before(pos)
            if damage_start is None:
                # Hot path: whole, valid records inside the buffer. Anything else (damage, a record
                # running past the buffer, the end) breaks out to the careful path below.
                buf, base = src.buf, src.base
                n = len(buf)
                off = pos - base
                if pending is not None and src.eof:
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
                    length, length_crc = unpack_header(buf, off)
                    if length_crcs.get(length) != length_crc:
                        # the CRC of a length depends on the length alone: compute each one once
                        if masked_crc(buf[off:off + 8]) != length_crc:
                            break
                        if len(length_crcs) < 1 << 16:
                            length_crcs[length] = length_crc
                    stop = off + HEADER_BYTES + length + FOOTER_BYTES
                    if stop > n:
                        break
                    data = buf[off + HEADER_BYTES:stop - FOOTER_BYTES]
                    c = crc32c(data)
                    if (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF != unpack_u32(buf, stop - 4)[0]:
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
            problem = None
            if pos >= end:
                problem = src.stream_problem if isinstance(src, DecompressedSource) else None
                if problem is None:
                    break
            elif pos + HEADER_BYTES > end:
                problem = f"truncated header: {end - pos} of {HEADER_BYTES} bytes left at end of file"
            else:
                length, length_crc = unpack_header(buf, pos - base)
                if masked_crc(buf[pos - base:pos - base + 8]) != length_crc:
                    problem = "length CRC mismatch"
                else:
                    stop = pos + HEADER_BYTES + length + FOOTER_BYTES
                    if stop > end and not src.eof:
                        if length <= MAX_STREAMED_RECORD:
                            src.fill(stop)
                            buf, base = src.buf, src.base
                            end = base + len(buf)
                        else:  # a GZIP/ZLIB stream: filling that far could hold gigabytes
                            problem = f"absurd record length {length} (over 2 GiB, protobuf's limit)"
                    if problem is None and stop > end:
                        problem = (f"truncated record: header says {length} bytes of data, "
                                   f"only {max(0, end - pos - FRAME_BYTES)} left in the file")
                    elif problem is None:
                        start = pos + HEADER_BYTES - base
                        data = buf[start:start + length]
                        if masked_crc(data) != unpack_u32(buf, start + length)[0]:
                            problem = "data CRC mismatch"
            if problem is None:
                if damage_start is not None:
                    _report(path, damage_start, pos, record_number, damage_reason, on_damage)
                    damage_start = None
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
                raise TFRecordError(path, pos, record_number, problem)
            if damage_start is None:
                damage_start, damage_reason = pos, problem
            if pos >= end:  # the compressed stream broke off: nothing more to scan
                _report(path, damage_start, end, record_number, damage_reason, on_damage)
                break
            nxt = _find_next_header(src, pos + 1)
            if nxt is None:
                end = src.base + len(src.buf)
                if isinstance(src, DecompressedSource) and src.stream_problem:
                    damage_reason = f"{damage_reason}; {src.stream_problem}"
                _report(path, damage_start, end, record_number, damage_reason, on_damage)
                break
            pos = nxt
        if pending:
            yield joined(pending)
    finally:
        src.close()


def _report(path, start, end, record_number, reason, on_damage):
    if on_damage is not None:
        on_damage(DamagedRange(path, start, end, record_number, reason))


# --------------------------------------------------------------------------- writing


def frame(data: bytes) -> bytes:
    """One framed record, exactly as TensorFlow's writer lays it out."""
    length = struct.pack("<Q", len(data))
    return b"".join(
        (length, _U32.pack(masked_crc(length)), data, _U32.pack(masked_crc(data)))
    )


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
