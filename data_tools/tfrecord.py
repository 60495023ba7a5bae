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

HEADER_BYTES = 12  # u64 length + u32 masked crc of the length
FOOTER_BYTES = 4  # u32 masked crc of the data
FRAME_BYTES = HEADER_BYTES + FOOTER_BYTES
COMPRESSIONS = (None, "GZIP", "ZLIB")
_MASK_DELTA = 0xA282EAD8
_CHUNK = 1 << 22  # decompressed bytes pulled per step from a GZIP/ZLIB file
_LEN = struct.Struct("<QI")
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
    """None, "GZIP" or "ZLIB", from the first bytes (a valid plain record header wins)."""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) == HEADER_BYTES:
        length, crc = _LEN.unpack(head)
        if masked_crc(head[:8]) == crc:
            return None
    if head[:2] == b"\x1f\x8b":
        return "GZIP"
    if len(head) >= 2 and head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0:
        return "ZLIB"
    return None


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


class _DecompressedSource:
    """A sliding window over the decompressed stream of a GZIP/ZLIB file.

    Memory holds at most the bytes from the current record to the furthest byte a length field
    asked for that the stream actually has; an absurd length stops at the end of the stream.
    """

    def __init__(self, path, compression):
        self._file = open(path, "rb")
        self._wbits = 31 if compression == "GZIP" else 15
        self._z = zlib.decompressobj(self._wbits)
        self._pending = b""  # compressed input not yet fed to the decompressor
        self.buf = b""
        self.base = 0
        self.eof = False
        self.stream_problem: str | None = None  # why the compressed stream ended early, if it did

    def fill(self, need_end: int) -> None:
        """Decompress until the window reaches absolute offset need_end or the stream ends."""
        parts = [self.buf]
        have = self.base + len(self.buf)
        while have < need_end and not self.eof:
            if not self._pending:
                self._pending = self._file.read(1 << 20)
                if not self._pending:
                    out = self._z.flush()
                    self.eof = True
                    if not self._z.eof:
                        self.stream_problem = "compressed stream ends early (file truncated)"
                    parts.append(out)
                    have += len(out)
                    break
            try:
                # bounded output per step, so a compression bomb cannot flood memory
                out = self._z.decompress(self._pending, _CHUNK)
            except zlib.error as err:
                self.eof = True
                self.stream_problem = f"compressed stream is corrupt ({err})"
                break
            self._pending = self._z.unconsumed_tail
            if self._z.eof:
                rest = self._z.unused_data + self._pending + self._file.read()
                if self._wbits == 31 and rest[:2] == b"\x1f\x8b":
                    # concatenated gzip members form one stream (as `cat a.gz b.gz` makes)
                    self._z = zlib.decompressobj(self._wbits)
                    self._pending = rest
                else:
                    self.eof = True
                    if rest.strip(b"\0"):
                        self.stream_problem = "unexpected bytes after the end of the compressed stream"
            parts.append(out)
            have += len(out)
        if len(parts) > 1:
            self.buf = b"".join(parts)

    def drop_before(self, pos: int) -> None:
        """Forget decompressed bytes before pos (in steps, so the copy cost stays small)."""
        if pos - self.base > _CHUNK:
            self.buf = self.buf[pos - self.base:]
            self.base = pos

    def close(self):
        self._file.close()


def _open_source(path, compression):
    if compression == "auto":
        compression = detect_compression(path)
    _check_compression(compression)
    return _PlainSource(path) if compression is None else _DecompressedSource(path, compression)


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
            fits = lengths < np.uint64(1 << 40)
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
    path = str(path)
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
    try:
        while True:
            if not src.eof:
                src.fill(pos + HEADER_BYTES)
                src.drop_before(pos)
            buf, base = src.buf, src.base
            end = base + len(buf)
            problem = None
            if pos >= end:
                problem = src.stream_problem if isinstance(src, _DecompressedSource) else None
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
                        src.fill(stop)
                        buf, base = src.buf, src.base
                        end = base + len(buf)
                    if stop > end:
                        problem = (f"truncated record: header says {length} bytes of data, "
                                   f"only {max(0, end - pos - FRAME_BYTES)} left in the file")
                    else:
                        start = pos + HEADER_BYTES - base
                        data = buf[start:start + length]
                        if masked_crc(data) != unpack_u32(buf, start + length)[0]:
                            problem = "data CRC mismatch"
            if problem is None:
                if damage_start is not None:
                    _report(path, damage_start, pos, record_number, damage_reason, on_damage)
                    damage_start = None
                yield record_number, pos, data
                record_number += 1
                pos = stop
                continue
            if strict:
                raise TFRecordError(path, pos, record_number, problem)
            if damage_start is None:
                damage_start, damage_reason = pos, problem
            if pos >= end:  # the compressed stream broke off: nothing more to scan
                _report(path, damage_start, end, record_number, damage_reason, on_damage)
                break
            nxt = _find_next_header(src, pos + 1)
            if nxt is None:
                end = src.base + len(src.buf)
                if isinstance(src, _DecompressedSource) and src.stream_problem:
                    damage_reason = f"{damage_reason}; {src.stream_problem}"
                _report(path, damage_start, end, record_number, damage_reason, on_damage)
                break
            pos = nxt
    finally:
        src.close()


def _report(path, start, end, record_number, reason, on_damage):
    if on_damage is not None:
        on_damage(DamagedRange(path, start, end, record_number, reason))


def read_records(
    path: str | os.PathLike,
    *,
    strict: bool = False,
    compression: str | None = "auto",
    on_damage: Callable[[DamagedRange], None] | None = None,
) -> Iterator[bytes]:
    """Yield every verified record of a TFRecord file (lossless by default; strict raises)."""
    for _, _, data in iter_records_with_offsets(
        path, strict=strict, compression=compression, on_damage=on_damage
    ):
        yield data


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
