"""GZIP and ZLIB TFRecord files: decompressing them in bounded steps for the reader.

TensorFlow compresses the whole framed stream of a file, so a compressed file is read front to
back; `DecompressedSource` keeps a sliding window of the decompressed bytes for the reader.
"""

from __future__ import annotations

import zlib

CHUNK = 1 << 22  # decompressed bytes produced per step


class DecompressedSource:
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
                out = self._z.decompress(self._pending, CHUNK)
            except zlib.error as err:
                self.eof = True
                self.stream_problem = f"compressed stream is corrupt ({err})"
                break
            self._pending = self._z.unconsumed_tail
            if self._z.eof:
                rest = self._z.unused_data + self._pending or self._file.read(1 << 20)
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
        if pos - self.base > CHUNK:
            self.buf = self.buf[pos - self.base:]
            self.base = pos

    def close(self):
        self._file.close()


