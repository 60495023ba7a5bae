"""Verified TFRecord framing in bulk: runs of whole records out of a mapped plain file.

`tfrecord.read_record_spans(..., batch=N)` (what `data_tools.batch.read_examples` reads through) calls
`verified_span` to take up to N records at once instead of one Python step per record:
a walk over the length fields finds the record boundaries, the span is copied out of the
mapping once (so what is checked is what gets decoded, even if the file changes underneath),
and both masked CRC32C checks of every record are compared in numpy. A span ends before the
first record that does not verify; the reader's careful record-by-record path then takes over
at that record, so damage is reported and resynchronised exactly as `read_records` does.
"""

from __future__ import annotations

import numpy as np

from data_tools.framing import FOOTER_BYTES, FRAME_BYTES, HEADER, HEADER_BYTES, LENGTH_CRCS, LONG_RECORD, \
    crc32c, length_crc, mask

_A4 = np.arange(4)
_A8 = np.arange(8)


def verified_span(buf, off: int, most: int):
    """Up to `most` whole records starting at buf[off], every one with both CRCs valid.

    Returns (blob, starts, ends, next_offset): blob is a bytes copy of the span and record r's
    data is blob[starts[r]:ends[r]]; next_offset is where the first record not taken begins.
    Returns None when the record at off does not verify or does not fit (the caller's careful
    path decides what it is).
    """
    n = len(buf)
    # Walk the headers in the mapping, stepping only over lengths whose CRC verifies (so a
    # damaged length never makes the copy below gigabytes), then copy the span out once: what
    # is checked below is that copy, and what gets decoded is that copy.
    starts = []
    append = starts.append
    known = LENGTH_CRCS.get
    unpack = HEADER.unpack_from
    p = off
    count = 0
    while count < most:
        if p + FRAME_BYTES > n:
            break
        length, stored = unpack(buf, p)
        if known(length) != stored and (length > LONG_RECORD or length_crc(length) != stored):
            break  # damage, or a long record (the careful path checks it in steps)
        stop = p + FRAME_BYTES + length
        if stop > n:
            break
        append(p - off)
        p = stop
        count += 1
    blob = buf[off:p]
    p -= off
    if not count:
        return None
    raw = np.frombuffer(blob, np.uint8)
    st = np.array(starts, np.int64)
    nxt = np.empty_like(st)
    nxt[:-1] = st[1:]
    nxt[-1] = p
    ds = st + HEADER_BYTES
    de = nxt - FOOTER_BYTES
    # the walk read the mapping; the file may have changed since: check the copy again
    lengths = (de - ds).tolist()
    good = raw[st[:, None] + _A8].view("<u8")[:, 0] == (de - ds).astype(np.uint64)
    expected = list(map(LENGTH_CRCS.get, lengths))  # a C-level loop once the lengths are known
    if None in expected:
        expected = [length_crc(x) for x in lengths]
    good &= raw[st[:, None] + 8 + _A4].view("<u4")[:, 0] == np.array(expected, np.uint32)
    crcs = np.array([crc32c(blob[a:b]) for a, b in zip(ds.tolist(), de.tolist())], np.uint64)
    good &= raw[de[:, None] + _A4].view("<u4")[:, 0] == mask(crcs)
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
