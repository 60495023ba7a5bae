"""TFRecord framing constants and the masked CRC32C, defined once for every reader and writer.

A record on disk is `u64 length | u32 masked crc32c(length) | data | u32 masked crc32c(data)`,
little endian; the mask is `((c >> 15 | c << 17) + 0xa282ead8) mod 2^32`.
"""

from __future__ import annotations

import struct

from google_crc32c import value as crc32c

HEADER_BYTES = 12  # u64 length + u32 masked crc of the length
FOOTER_BYTES = 4  # u32 masked crc of the data
FRAME_BYTES = HEADER_BYTES + FOOTER_BYTES
MASK_DELTA = 0xA282EAD8
HEADER = struct.Struct("<QI")  # length, masked crc of the length
U32 = struct.Struct("<I")
# Records longer than this are CRC-checked in steps before they are copied or buffered, so a
# damaged length that passes its CRC never costs memory the size of its claim; their length
# CRCs are never cached, so the readers' fast paths always leave them to the careful path.
LONG_RECORD = 1 << 26

__all__ = ["FOOTER_BYTES", "FRAME_BYTES", "HEADER", "HEADER_BYTES", "LENGTH_CRCS", "LONG_RECORD", "MASK_DELTA", "U32", "crc32c",
           "length_crc", "mask", "masked_crc"]


def mask(crc):
    """TFRecord's CRC mask (rotate right by 15, add a constant): a Python int or a numpy uint64 array."""
    return (((crc >> 15) | (crc << 17)) + MASK_DELTA) & 0xFFFFFFFF


def masked_crc(data) -> int:
    """The masked CRC32C of data, as TFRecord stores it."""
    return mask(crc32c(data))


# length -> masked CRC of its 8 bytes (it depends on the length alone); hot loops read it directly
LENGTH_CRCS: dict[int, int] = {}


def length_crc(length: int) -> int:
    """The masked CRC of a u64 length field (cached: a dataset repeats few lengths)."""
    crc = LENGTH_CRCS.get(length)
    if crc is None:
        crc = mask(crc32c(length.to_bytes(8, "little")))
        if len(LENGTH_CRCS) < 1 << 16 and length <= LONG_RECORD:
            LENGTH_CRCS[length] = crc
    return crc
