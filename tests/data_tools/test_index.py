"""Index files: DALI format, cached, rebuilt when stale, random access verified."""

import json
import os
import subprocess

import pytest

from appliance.core.errors import DataError
from data_tools.index import RecordFile, build_index, find_index, load_index, read_record
from data_tools.tfrecord import TFRecordError, frame, write_records

RECORDS = [os.urandom(n) for n in (0, 1, 100, 3000, 7)]


def test_index_lines_are_offset_and_framed_size(tmp_path):
    path = tmp_path / "d.tfrecord"
    write_records(path, RECORDS)
    index_path = build_index(path)
    assert index_path == tmp_path / "d.tfrecord.index"
    expected, pos = [], 0
    for r in RECORDS:
        expected.append(f"{pos} {len(r) + 16}")
        pos += len(r) + 16
    assert index_path.read_text().splitlines() == expected
    meta = json.loads((tmp_path / "d.tfrecord.index.json").read_text())
    assert meta["records"] == 5 and "appliance data index" in meta["made_by"]
    assert [read_record(path, i) for i in (4, 0, 3)] == [RECORDS[4], RECORDS[0], RECORDS[3]]


def test_stale_index_is_rebuilt_and_tampered_data_raises(tmp_path):
    path = tmp_path / "d.tfrecord"
    write_records(path, RECORDS)
    records = RecordFile(path)
    raw = bytearray(path.read_bytes())
    raw[16 + 1 + 16 + 12 + 50] ^= 1  # inside record 2's data
    path.write_bytes(raw)
    with pytest.raises(TFRecordError, match="data CRC mismatch"):
        records[2]
    assert find_index(path) is None  # size unchanged, but mtime moved
    assert len(load_index(path)) == 4  # the damaged record is not indexed


def test_damaged_file_index_skips_damage(tmp_path):
    path = tmp_path / "d.tfrecord"
    path.write_bytes(frame(b"a") + os.urandom(300) + frame(b"b"))
    table = load_index(path)
    assert table.tolist() == [[0, 17], [317, 17]]
    assert RecordFile(path)[1] == b"b"


def test_compressed_file_refuses_random_access_with_a_fix(tmp_path):
    path = tmp_path / "d.tfrecord.gz"
    write_records(path, RECORDS, "GZIP")
    with pytest.raises(DataError, match="GZIP-compressed.*appliance data convert --decompress"):
        build_index(path)


def test_read_only_data_dir_uses_cache_dir(tmp_path):
    data_dir = tmp_path / "ro"
    data_dir.mkdir()
    path = data_dir / "d.tfrecord"
    write_records(path, RECORDS)
    cache = tmp_path / "cache"
    # A read-only bind mount in a private mount namespace: root ignores permission bits.
    script = (
        f"mount --bind -o ro {data_dir} {data_dir} && "
        f"{os.sys.executable} -c 'from data_tools.index import build_index; print(build_index(\"{path}\", \"{cache}\"))'"
    )
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True)
    if "mount" in done.stderr and done.returncode:
        pytest.skip(f"cannot make a read-only mount here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    index_path = done.stdout.strip()
    assert index_path.startswith(str(cache)) and not (data_dir / "d.tfrecord.index").exists()
    assert load_index(path, cache).shape == (5, 2)
    assert find_index(path, cache) is not None
