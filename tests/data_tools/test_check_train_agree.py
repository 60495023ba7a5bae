"""Every record `appliance data check` passes, training accepts: a seeded corpus of real TFRecord
bytes (good records, broken labels, odd and hostile images, damaged protobufs) is checked, and
training's own dataset then reads every clean record without an error. The label rules are one
function (data_tools.labels) on both sides; this proves the whole record path agrees.
"""

import io
import json

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from appliance.train.config import load_config
from appliance.train.data import _dataset
from data_tools.check.run import run_check
from data_tools.example import encode_example
from data_tools.tfrecord import write_records

SEED = 31
NUM_CLASSES = 5


def png(array: np.ndarray, mode: str | None = None, **save) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array, mode=mode).save(out, format="PNG", **save)
    return out.getvalue()


def jpeg(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="JPEG", quality=80)
    return out.getvalue()


def ztxt_bomb(rng) -> bytes:
    """A valid small PNG whose zTXt chunk inflates past Pillow's text limit (ValueError at open)."""
    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "A" * (16 << 20), zip=True)  # 16 MiB of text, ~16 KiB compressed
    return png(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), pnginfo=info)


def image(rng) -> bytes:
    """An image of some kind, mostly decodable, some hostile."""
    kind = int(rng.integers(0, 12))
    pixels = rng.integers(0, 255, (int(rng.integers(1, 24)), int(rng.integers(1, 24)), 3), dtype=np.uint8)
    if kind == 0:
        return png(pixels[..., 0])  # grey
    if kind == 1:
        return png(np.dstack([pixels, pixels[..., :1]]))  # RGBA
    if kind == 2:
        return png(pixels[..., 0].astype(np.uint16) * 257)  # 16-bit grey
    if kind == 3:
        return jpeg(pixels)
    if kind == 4:
        return png(pixels)[: int(rng.integers(8, 60))]  # truncated
    if kind == 5:
        return ztxt_bomb(rng)
    if kind == 6:
        return rng.bytes(int(rng.integers(0, 200)))  # not an image
    if kind == 7:
        return Image.fromarray(pixels).convert("P").tobytes() and _palette_png(pixels)
    if kind == 8:
        return jpeg(pixels)[:-int(rng.integers(1, 40))]  # a JPEG cut short
    return png(pixels)


def _palette_png(pixels) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).convert("P").save(out, format="PNG")
    return out.getvalue()


def label(rng):
    """A label feature value as encode_example takes it, or None (absent); mostly valid."""
    kind = int(rng.integers(0, 14))
    return {0: None, 1: np.array([], dtype=np.int64), 2: [1, 2], 3: 99, 4: -1, 5: 2**62, 6: -(2**63), 7: 2.0, 8: b"3",
            9: NUM_CLASSES}.get(kind, int(rng.integers(0, NUM_CLASSES)))


def corpus(rng, n: int) -> list[bytes]:
    records = []
    for _ in range(n):
        features = {"image/encoded": image(rng)}
        value = label(rng)
        if value is not None:
            features["image/class/label"] = value
        record = encode_example(features)
        if rng.random() < 0.1:  # a damaged protobuf (the framing stays valid)
            data = bytearray(record)
            for _ in range(int(rng.integers(1, 4))):
                data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
            record = bytes(data)
        records.append(record)
    # Enough good records of every class that the inferred class count is NUM_CLASSES.
    good = [encode_example({"image/encoded": png(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)),
                            "image/class/label": i % NUM_CLASSES}) for i in range(5 * NUM_CLASSES)]
    return good + records


def train_config(tmp_path, files, channels: int, num_classes: int = NUM_CLASSES) -> object:
    mean = ", ".join(["0.5"] * channels)
    path = tmp_path / f"train-{channels}.toml"
    path.write_text(f'[run]\nname = "agree"\n[data]\ntrain = {[str(f) for f in files]!r}\n'.replace("'", '"')
                    + f"num_classes = {num_classes}\nimage_size = 8\nchannels = {channels}\n"
                    f"mean = [{mean}]\nstd = [{mean}]\nnum_workers = 0\n")
    return load_config(path)


