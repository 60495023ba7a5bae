"""Detection data: Object Detection API records, `data convert` from COCO JSON and Pascal VOC.

TensorFlow (in .venv-interop, as a subprocess) writes records the way the API's
create_*_tf_record.py scripts do and we read them; TensorFlow parses the records we write.
"""

import io
import json
import subprocess

import numpy as np
import pytest
from PIL import Image

from appliance import cli
from data_tools.check.run import run_check
from data_tools.convert_boxes import convert_boxes, read_coco
from data_tools.detection import BoxProblem, LABEL_KEY, TEXT_KEY, read_boxes, read_detection_example
from data_tools.example import decode_example
from data_tools.tfrecord import read_records

H, W = 24, 32
CLASSES = {3: "scratch", 7: "dent"}  # sparse COCO category ids, as COCO's own are


def scene(i: int, rng):
    """A noisy image with 0..2 bright rectangles; their pixel boxes (x0, y0, x1, y1) and category ids."""
    image = (rng.random((H, W, 3)) * 60).astype(np.uint8)
    boxes = []
    for k in range(i % 3):
        x0, y0 = 2 + 12 * k + i % 3, 3 + i % 5
        x1, y1 = x0 + 8, y0 + 10
        image[y0:y1, x0:x1] = 220
        boxes.append(((x0, y0, x1, y1), 3 if k == 0 else 7))
    return image, boxes


def write_coco(root, n=12):
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True)
    coco = {"images": [], "annotations": [], "categories": [{"id": c, "name": name} for c, name in CLASSES.items()]}
    for i in range(n):
        image, boxes = scene(i, rng)
        Image.fromarray(image).save(root / "images" / f"img{i:02d}.png")
        coco["images"].append({"id": 100 + i, "file_name": f"img{i:02d}.png", "width": W, "height": H})
        for (x0, y0, x1, y1), cat in boxes:
            coco["annotations"].append({"id": len(coco["annotations"]) + 1, "image_id": 100 + i, "category_id": cat,
                                        "bbox": [x0, y0, x1 - x0, y1 - y0], "iscrowd": 0, "area": 80})
    (root / "instances.json").write_text(json.dumps(coco))
    return coco


def write_voc(root, n=6):
    rng = np.random.default_rng(1)
    (root / "Annotations").mkdir(parents=True)
    (root / "JPEGImages").mkdir()
    for i in range(n):
        image, boxes = scene(i, rng)
        Image.fromarray(image).save(root / "JPEGImages" / f"{i:06d}.jpg", quality=95)
        objects = "".join(
            f"<object><name>{CLASSES[c]}</name><difficult>{int(k == 1)}</difficult><bndbox><xmin>{x0}</xmin>"
            f"<ymin>{y0}</ymin><xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object>"
            for k, ((x0, y0, x1, y1), c) in enumerate(boxes))
        (root / "Annotations" / f"{i:06d}.xml").write_text(
            f"<annotation><filename>{i:06d}.jpg</filename><size><width>{W}</width><height>{H}</height>"
            f"<depth>3</depth></size>{objects}</annotation>")


def test_coco_convert_writes_api_records_with_a_seeded_split(tmp_path):
    coco = write_coco(tmp_path / "c")
    classes, items = read_coco(tmp_path / "c" / "instances.json", tmp_path / "c" / "images")
    assert classes == ["scratch", "dent"]  # category ids 3 and 7 -> labels 1 and 2
    paths = convert_boxes(classes, items, tmp_path / "out", {"coco": "x"}, val_fraction=0.25, seed=5)
    assert [p.name for p in paths] == ["train-00000-of-00001.tfrecord", "val-00000-of-00001.tfrecord"]
    records = [decode_example(r) for p in paths for r in read_records(p)]
    assert len(records) == 12 and len(list(read_records(paths[1]))) == 3
    by_id = {int(ex["image/source_id"][0]): ex for ex in records}
    for image in coco["images"]:
        ex = by_id[image["id"]]
        boxes, labels = read_boxes(ex, num_classes=2)
        want = [a for a in coco["annotations"] if a["image_id"] == image["id"]]
        assert len(boxes) == len(want) and ex["image/filename"] == [image["file_name"].encode()]
        for box, label, a in zip(boxes, labels, want):
            x, y, w, h = a["bbox"]
            assert np.allclose(box, [x / W, y / H, (x + w) / W, (y + h) / H], atol=1e-6)
            assert label == {3: 1, 7: 2}[a["category_id"]]
            assert ex[TEXT_KEY][list(labels).index(label)] == CLASSES[a["category_id"]].encode()
        assert (int(ex["image/height"][0]), int(ex["image/width"][0])) == (H, W)
    assert 'id: 2\n  name: "dent"' in (tmp_path / "out" / "label_map.pbtxt").read_text()
    again = convert_boxes(classes, items, tmp_path / "out2", {"coco": "x"}, val_fraction=0.25, seed=5)
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in paths]


