"""Record indexes: `<offset> <size>` per line (the DALI / `tfrecord` package format), and random access.

`FILE.index` sits next to the data; when the data directory is read-only it goes to the cache
directory ($APPLIANCE_CACHE_DIR, else ~/.cache/appliance/index). The index format has no room for
a header (DALI would misread it), so `FILE.index.json` beside it says what made it and for which
exact file (size, mtime), and a changed data file gets a fresh index. Only verified records are
indexed, so record numbers match `read_records` on the same file, damaged ranges skipped.

Random access needs a plain file: a GZIP/ZLIB stream can only be read from its start, so record n
would cost decompressing everything before it. Convert once with `appliance data convert --decompress`.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path

import numpy as np

from appliance.core.errors import DataError
from appliance.core.inputs import read_bounded
from appliance.core.manifest import atomic_write_text
from data_tools.compression import detect_compression
from data_tools.framing import FOOTER_BYTES, FRAME_BYTES, HEADER, HEADER_BYTES, U32, masked_crc
from data_tools.tfrecord import TFRecordError, iter_records_with_offsets

INDEX_SUFFIX = ".index"


def default_cache_dir() -> Path:
    env = os.environ.get("APPLIANCE_CACHE_DIR")
    return Path(env) / "index" if env else Path.home() / ".cache" / "appliance" / "index"


MAX_INDEX_LINE = 42  # bytes of one "<offset> <size>\n" line of int64s
MAX_INDEX_BYTES = 1 << 30  # an index whose .json does not say its source's size


def _source_stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _candidates(path: Path, cache_dir: Path | None) -> list[Path]:
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    return [path.with_name(path.name + INDEX_SUFFIX), cache / f"{digest}-{path.name}{INDEX_SUFFIX}"]


def _meta_path(index_path: Path) -> Path:
    return index_path.with_name(index_path.name + ".json")


def _is_current(index_path: Path, stamp: dict) -> bool:
    try:
        meta = json.loads(_meta_path(index_path).read_text())
    except (OSError, ValueError):
        return False
    return index_path.exists() and meta.get("source_size") == stamp["size"] and meta.get(
        "source_mtime_ns"
    ) == stamp["mtime_ns"]


def find_index(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The current index of path (next to it or cached), or None when there is none or it is stale."""
    path = Path(path)
    stamp = _source_stamp(path)
    for candidate in _candidates(path, cache_dir):
        if _is_current(candidate, stamp):
            return candidate
    return None


