"""`appliance data index|cat|convert`, run as a user runs them."""

import io
import json
import os

from PIL import Image

from conftest import run_appliance
from data_tools.dataset import TFRecordDataset
from data_tools.example import decode_example, encode_example
from data_tools.tfrecord import read_records, write_records


def make_image_folder(root):
    colors = {"cat": (200, 30, 30), "dog": (30, 200, 30), "eel": (30, 30, 200)}
    for name, color in colors.items():
        (root / name).mkdir(parents=True)
        for i in range(4):
            fmt = "PNG" if i % 2 else "JPEG"
            Image.new("RGB", (8, 8), color).save(root / name / f"{i}.{'png' if i % 2 else 'jpg'}", format=fmt)
    (root / "cat" / "notes.txt").write_text("not an image, ignored")
    return sorted(colors)


def test_convert_image_folder_to_shards_offline(tmp_path):
    classes = make_image_folder(tmp_path / "images")
    out = tmp_path / "shards"
    proc = run_appliance("data", "convert", str(tmp_path / "images"), "--out", str(out), "--shards", "3", offline=True)
    assert proc.returncode == 0, proc.stderr
    assert "12 images -> 3 shards" in proc.stdout and "img" in proc.stderr  # tqdm progress bar
    shards = sorted(out.glob("*.tfrecord"))
    assert [p.name for p in shards] == [f"data-0000{i}-of-00003.tfrecord" for i in range(3)]
    assert all(p.with_name(p.name + ".index").exists() for p in shards)
    assert (out / "labels.txt").read_text().split() == classes
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "convert" and len(manifest["inputs"]) == 12
    examples = [decode_example(r) for p in shards for r in read_records(p, strict=True)]
    assert len(examples) == 12
    for ex in examples:
        label = int(ex["image/class/label"][0])
        assert ex["image/class/text"] == [classes[label].encode()]
        image = Image.open(io.BytesIO(ex["image/encoded"][0]))
        assert ex["image/format"] == [image.format.lower().encode()]
    counts = [sum(int(ex["image/class/label"][0]) == c for ex in examples) for c in range(3)]
    assert counts == [4, 4, 4]
    image, label = TFRecordDataset.for_classification(shards)[0]
    assert image.size == (8, 8) and 0 <= label < 3


def test_convert_decompress_and_index(tmp_path):
    records = [encode_example({"i": i}) for i in range(20)]
    gz = tmp_path / "d.tfrecord.gz"
    write_records(gz, records, "GZIP")
    out = tmp_path / "plain"
    proc = run_appliance("data", "convert", "--decompress", str(gz), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    plain = out / "d.tfrecord"
    assert list(read_records(plain, compression=None, strict=True)) == records
    assert (out / "d.tfrecord.index").read_text().count("\n") == 20
    proc = run_appliance("data", "index", str(gz))
    assert proc.returncode == 2 and "GZIP-compressed" in proc.stderr and "--decompress" in proc.stderr
    os.remove(out / "d.tfrecord.index")
    proc = run_appliance("data", "index", str(plain))
    assert proc.returncode == 0 and f"{plain}: 20 records -> {plain}.index" in proc.stdout


def test_cat_prints_json_lines_and_warns_about_damage(tmp_path):
    path = tmp_path / "d.tfrecord"
    write_records(path, [encode_example({"name": f"r{i}", "box": [0.5, 1.5], "blob": bytes(range(200))}) for i in range(5)])
    raw = bytearray(path.read_bytes())
    raw[40] ^= 0xFF  # inside record 0's data
    path.write_bytes(raw)
    proc = run_appliance("data", "cat", str(path), "--limit", "2")
    assert proc.returncode == 0
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["record"] for line in lines] == [0, 1]
    assert lines[0]["features"]["name"] == ["r1"] and lines[0]["features"]["box"] == [0.5, 1.5]
    assert lines[0]["features"]["blob"] == [{"bytes": 200, "head": bytes(range(16)).hex()}]
    assert "warning:" in proc.stderr and "data CRC mismatch" in proc.stderr and "bytes 0-" in proc.stderr
    strict = run_appliance("data", "cat", str(path), "--strict")
    assert strict.returncode == 2 and strict.stderr.count("\n") == 1 and "byte 0 (record 0)" in strict.stderr


def test_missing_and_non_tfrecord_files_are_one_line_errors(tmp_path):
    for verb in ("cat", "index"):
        proc = run_appliance("data", verb, str(tmp_path / "missing.tfrecord"))
        assert proc.returncode == 2 and proc.stderr == f"appliance data {verb}: error: {tmp_path / 'missing.tfrecord'}: no such file\n"
        notes = tmp_path / "notes.txt"
        notes.write_text("these are my notes, not a TFRecord file\n" * 20)
        proc = run_appliance("data", verb, str(notes))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"{notes}: not a TFRecord file" in proc.stderr
        assert not (tmp_path / "notes.txt.index").exists()