def test_voc_folder_converts_from_the_cli(tmp_path, capsys):
    write_voc(tmp_path / "voc")
    assert cli.main(["data", "convert", str(tmp_path / "voc"), "--out", str(tmp_path / "out")]) == 0
    assert "6 images, 6 boxes of 2 classes" in capsys.readouterr().out
    records = [decode_example(r) for r in read_records(tmp_path / "out" / "data-00000-of-00001.tfrecord")]
    by_name = {ex["image/filename"][0].decode(): ex for ex in records}
    ex = by_name["000002.jpg"]  # two boxes: scratch (k=0) then dent (k=1, marked difficult)
    assert list(ex[LABEL_KEY]) == [2, 1]  # sorted names: dent=1, scratch=2
    assert list(ex["image/object/difficult"]) == [0, 1]
    assert np.allclose(ex["image/object/bbox/xmin"], [(2 + 2) / W, (14 + 2) / W])
    assert len(by_name["000000.jpg"][LABEL_KEY]) == 0  # an image without boxes is a record with empty lists


def test_coco_with_an_unknown_category_is_one_line(tmp_path, capsys):
    coco = write_coco(tmp_path / "c", n=3)
    coco["annotations"][0]["category_id"] = 99
    (tmp_path / "c" / "instances.json").write_text(json.dumps(coco))
    code = cli.main(["data", "convert", str(tmp_path / "c" / "images"), "--coco", str(tmp_path / "c" / "instances.json"),
                     "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code != 0 and "category_id 99" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("change, check", [
    ({"image/object/bbox/xmax": np.array([0.5], np.float32)}, "box_lengths"),
    ({"image/object/bbox/xmin": np.array([-0.2, 0.1], np.float32)}, "box_outside"),
    ({"image/object/bbox/ymin": np.array([0.1, 0.95], np.float32)}, "box_inverted"),
    ({"image/object/bbox/ymax": np.array([np.nan, 0.9], np.float32)}, "box_nonfinite"),
    ({LABEL_KEY: np.array([1, 3], np.int64)}, "box_label_range"),
    ({LABEL_KEY: np.array([0, 1], np.int64)}, "box_label_range"),
])
def test_each_bad_box_kind_is_named(change, check):
    ex = {"image/object/bbox/xmin": np.array([0.1, 0.2], np.float32),
          "image/object/bbox/ymin": np.array([0.1, 0.2], np.float32),
          "image/object/bbox/xmax": np.array([0.5, 0.6], np.float32),
          "image/object/bbox/ymax": np.array([0.5, 0.9], np.float32), LABEL_KEY: np.array([1, 2], np.int64)}
    boxes, labels = read_boxes(ex, num_classes=2)
    assert boxes.shape == (2, 4) and list(labels) == [1, 2]
    with pytest.raises(BoxProblem) as err:
        read_boxes({**ex, **change}, num_classes=2)
    assert err.value.check == check


