"""Finding the next record header after damage, vectorised: numpy tests every byte offset at once.

A candidate header is an offset whose u64 length fits in what is left and whose masked CRC32C of
those 8 bytes matches the u32 after them. Zero-filled regions cost nothing per offset: a zero
length has one CRC and it is not 0, so twelve zero bytes are never a header; a window of zeros is
skipped with one count, and in a mostly-zero window only the offsets near a nonzero byte are
looked at, so a 16 MB hole reads at memory speed instead of one Python CRC per byte.
Other lengths get their CRC32C computed for all candidate offsets together (a table lookup per
byte, as the CRC32C definition reads), so no pattern of bytes makes the scan pay Python per offset.
"""

from __future__ import annotations

import numpy as np

from data_tools.framing import FRAME_BYTES, HEADER_BYTES, length_crc, mask

# Largest record read from a GZIP/ZLIB stream (protobuf's own limit): the stream's length is
# unknown until it is decompressed, so this bounds what a damaged length can claim.
MAX_STREAMED_RECORD = (1 << 31) - 1


def _crc32c_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(0x82F63B78), table >> 1).astype(np.uint32)
    return table


_TABLE = _crc32c_table()
_ZERO_LENGTH_CRC = length_crc(0)


def _masked_crc8(raw: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Masked CRC32C of the 8 bytes raw[a:a+8] for every a in at (uint64 values)."""
    crc = np.full(len(at), 0xFFFFFFFF, np.uint32)
    for k in range(8):
        crc = _TABLE[(crc ^ raw[at + k]) & 0xFF] ^ (crc >> np.uint32(8))
    return mask((crc ^ np.uint32(0xFFFFFFFF)).astype(np.uint64))


def header_candidates(buf, offset: int = 0, count: int | None = None, room: int | None = None,
                      max_length: int = MAX_STREAMED_RECORD) -> np.ndarray:
    """Offsets (ascending, relative to offset) of the headers in buf[offset:offset+count] whose
    length CRC verifies and whose length fits: length <= max_length, and when room is given (the
    bytes from offset to the end of the data) a whole frame of that length fits in room."""
    size = len(buf) - offset if count is None else count
    n = size - HEADER_BYTES + 1  # offsets with a whole header
    if n <= 0:
        return np.zeros(0, np.int64)
    raw = np.frombuffer(buf, np.uint8, size, offset)
    nonzero = np.count_nonzero(raw)
    bound = max_length if room is None else min(max_length, room - FRAME_BYTES)
    if not nonzero or bound < 0:
        return np.zeros(0, np.int64)
    lengths = np.ndarray((n,), "<u8", raw, 0, (1,))  # the little-endian u64 at every offset
    stored = np.ndarray((n,), "<u4", raw, 8, (1,))
    if nonzero * HEADER_BYTES < n:
        # mostly zeros: twelve zero bytes are never a header (a zero length's CRC is not 0), so
        # only the offsets within a header's reach of a nonzero byte are candidates
        nz = np.flatnonzero(raw) + (HEADER_BYTES - 1)
        near = np.zeros(size + HEADER_BYTES, bool)  # near[i + 11]: a nonzero byte in raw[i:i + 12]
        for k in range(HEADER_BYTES):
            near[nz - k] = True
        at = np.flatnonzero(near[HEADER_BYTES - 1:HEADER_BYTES - 1 + n])
        at = at[lengths[at] <= np.uint64(bound)]
    else:
        at = np.flatnonzero(lengths <= np.uint64(bound))  # one pass; the exact room test on the few left
    if room is not None and len(at):
        at = at[lengths[at].astype(np.int64) <= room - FRAME_BYTES - at]
    if not len(at):
        return at
    zero = lengths[at] == 0
    ok = np.zeros(len(at), bool)
    ok[zero] = stored[at[zero]] == _ZERO_LENGTH_CRC
    other = at[~zero]
    if len(other):
        ok[~zero] = _masked_crc8(raw, other) == stored[other]
    return at[ok]


def find_next_header(src, start: int) -> int | None:
    """The first offset >= start in src (a reader source) where a header verifies, or None.

    Windows grow from 4 KB to 1 MB, so a short damage costs little and a long one is scanned
    in large vectorised steps; a streamed source keeps at most one window beyond start.
    """
    step = 1 << 12
    pos = max(start, src.base)  # a window that starts later was already searched up to its start
    while True:
        src.fill(pos + step + HEADER_BYTES)
        src.drop_before(pos)
        avail = src.base + len(src.buf) - pos
        if avail < HEADER_BYTES:
            return None
        take = min(avail, step + HEADER_BYTES - 1)
        found = header_candidates(src.buf, pos - src.base, take, avail if src.eof else None)
        if len(found):
            return pos + int(found[0])
        pos += take - HEADER_BYTES + 1
        step = min(step * 4, 1 << 20)