def build_index(
    path: str | os.PathLike, cache_dir: str | os.PathLike | None = None, *, force: bool = False, on_damage=None
) -> Path:
    """Index path (reusing a current index unless force); returns where the index was written."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if not force and (existing := find_index(path, cache_dir)):
        return existing
    compression = detect_compression(path)
    if compression:
        raise DataError(
            f"{path}: {compression}-compressed; random access would decompress everything before each "
            f"record. Run `appliance data convert --decompress {path} --out DIR` once for a plain, indexable copy"
        )
    stamp = _source_stamp(path)
    damaged = []

    def note(damage):
        damaged.append({"start": damage.start, "end": damage.end, "reason": damage.reason})
        if on_damage:
            on_damage(damage)

    lines = [f"{offset} {len(data) + FRAME_BYTES}\n" for _, offset, data in
             iter_records_with_offsets(path, compression=None, on_damage=note)]
    if not lines and damaged:
        raise DataError(f"{path}: not a TFRecord file (no valid record in {stamp['size']} bytes; "
                        f"{damaged[0]['reason']} at byte {damaged[0]['start']})")
    meta = {
        "made_by": "appliance data index (data_tools.index.build_index); remake: appliance data index FILE",
        "source": str(path.resolve()),
        "source_size": stamp["size"],
        "source_mtime_ns": stamp["mtime_ns"],
        "records": len(lines),
        "damaged_ranges": damaged,
    }
    for candidate in _candidates(path, cache_dir):
        try:
            candidate.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(candidate, "".join(lines))
            atomic_write_text(_meta_path(candidate), json.dumps(meta, indent=1) + "\n")
            return candidate
        except OSError:
            continue  # read-only data directory: fall through to the cache directory
    raise DataError(f"{path}: cannot write an index next to it or in {_candidates(path, cache_dir)[1].parent}")


def read_index_file(index_path: str | os.PathLike) -> np.ndarray:
    """Parse an index file into an int64 array of shape (n, 2): (offset, size including framing).

    An index is a cache that anything can damage: it is read bounded (at most the lines its source
    could need; a 4 GiB index was a MemoryError, a pipe hung, a directory or binary bytes were internal
    errors) and checked: offsets ascending without overlap, each record at least a frame, inside the
    source file its .json names. A damaged one is a DataError saying how to remake it."""
    source_size = _meta_source_size(Path(index_path))
    limit = MAX_INDEX_LINE * (source_size // FRAME_BYTES + 1) if source_size is not None else MAX_INDEX_BYTES
    data = read_bounded(index_path, "TFRecord index", limit, error=DataError)
    if not data.strip() and source_size:  # build_index writes no empty index for a file with bytes in it
        raise DataError(f"{index_path}: a damaged index (empty, for a {source_size}-byte source); remake it with "
                        "`appliance data index --force` on its TFRecord file")
    if not data.strip():
        return np.zeros((0, 2), dtype=np.int64)
    try:
        table = np.array(data.decode("ascii").split(), dtype=np.int64).reshape(-1, 2)
    except (ValueError, OverflowError):  # UnicodeDecodeError is a ValueError
        raise DataError(f"{index_path}: not an index file (expected '<offset> <size>' per line)") from None
    offsets, sizes = table[:, 0], table[:, 1]
    ends = offsets + sizes
    problem = ("a negative offset" if (offsets < 0).any() else
               f"a record shorter than its {FRAME_BYTES}-byte frame" if (sizes < FRAME_BYTES).any() else
               "records out of order or overlapping" if (ends[:-1] > offsets[1:]).any() else
               f"a record past the end of its {source_size}-byte source" if source_size is not None
               and ends[-1] > source_size else None)
    if problem:
        raise DataError(f"{index_path}: a damaged index ({problem}); remake it with `appliance data index --force` "
                        "on its TFRecord file")
    return table


def _meta_source_size(index_path: Path) -> int | None:
    """The source size the index's .json records, or None (no .json, or not one of ours)."""
    try:
        meta = json.loads(read_bounded(_meta_path(index_path), "index description", 1 << 20, error=DataError))
        size = meta.get("source_size") if isinstance(meta, dict) else None
    except (DataError, ValueError):
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else None


def load_index(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> np.ndarray:
    """The (n, 2) offset/size table of a TFRecord file, building and caching the index if needed."""
    return read_index_file(build_index(path, cache_dir))


class RecordFile:
    """Verified random access to the records of one plain TFRecord file by record number.

    Opens its memory map lazily, so it can be pickled into DataLoader worker processes.
    """

    def __init__(self, path: str | os.PathLike, index: np.ndarray | None = None, cache_dir=None):
        self.path = str(path)
        self.index = load_index(path, cache_dir) if index is None else index
        self._file = None
        self._map = None

    def __len__(self) -> int:
        return len(self.index)

    def __getstate__(self):
        return {"path": self.path, "index": self.index, "_file": None, "_map": None}

    def _open(self):
        self._file = open(self.path, "rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    def __getitem__(self, number: int) -> bytes:
        """Record `number`, with both CRCs checked (a changed file raises TFRecordError)."""
        if self._map is None:
            self._open()
        offset, size = (int(v) for v in self.index[number])
        frame_end = offset + size
        if frame_end > len(self._map) or size < FRAME_BYTES:
            raise TFRecordError(self.path, offset, number, "index points past the end of the file (stale index?)")
        head = self._map[offset:offset + HEADER_BYTES]
        length, length_crc = HEADER.unpack(head)
        data = self._map[offset + HEADER_BYTES:frame_end - FOOTER_BYTES]
        if length != len(data) or masked_crc(head[:8]) != length_crc:
            raise TFRecordError(self.path, offset, number, "no valid record header here (stale index?)")
        if masked_crc(data) != U32.unpack(self._map[frame_end - FOOTER_BYTES:frame_end])[0]:
            raise TFRecordError(self.path, offset, number, "data CRC mismatch")
        return data

    def close(self):
        if self._map is not None:
            self._map.close()
            self._file.close()
            self._map = self._file = None


def read_record(path: str | os.PathLike, number: int, cache_dir=None) -> bytes:
    """One verified record by number (builds the index on first use)."""
    records = RecordFile(path, cache_dir=cache_dir)
    try:
        return records[number]
    finally:
        records.close()