TF_WRITE_OD = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf
job = json.loads(sys.argv[1])
rng = np.random.default_rng(0)
def b(v): return tf.train.Feature(bytes_list=tf.train.BytesList(value=v))
def n(v): return tf.train.Feature(int64_list=tf.train.Int64List(value=v))
def f(v): return tf.train.Feature(float_list=tf.train.FloatList(value=v))
with tf.io.TFRecordWriter(job["path"]) as w:
    for i in range(job["n"]):
        h, w_ = 20 + i % 3, 30
        image = tf.constant(rng.integers(0, 256, (h, w_, 3), dtype=np.uint8))
        k = i % 3
        xmin = [0.1 + 0.3 * j for j in range(k)]; ymin = [0.2] * k
        xmax = [x + 0.2 for x in xmin]; ymax = [0.7] * k
        labels = [1 + j % 2 for j in range(k)]
        if i == job["bad"]:
            xmin, xmax = xmax, xmin
        enc = tf.io.encode_jpeg(image, quality=95) if i % 2 else tf.io.encode_png(image)
        w.write(tf.train.Example(features=tf.train.Features(feature={
            "image/encoded": b([enc.numpy()]), "image/format": b([b"jpeg" if i % 2 else b"png"]),
            "image/height": n([h]), "image/width": n([w_]), "image/filename": b([b"img%d" % i]),
            "image/source_id": b([b"%d" % i]),
            "image/object/bbox/xmin": f(xmin), "image/object/bbox/ymin": f(ymin),
            "image/object/bbox/xmax": f(xmax), "image/object/bbox/ymax": f(ymax),
            "image/object/class/label": n(labels),
            "image/object/class/text": b([[b"scratch", b"dent"][l - 1] for l in labels]),
            "image/object/difficult": n([0] * k), "image/object/is_crowd": n([0] * k)})).SerializeToString())
"""

TF_READ_OD = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
spec = {"image/encoded": tf.io.FixedLenFeature((), tf.string), "image/source_id": tf.io.FixedLenFeature((), tf.string),
        **{k: tf.io.VarLenFeature(tf.float32) for k in ("image/object/bbox/xmin", "image/object/bbox/ymin",
                                                         "image/object/bbox/xmax", "image/object/bbox/ymax")},
        "image/object/class/label": tf.io.VarLenFeature(tf.int64)}
out = []
for raw in tf.data.TFRecordDataset(sys.argv[1]):
    ex = tf.io.parse_single_example(raw, spec)
    box = tf.stack([tf.sparse.to_dense(ex["image/object/bbox/" + k]) for k in ("xmin", "ymin", "xmax", "ymax")], 1)
    out.append({"id": ex["image/source_id"].numpy().decode(), "boxes": box.numpy().tolist(),
                "labels": tf.sparse.to_dense(ex["image/object/class/label"]).numpy().tolist(),
                "hw": tf.io.decode_image(ex["image/encoded"]).shape.as_list()[:2]})
print(json.dumps(out))
"""


def test_tensorflow_written_detection_records_read_back(tmp_path, interop_python):
    data = tmp_path / "tf-od.tfrecord"
    done = subprocess.run([str(interop_python), "-c", TF_WRITE_OD, json.dumps({"path": str(data), "n": 6, "bad": 4})],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for i, record in enumerate(read_records(data)):
        if i == 4:
            with pytest.raises(BoxProblem, match="xmin >= xmax"):
                read_detection_example(record)
            continue
        image, boxes, labels = read_detection_example(record, num_classes=2)
        assert Image.open(io.BytesIO(image)).size == (30, 20 + i % 3)
        k = i % 3
        assert boxes.shape == (k, 4) and list(labels) == [1 + j % 2 for j in range(k)]
        assert np.allclose(boxes, [[0.1 + 0.3 * j, 0.2, 0.3 + 0.3 * j, 0.7] for j in range(k)] or np.zeros((0, 4)))
    report, status = run_check([(str(data), None)], tmp_path / "chk", progress=False, num_classes=2)
    assert status == 0 and report["checks"]["box_inverted"] == 1 and report["records_quarantined"] == 1
    det = report["detection"]
    assert det["images_without_boxes"] == 2 and det["boxes_per_class"] == {"1": 3, "2": 2}


def test_tensorflow_reads_the_records_we_write(tmp_path, interop_python):
    write_coco(tmp_path / "c", n=5)
    classes, items = read_coco(tmp_path / "c" / "instances.json", tmp_path / "c" / "images")
    (path,) = convert_boxes(classes, items, tmp_path / "out", {"coco": "x"})
    done = subprocess.run([str(interop_python), "-c", TF_READ_OD, str(path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = {t["id"]: t for t in json.loads(done.stdout)}
    for record in read_records(path):
        ex = decode_example(record)
        _, boxes, labels = read_detection_example(record)
        t = theirs[ex["image/source_id"][0].decode()]
        assert t["hw"] == [H, W] and t["labels"] == labels.tolist()
        assert np.allclose(np.array(t["boxes"]).reshape(-1, 4), boxes)
