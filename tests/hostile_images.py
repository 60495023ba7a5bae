"""Hostile image bytes made by hand, small on disk and huge when decoded: a PNG bomb (a zero image
of any size, its IDAT compressed a row at a time, so making it never holds the pixels) and a JPEG
whose frame header claims a size its few hundred bytes of data do not hold."""

from __future__ import annotations

import functools
import io
import struct
import zlib

import numpy as np
from PIL import Image


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


@functools.cache
def zero_png(width: int, height: int) -> bytes:
    """A one-channel 8-bit PNG of zeros (a mask of class 0): 30000x30000 is ~1 MB, made in about a second.

    Its IDAT is one raw deflate block of 64 rows repeated (a full flush resets the compressor, so
    each repeat compresses to the same bytes) and the rest; the adler32 of n zero bytes is n << 16 | 1."""
    row = b"\0" * (width + 1)  # filter byte 0, then the row's zeros
    rows_per_block = 64
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = packer.compress(row * rows_per_block) + packer.flush(zlib.Z_FULL_FLUSH)
    blocks, rest = divmod(height, rows_per_block)
    tail = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = block * blocks + tail.compress(row * rest) + tail.flush()
    adler = ((len(row) * height) % 65521) << 16 | 1
    idat = b"\x78\xda" + body + struct.pack(">I", adler)
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def lying_jpeg(width: int, height: int, mode: str = "RGB") -> bytes:
    """A real 16x16 JPEG whose SOF frame header is rewritten to claim width x height."""
    out = io.BytesIO()
    Image.fromarray((np.arange(16 * 16 * 3, dtype=np.uint32) % 251).astype(np.uint8).reshape(16, 16, 3)).convert(
        mode).save(out, format="JPEG", quality=90)
    data = bytearray(out.getvalue())
    sof = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, height, width)  # marker, length (2), precision (1), then H, W
    return bytes(data)
