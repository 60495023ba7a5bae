"""Segmentation data: DeepLab-convention records, `data convert` from images/ + masks/, the mask check.

TensorFlow (in .venv-interop, as a subprocess) writes records the way DeepLab's build scripts do;
we check them, and TensorFlow parses the records we write.
"""

import io
import json
import subprocess

import numpy as np
from PIL import Image

from appliance import cli
from data_tools.check.run import run_check
from data_tools.convert_masks import convert_mask_folders
from data_tools.example import decode_example
from data_tools.segmentation import (MASK_KEY, decode_mask, encode_segmentation_example, mask_png,
                                     read_segmentation_example)
from data_tools.tfrecord import TFRecordWriter, read_records

H, W = 20, 28


def png(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def scene(i: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """A noisy image and its mask: a class-1 box, and a class-2 box on every other image."""
    image = (rng.random((H, W, 3)) * 255).astype(np.uint8)
    mask = np.zeros((H, W), np.uint8)
    mask[2 + i % 4:9 + i % 4, 3:10] = 1
    if i % 2:
        mask[11:17, 12 + i % 5:22 + i % 5] = 2
    mask[0, :] = 255  # an ignored border row, as DeepLab datasets have
    return image, mask


def write_folder_pair(root, n=10):
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for i in range(n):
        image, mask = scene(i, rng)
        Image.fromarray(image).save(root / "images" / f"part{i:02d}.png")
        # Every third mask a palette PNG, as Pascal VOC ships them: the palette index is the class id.
        pal = Image.fromarray(mask)
        if i % 3 == 0:
            pal = Image.frombytes("P", (W, H), mask.tobytes())
            pal.putpalette([v for c in range(256) for v in (c * 40 % 256, c * 90 % 256, c * 10 % 256)])
        pal.save(root / "masks" / f"part{i:02d}.png")


def test_convert_folder_pair_writes_deeplab_records_and_a_seeded_split(tmp_path):
    write_folder_pair(tmp_path / "d")
    paths = convert_mask_folders(tmp_path / "d" / "images", tmp_path / "d" / "masks", tmp_path / "out",
                                 val_fraction=0.3, seed=3)
    assert [p.name for p in paths] == ["train-00000-of-00001.tfrecord", "val-00000-of-00001.tfrecord"]
    records = {side: [decode_example(r) for r in read_records(p)] for side, p in zip(("train", "val"), paths)}
    # Stratified by the highest class in each mask: 5 images with class 2, 5 without; 0.3 of each.
    assert len(records["train"]) + len(records["val"]) == 10 and len(records["val"]) == 4
    assert sum(2 in decode_mask(ex[MASK_KEY][0]) for ex in records["val"]) == 2
    for ex in records["train"] + records["val"]:
        stem = ex["image/filename"][0].decode()
        assert ex["image/format"] == [b"png"] and ex["image/segmentation/class/format"] == [b"png"]
        assert (int(ex["image/height"][0]), int(ex["image/width"][0])) == (H, W)
        # A grey mask travels byte for byte; a palette mask becomes a grey PNG of its indices.
        source = tmp_path / "d" / "masks" / f"{stem}.png"
        if Image.open(source).mode == "L":
            assert ex[MASK_KEY][0] == source.read_bytes()
        assert Image.open(io.BytesIO(ex[MASK_KEY][0])).mode == "L"
        assert np.array_equal(decode_mask(ex[MASK_KEY][0]), np.asarray(Image.open(source)))
        assert set(np.unique(decode_mask(ex[MASK_KEY][0]))) <= {0, 1, 2, 255}
    again = convert_mask_folders(tmp_path / "d" / "images", tmp_path / "d" / "masks", tmp_path / "out2",
                                 val_fraction=0.3, seed=3)
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in paths]


def test_convert_cli_names_an_image_without_a_mask(tmp_path, capsys):
    write_folder_pair(tmp_path / "d", n=3)
    (tmp_path / "d" / "masks" / "part01.png").unlink()
    code = cli.main(["data", "convert", str(tmp_path / "d"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code != 0 and "part01.png" in err and "no mask" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def bad_records(path):
    """12 records: 4 bad masks (wrong size, stray class, truncated PNG, RGB), 1 background-only."""
    rng = np.random.default_rng(1)
    reasons = {}
    with TFRecordWriter(path) as w:
        for i in range(12):
            image, mask = scene(i, rng)
            encoded = mask_png(mask)
            if i == 3:
                encoded, reasons[i] = mask_png(mask[:10]), "mask_size"
            elif i == 5:
                mask[4, 4] = 7
                encoded, reasons[i] = mask_png(mask), "mask_label_range"
            elif i == 7:
                encoded, reasons[i] = encoded[:40], "mask_decode"
            elif i == 9:
                encoded, reasons[i] = png(np.stack([mask] * 3, -1)), "mask_decode"
            elif i == 10:
                encoded = mask_png(np.zeros((H, W), np.uint8))
            w.write(encode_segmentation_example(png(image), "png", H, W, encoded))
    return reasons


def test_check_quarantines_every_bad_mask_with_file_record_and_reason(tmp_path):
    data = tmp_path / "seg.tfrecord"
    expected = bad_records(data)
    report, status = run_check([(str(data), None)], tmp_path / "chk", progress=False)
    assert status == 0
    assert report["records_valid"] == 8 and report["records_quarantined"] == 4
    lines = [json.loads(x) for x in (tmp_path / "chk" / "quarantine" / "reasons.jsonl").read_text().splitlines()[1:]]
    assert {(x["record_number"], x["check"]) for x in lines} == set(expected.items())
    assert all(x["file"] == str(data) and x["offset"] is not None for x in lines)
    # Never trained on: clean/ holds exactly the good records, and each of their masks is valid.
    clean = list(read_records(tmp_path / "chk" / "clean" / "seg.tfrecord"))
    assert len(clean) == 8
    for record in clean:
        image, mask = read_segmentation_example(record)
        assert mask.shape == (H, W) and set(np.unique(mask)) <= {0, 1, 2, 255}
    seg = report["segmentation"]
    assert seg["num_classes"] == 3 and seg["num_classes_source"] == "inferred" and seg["empty_masks"] == 1
    assert seg["images_per_class"] == {"0": 8, "1": 7, "2": 2}  # odd records hold class 2; 3, 5, 7, 9 are bad
    assert abs(sum(seg["pixel_share"].values()) - 1) < 1e-9 and seg["ignored_pixel_share"] == 7 / (8 * H)  # one border row; record 10 has none
    assert [n["record_number"] for n in report["notes"] if n["check"] == "empty_mask"] == [10]
    html = (tmp_path / "chk" / "report.html").read_text()
    assert html.count("data:image/png") >= 8 and "id='overlays'" in html and "id='bad-masks'" in html


def test_check_with_given_num_classes_quarantines_out_of_range_during_the_scan(tmp_path):
    data = tmp_path / "seg.tfrecord"
    rng = np.random.default_rng(2)
    with TFRecordWriter(data) as w:
        for i in range(6):
            image, mask = scene(i, rng)
            w.write(encode_segmentation_example(png(image), "png", H, W, mask_png(mask)))
    report, _ = run_check([(str(data), None)], tmp_path / "chk", progress=False, num_classes=2)
    # Class 2 is out of range when the user says there are two classes: every odd image goes.
    assert report["checks"].get("mask_label_range") == 3 and report["segmentation"]["num_classes"] == 2


TF_WRITE_DEEPLAB = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf
job = json.loads(sys.argv[1])
rng = np.random.default_rng(0)
with tf.io.TFRecordWriter(job["path"]) as w:
    for i in range(job["n"]):
        h, w_ = 18 + i % 3, 26
        image = tf.constant(rng.integers(0, 256, (h, w_, 3), dtype=np.uint8))
        mask = np.zeros((h, w_, 1), np.uint8); mask[3:9, 4:12] = 1 + i % 2; mask[-1] = 255
        if i == job["bad"]:
            mask = mask[:-2]
        def b(v): return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v]))
        def n(v): return tf.train.Feature(int64_list=tf.train.Int64List(value=[v]))
        enc = tf.io.encode_jpeg(image, quality=95) if i % 2 else tf.io.encode_png(image)
        w.write(tf.train.Example(features=tf.train.Features(feature={
            "image/encoded": b(enc.numpy()), "image/filename": b(b"img%d" % i),
            "image/format": b(b"jpeg" if i % 2 else b"png"), "image/height": n(h), "image/width": n(w_),
            "image/channels": n(3), "image/segmentation/class/encoded": b(tf.io.encode_png(mask).numpy()),
            "image/segmentation/class/format": b(b"png")})).SerializeToString())
"""

TF_READ_DEEPLAB = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
spec = {"image/encoded": tf.io.FixedLenFeature((), tf.string), "image/height": tf.io.FixedLenFeature((), tf.int64),
        "image/width": tf.io.FixedLenFeature((), tf.int64),
        "image/segmentation/class/encoded": tf.io.FixedLenFeature((), tf.string)}
out = []
for raw in tf.data.TFRecordDataset(sys.argv[1]):
    ex = tf.io.parse_single_example(raw, spec)
    mask = tf.io.decode_png(ex["image/segmentation/class/encoded"], channels=1)
    out.append({"hw": [int(ex["image/height"]), int(ex["image/width"])], "mask": mask.numpy()[..., 0].tolist()})
print(json.dumps(out))
"""


def test_tensorflow_deeplab_records_are_checked(tmp_path, interop_python):
    data = tmp_path / "tf-deeplab.tfrecord"
    job = {"path": str(data), "n": 8, "bad": 5}
    done = subprocess.run([str(interop_python), "-c", TF_WRITE_DEEPLAB, json.dumps(job)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report, status = run_check([(str(data), None)], tmp_path / "chk", progress=False)
    assert status == 0 and report["records_total"] == 8
    assert report["checks"] == {"mask_size": 1} and report["records_quarantined"] == 1
    seg = report["segmentation"]
    assert seg["num_classes"] == 3 and seg["images_per_class"]["2"] == 3 and seg["images_per_class"]["1"] == 4
    image, mask = read_segmentation_example(next(iter(read_records(data))))
    assert mask.shape == (18, 26) and mask[5, 5] == 1 and (mask[-1] == 255).all()


def test_tensorflow_reads_the_records_we_write(tmp_path, interop_python):
    write_folder_pair(tmp_path / "d", n=4)
    (path,) = convert_mask_folders(tmp_path / "d" / "images", tmp_path / "d" / "masks", tmp_path / "out")
    done = subprocess.run([str(interop_python), "-c", TF_READ_DEEPLAB, str(path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ours = [read_segmentation_example(r)[1] for r in read_records(path)]
    theirs = json.loads(done.stdout)
    assert [t["hw"] for t in theirs] == [[H, W]] * 4
    assert all(np.array_equal(np.array(t["mask"], np.uint8), m) for t, m in zip(theirs, ours))
