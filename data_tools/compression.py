"""GZIP and ZLIB TFRecord files: telling them apart, and decompressing them so damage loses little.

TensorFlow compresses the whole framed stream of a file, so a compressed file is read front to
back; `DecompressedSource` keeps a sliding window of the decompressed bytes for the reader.

zlib discards everything a `decompress()` call produced when that call meets a corrupt byte, so
the input goes in small steps and a failing step is replayed on a copy of the decompressor,
bisecting for the longest prefix that still decodes: every byte decodable before the damage is
kept. After damage a GZIP file resumes at the next gzip member that decodes (members are
independent streams); what lies between is a `StreamGap`, with its compressed and decompressed
offsets. A deflate stream is not resumed mid-member: a block boundary can be found, but bytes
that repeat in every record (lengths, feature keys) are copied from the lost 32 KB window again
and again, so no record verifies after such a restart (docs/tfrecord.md); the rest of a damaged
member (and of a damaged ZLIB file) is reported as unrecoverable.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

from google_crc32c import extend as crc32c_extend

from appliance.core.inputs import open_regular
from data_tools.framing import FOOTER_BYTES, HEADER, HEADER_BYTES, U32, masked_crc
from data_tools.resync import header_candidates

CHUNK = 1 << 22  # decompressed bytes produced per step at most (a compression bomb cannot flood memory)
INPUT_STEP = 1 << 14  # compressed bytes fed per step: a salvage replays at most this much (~16 MB out)
SEARCH_BACK = 1 << 20  # how far before a detected error the next gzip member is looked for
FILL_AHEAD = 1 << 21  # decompressed bytes a fill adds at least (so the window is not re-joined per step)
_GZIP_MAGIC = b"\x1f\x8b\x08"
_WBITS = {"GZIP": 31, "ZLIB": 15}


def compression_from_magic(head: bytes) -> str | None:
    """The compression ("GZIP" or "ZLIB") whose header bytes head starts with, else None."""
    if head[:3] == _GZIP_MAGIC and len(head) > 3 and not head[3] & 0xE0:  # FLG's reserved bits are 0
        return "GZIP"
    # zlib: deflate with a window of at most 32 KB, no preset dictionary, and the header check
    if len(head) >= 2 and head[0] & 0x0F == 8 and head[0] >> 4 <= 7 and not head[1] & 0x20 \
            and (head[0] << 8 | head[1]) % 31 == 0:
        return "ZLIB"
    return None


def detect_compression(path: str | os.PathLike) -> str | None:
    """None, "GZIP" or "ZLIB", from the first bytes.

    A valid plain record header at the start wins. Otherwise the format's magic bytes decide,
    even when the stream is damaged right after them, unless the stream fails at once and a
    whole verified plain record lies in the first 64 KB before any gzip member that decodes
    (a damaged plain file; stored deflate blocks hold plain records too). A GZIP file whose
    first magic bytes are damaged (one of three) is still GZIP when a later member decodes.
    """
    with open_regular(path, "TFRecord file") as f:
        head = f.read(1 << 16)
        if _header_at(head, 0):
            return None
        kind = compression_from_magic(head)
        if kind is None and sum(a == b for a, b in zip(head[:3], _GZIP_MAGIC)) < 2:
            return None
        if kind is not None:
            z = zlib.decompressobj(_WBITS[kind])
            try:
                z.decompress(head[:INPUT_STEP])
                return kind
            except zlib.error:
                out, _ = _salvage(zlib.decompressobj(_WBITS[kind]), head[:INPUT_STEP])
            if _header_at(out, 0):
                return kind  # decodes to a record header before the damage: a 32-bit check says so
        plain_at = _first_plain_record(f, head)
        member_at = _first_member(head) if kind != "ZLIB" else None
        if plain_at is not None and (member_at is None or plain_at < member_at):
            return None
        return kind or ("GZIP" if member_at is not None else None)


def _header_at(data: bytes, i: int) -> bool:
    return len(data) >= i + HEADER_BYTES and masked_crc(data[i:i + 8]) == U32.unpack_from(data, i + 8)[0]


def _first_member(head: bytes) -> int | None:
    """Offset (>= 1) of the first gzip member header in head whose first step decodes."""
    i = head.find(_GZIP_MAGIC, 1)
    while i > 0:
        if compression_from_magic(head[i:i + 4]) == "GZIP" and _decodes(head[i:i + INPUT_STEP]):
            return i
        i = head.find(_GZIP_MAGIC, i + 1)
    return None


def _first_plain_record(f, head: bytes) -> int | None:
    """Offset of the first whole record with both CRCs valid that starts in head (of the first 64)."""
    size = os.fstat(f.fileno()).st_size
    for i in header_candidates(head, room=size)[:64].tolist():
        length = HEADER.unpack_from(head, i)[0]
        if length > 1 << 26:
            continue
        f.seek(i + HEADER_BYTES)
        body = f.read(length + 4)
        if masked_crc(body[:length]) == U32.unpack_from(body, length)[0]:
            return i
    return None


@dataclass(frozen=True)
class StreamGap:
    """Compressed bytes [compressed_start, compressed_end) that decoded to nothing we could keep.

    `at` is the decompressed offset where the kept output stops; what follows `at` in the
    decompressed stream comes from after compressed_end (or the stream ends there).
    """

    at: int
    compressed_start: int
    compressed_end: int
    reason: str


class DecompressedSource:
    """A sliding window over the decompressed stream of a GZIP/ZLIB file (see the module docstring).

    Memory holds the bytes from the current record to the furthest byte the reader asked for,
    plus at most one step of output. resume=False stops at the first damage (strict reading).
    """

    def __init__(self, path, compression, *, resume: bool = True):
        self._file = open_regular(path, "TFRecord file")
        self._fd = self._file.fileno()
        self._size = os.fstat(self._fd).st_size
        self._wbits = _WBITS[compression]
        self._resume = resume
        self._z = zlib.decompressobj(self._wbits)
        self._member_start = 0  # compressed offset where the current gzip member (or zlib stream) starts
        self._in = 0  # compressed offset of the next input byte
        self._tail = b""  # input the decompressor handed back (output limit reached); starts at _in
        self._out = 0  # decompressed offset of the next output byte
        self.buf = b""
        self.base = 0  # decompressed offset of buf[0]
        self.eof = False
        self.gaps: list[StreamGap] = []  # in stream order; the reader reports them
        self._gaps_taken = 0

    @property
    def stream_problem(self) -> str | None:
        """Why the stream stopped or skipped, first problem only (what strict reading raises)."""
        return self.gaps[0].reason if self.gaps else None

    def next_gap_at(self) -> int | None:
        """Decompressed offset of the first gap not taken yet, if any."""
        return self.gaps[self._gaps_taken].at if self._gaps_taken < len(self.gaps) else None

    def take_gaps(self, upto: int) -> list[StreamGap]:
        """Gaps at decompressed offsets <= upto not taken before."""
        taken = []
        while self._gaps_taken < len(self.gaps) and self.gaps[self._gaps_taken].at <= upto:
            taken.append(self.gaps[self._gaps_taken])
            self._gaps_taken += 1
        return taken

    def fill(self, need_end: int) -> None:
        """Decompress until the window reaches absolute offset need_end or the stream ends."""
        have = self.base + len(self.buf)
        if have >= need_end or self.eof:
            return
        parts = [self.buf]
        new = 0
        while (have < need_end or new < FILL_AHEAD) and not self.eof:
            out = self._step()
            parts.append(out)
            have += len(out)
            new += len(out)
        self.buf = b"".join(parts)

    def drop_before(self, pos: int, *, at_once: bool = False) -> None:
        """Forget decompressed bytes before pos (in steps, so the copy cost stays small)."""
        if pos - self.base > (0 if at_once else CHUNK):
            self.buf = self.buf[pos - self.base:]
            self.base = pos

    def mark(self):
        """The whole state, window included, for `restore` (to read ahead and come back)."""
        return (self.buf, self.base, self.eof, self._z.copy(), self._member_start, self._in, self._tail, self._out,
                len(self.gaps))

    def restore(self, mark) -> None:
        self.buf, self.base, self.eof, z, self._member_start, self._in, self._tail, self._out, gaps = mark
        self._z = z.copy()
        del self.gaps[gaps:]  # they are found again, the same, on the way forward

    def crc_ahead(self, start: int, length: int, scan_from: int):
        """Check a long record in bounded memory: (crc32c of decompressed bytes [start, start+length),
        the u32 after them, the furthest decompressed offset seen, resume).

        The CRCs are None when the stream ends first. The window is restored afterwards. On the
        way the bytes from scan_from on are searched for record headers (data_tools.resync), and
        resume is a mark (for `restore`) whose window starts at the first one found, or at the
        end of the stream: if the record fails, the reader resynchronises from there instead of
        decompressing everything again (a 2 GiB claim over 1 GiB of zeros costs one pass).
        """
        saved = self.mark()
        crc, p, data_end, stored = 0, start, start + length, None
        crc_done, resume, scan = False, None, scan_from
        try:
            while not (crc_done and resume is not None):
                self.fill(scan + CHUNK if crc_done else min(p + CHUNK, data_end + FOOTER_BYTES))
                have = self.base + len(self.buf)
                if resume is None:
                    found = header_candidates(self.buf, scan - self.base, have - scan,
                                              have - scan if self.eof else None)
                    if len(found):
                        resume = self._mark_at(scan + int(found[0]))
                    elif self.eof:
                        resume = self._mark_at(have)
                    else:
                        scan = max(scan, have - HEADER_BYTES + 1)
                if not crc_done:
                    take = min(have, data_end)
                    if take > p:
                        crc = crc32c_extend(crc, self.buf[p - self.base:take - self.base])
                        p = take
                    if p == data_end and have >= data_end + FOOTER_BYTES:
                        stored = U32.unpack_from(self.buf, p - self.base)[0]
                        crc_done = True
                    elif self.eof:
                        crc, crc_done = None, True  # the stream ends inside the record
                self.drop_before(min(p, scan), at_once=True)
            return crc, stored, have, resume
        finally:
            self.restore(saved)

    def _mark_at(self, pos: int):
        """A mark like `mark()` whose window starts at pos (inside the current window)."""
        mark = list(self.mark())
        mark[0], mark[1] = self.buf[pos - self.base:], pos
        return tuple(mark)

    # ----------------------------------------------------------------- decompression steps

    def _step(self) -> bytes:
        """Decompress one step of input; records gaps and resumes after damage."""
        data = self._tail or os.pread(self._fd, INPUT_STEP, self._in)
        if not data:
            out = self._z.flush()
            if not self._z.eof:
                self._gap(self._out + len(out), self._in, self._size,
                          f"compressed stream ends early (file truncated after compressed byte {self._in})")
            self.eof = True
            self._out += len(out)
            return out
        saved = self._z.copy()
        try:
            out = self._z.decompress(data, CHUNK)
        except zlib.error as err:
            out, good = _salvage(saved, data)
            self._out += len(out)
            # the next member may start before where the error showed (corrupt data can decode as
            # garbage past its member's end), so the search starts up to 1 MB before it (not at the
            # member's start: that would re-read a whole large file after damage near its end)
            bad = self._in + good
            self._after_damage(bad, max(self._member_start + 1, bad - SEARCH_BACK),
                               f"compressed stream is corrupt ({err})")
            return out
        self._out += len(out)
        if self._z.eof:
            self._in += len(data) - len(self._z.unused_data)
            self._tail = b""
            self._after_member()
        else:
            self._tail = self._z.unconsumed_tail
            self._in += len(data) - len(self._tail)
        return out

    def _gap(self, at, start, end, reason):
        self.gaps.append(StreamGap(at, start, end, reason))

    def _after_damage(self, bad: int, search_from: int, reason: str) -> None:
        reason = f"{reason} at compressed byte {bad}"
        nxt = self._next_member(search_from) if self._resume else None
        if nxt is None:
            lost = self._size - bad
            self._gap(self._out, bad, self._size, reason + (
                f"; nothing in the {lost} compressed bytes after it could be decoded" if self._resume and lost else ""))
            self.eof = True
            return
        self._gap(self._out, bad, max(bad, nxt), f"{reason}; resumed at the next gzip member (compressed byte {nxt})")
        self._start_member(nxt)

    def _after_member(self) -> None:
        """A member ended cleanly at self._in: another member, zero padding, the end, or junk."""
        head = os.pread(self._fd, 4, self._in)
        if not head:
            self.eof = True
        elif self._wbits == 31 and compression_from_magic(head) == "GZIP":
            self._start_member(self._in)  # concatenated members form one stream (`cat a.gz b.gz`)
        elif not self._only_zeros_from(self._in):
            self._after_damage(self._in, self._in, "unexpected bytes after the end of the compressed stream")
        else:
            self.eof = True

    def _start_member(self, at: int) -> None:
        self._member_start = at
        self._z = zlib.decompressobj(self._wbits)
        self._in, self._tail = at, b""

    def _only_zeros_from(self, at: int) -> bool:
        while chunk := os.pread(self._fd, 1 << 20, at):
            if chunk.strip(b"\0"):
                return False
            at += len(chunk)
        return True

    def _next_member(self, start: int) -> int | None:
        """Offset of the next gzip member header at or after start whose first step decodes."""
        if self._wbits != 31:
            return None
        at = start
        while chunk := os.pread(self._fd, 1 << 20, at):
            i = chunk.find(_GZIP_MAGIC)
            while i >= 0:
                probe = os.pread(self._fd, INPUT_STEP, at + i)
                if compression_from_magic(probe) == "GZIP" and _decodes(probe):
                    return at + i
                i = chunk.find(_GZIP_MAGIC, i + 1)
            if len(chunk) < 1 << 20:
                return None
            at += len(chunk) - 2  # a header may straddle the chunk boundary

    def close(self):
        self._file.close()


def _salvage(saved, data: bytes) -> tuple[bytes, int]:
    """(output, n): what the longest prefix data[:n] that does not raise decodes to, from saved."""
    good, bad = 0, len(data)  # data[:good] decodes, data[:bad] raises
    while bad - good > 1:
        mid = (good + bad) // 2
        try:
            saved.copy().decompress(data[:mid])
            good = mid
        except zlib.error:
            bad = mid
    return saved.decompress(data[:good]), good


def _decodes(probe: bytes) -> bool:
    try:
        zlib.decompressobj(31).decompress(probe)
    except zlib.error:
        return False
    return True

