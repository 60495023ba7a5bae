"""Verified TFRecord framing in bulk: runs of whole records out of a mapped plain file.

`tfrecord._records(..., batch=N)` (what `data_tools.batch.read_examples` reads through) calls
`verified_span` to take up to N records at once instead of one Python step per record:
a walk over the length fields finds the record boundaries, the span is copied out of the
mapping once (so what is checked is what gets decoded, even if the file changes underneath),
and both masked CRC32C checks of every record are compared in numpy. A span ends before the
first record that does not verify; the reader's careful record-by-record path then takes over
at that record, so damage is reported and resynchronised exactly as `read_records` does.
"""

from __future__ import annotations

import struct

import numpy as np
from google_crc32c import value as _crc32c

_U64 = struct.Struct("<Q").unpack_from
_U32 = struct.Struct("<I").unpack_from
_MASK_DELTA = 0xA282EAD8
_A4 = np.arange(4)
_LENGTH_CRCS: dict[int, int] = {}  # length -> masked CRC of its 8 bytes (depends on the length only)


def _masked(crc):
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _length_crc(length: int) -> int:
    crc = _LENGTH_CRCS.get(length)
    if crc is None:
        crc = _masked(_crc32c(length.to_bytes(8, "little")))
        if len(_LENGTH_CRCS) < 1 << 16:
            _LENGTH_CRCS[length] = crc
    return crc


def verified_span(buf, off: int, most: int, hint: list[int]):
    """Up to `most` whole records starting at buf[off], every one with both CRCs valid.

    Returns (blob, starts, ends, next_offset): blob is a bytes copy of the span and record r's
    data is blob[starts[r]:ends[r]]; next_offset is where the first record not taken begins.
    Returns None when the record at off does not verify or does not fit (the caller's careful
    path decides what it is). hint[0] carries the bytes per record seen so far, to size the copy.
    """
    n = len(buf)
    if off + 16 > n:
        return None
    # Copy first, then walk the copy (walking headers in the mapping costs more than the copy).
    # A length sizes a copy only once its CRC has verified, so a damaged length can never make
    # this copy gigabytes; unverified lengths below only move the walk inside the copy.
    first = _U64(buf, off)[0]
    if off + 16 + first > n or _length_crc(first) != _U32(buf, off + 8)[0]:
        return None
    guess = hint[0] * most
    blob = buf[off:min(n, off + max(guess + (guess >> 3), 16 + first))]
    starts = []
    append = starts.append
    p = 0
    count = 0
    while True:
        m = len(blob)
        while count < most:
            if p + 16 > m:
                break
            stop = p + 16 + _U64(blob, p)[0]
            if stop > m:
                break
            append(p)
            p = stop
            count += 1
        if count == most or off + m >= n or off + p + 16 > n:
            break
        # rare: the records ran longer than the guess; extend over the next one if it verifies
        length = _U64(buf, off + p)[0]
        if off + p + 16 + length > n or _length_crc(length) != _U32(buf, off + p + 8)[0]:
            break
        blob += buf[off + m:min(n, off + max(p + 16 + length, m + (m >> 2)))]
    if not count:
        return None
    hint[0] = p // count + 1
    raw = np.frombuffer(blob, np.uint8)
    st = np.array(starts, np.int64)
    nxt = np.empty_like(st)
    nxt[:-1] = st[1:]
    nxt[-1] = p
    ds = st + 12
    de = nxt - 4
    lengths = (de - ds).tolist()
    expected = list(map(_LENGTH_CRCS.get, lengths))  # a C-level loop once the lengths are known
    if None in expected:
        expected = [_length_crc(x) for x in lengths]
    good = raw[st[:, None] + 8 + _A4].view("<u4")[:, 0] == np.array(expected, np.uint32)
    crcs = np.array([_crc32c(blob[a:b]) for a, b in zip(ds.tolist(), de.tolist())], np.uint64)
    masked = (((crcs >> np.uint64(15)) | (crcs << np.uint64(17))) + np.uint64(_MASK_DELTA)) & np.uint64(0xFFFFFFFF)
    good &= raw[de[:, None] + _A4].view("<u4")[:, 0] == masked
    if not good.all():
        k = int(np.argmin(good))  # the first record that does not verify
        if k == 0:
            return None
        return blob, ds[:k], de[:k], off + int(st[k])
    return blob, ds, de, off + p


def joined(records: list[bytes]):
    """A list of verified records in verified_span's form (blob, starts, ends, None)."""
    lengths = np.array([len(r) for r in records], np.int64)
    ends = np.cumsum(lengths)
    return b"".join(records), ends - lengths, ends, None