@pytest.mark.parametrize("schema_given", [False, True])
def test_every_record_the_check_passes_trains(tmp_path, schema_given):
    rng = np.random.default_rng(SEED + schema_given)
    write_records(tmp_path / "corpus.tfrecord", corpus(rng, 160))
    schema = None
    if schema_given:
        schema = tmp_path / "schema.json"
        schema.write_text('{"num_classes": %d, "features": {"image/encoded": {"dtype": "bytes", "required": true, '
                          '"min_count": 1, "max_count": 1}, "image/class/label": {"dtype": "int64", '
                          '"required": true}}}' % NUM_CLASSES)
    report, _ = run_check([(str(tmp_path / "corpus.tfrecord"), None)], tmp_path / "out", schema_path=schema,
                          jobs=1, progress=False)
    assert report["records_valid"] >= 5 * NUM_CLASSES and report["records_quarantined"] > 50
    clean = [tmp_path / "out" / f["clean_shard"] for f in report["files"] if f.get("clean_shard")]
    # The classes the check judged by (given, or inferred from all labels) are the config's.
    classes = json.loads((tmp_path / "out" / "schema.json").read_text())["num_classes"]
    assert classes == NUM_CLASSES or not schema_given
    for channels in (1, 3):
        dataset = _dataset(train_config(tmp_path, clean, channels, classes), tuple(map(str, clean)))
        assert len(dataset) == report["records_valid"]
        for index in range(len(dataset)):
            image_tensor, target = dataset[index]  # raises DataError for a record training refuses
            assert tuple(image_tensor.shape) == (channels, 8, 8) and 0 <= target < classes


def test_training_refuses_what_the_check_quarantines_with_the_records_address(tmp_path):
    from appliance.core.errors import DataError

    rng = np.random.default_rng(SEED)
    good = png(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8))
    cases = [({"image/class/label": [1, 2]}, "has 2 values; a class label is exactly one"),
             ({"image/class/label": np.array([], dtype=np.int64)}, "has 0 values"),
             ({}, "missing required feature 'image/class/label'"),
             ({"image/class/label": 2.0}, "holds float32 numbers, not an int64 class"),
             ({"image/class/label": 2**62}, f"label {2**62} is outside 0..4 (the config has 5 classes)"),
             ({"image/class/label": 1, "image/encoded": ztxt_bomb(rng)}, "image_decode: ")]
    write_records(tmp_path / "bad.tfrecord", [encode_example({"image/encoded": good, **f}) for f, _ in cases])
    dataset = _dataset(train_config(tmp_path, [tmp_path / "bad.tfrecord"], 3), (str(tmp_path / "bad.tfrecord"),))
    for number, (_, expected) in enumerate(cases):
        with pytest.raises(DataError) as err:
            dataset[number]
        assert str(err.value).startswith(f"{tmp_path / 'bad.tfrecord'}: record {number}: ") and expected in str(err.value)


def test_check_judges_labels_by_the_configs_classes_as_training_does(tmp_path, capsys):
    """A label 99 among classes 0..4 passed `data check` (it inferred 100 classes from that one record;
    --num-classes applied to masks only) while training refused it: with --num-classes (the pipeline
    passes the config's) it is quarantined as label_range, and an inferred class count is stated."""
    rng = np.random.default_rng(SEED)
    records = [encode_example({"image/encoded": png(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)),
                               "image/class/label": label}) for label in (0, 1, 2, 3, 4, 99)]
    write_records(tmp_path / "c.tfrecord", records)
    report, _ = run_check([(str(tmp_path / "c.tfrecord"), None)], tmp_path / "given", jobs=1, progress=False,
                          num_classes=NUM_CLASSES)
    assert report["records_valid"] == 5 and report["checks"].get("label_range") == 1
    assert report["labels"]["num_classes"] == NUM_CLASSES and report["labels"]["num_classes_source"] == \
        "given by --num-classes"
    clean = tmp_path / "given" / report["files"][0]["clean_shard"]
    dataset = _dataset(train_config(tmp_path, [clean], 3), (str(clean),))
    assert sorted(int(dataset[i][1]) for i in range(len(dataset))) == [0, 1, 2, 3, 4]
    capsys.readouterr()
    report, _ = run_check([(str(tmp_path / "c.tfrecord"), None)], tmp_path / "inferred", jobs=1, progress=False)
    assert report["labels"]["num_classes_source"] == "inferred from the labels of 6 records"
    assert f"classes: {report['labels']['num_classes']}, inferred from the labels of 6 records" in \
        capsys.readouterr().out


def test_the_pipeline_checks_classification_labels_against_the_configs_classes():
    from appliance.tasks import task_for

    assert task_for(None).check_options(7) == {"num_classes": 7}
    assert task_for({"kind": "segmentation"}).check_options(3)["num_classes"] == 3
