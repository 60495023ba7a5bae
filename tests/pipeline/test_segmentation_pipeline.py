"""The acceptance run of issue 29: segmentation TFRecords written by TensorFlow's own writer (in
.venv-interop) in DeepLab's convention, through `appliance pipeline`: check -> train -> gate -> export
-> quantize -> compile (x86_64, aarch64) -> package -> verify under qemu-aarch64, offline.

The pixels are made here (numpy); TensorFlow encodes them (tf.io.encode_png / encode_jpeg) and writes
the tf.train.Example records and their framing. Three records are bad the ways a site's masks are
bad: a mask of the wrong size, a class past the config's classes, bytes that are no PNG. They must
be quarantined with file, record and reason, and never reach training.
"""

import json
import subprocess

import numpy as np
import pytest

from appliance.tasks.segmentation import Segmentation
from conftest import appliance_cmd, offline_cmd

pytestmark = pytest.mark.slow

SIZE = 32
CLASSES = ["surface", "scratch", "spot"]
BAD = {3: "mask_size", 10: "mask_label_range", 17: "mask_decode"}  # record number in train -> check

TF_WRITE = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf
job = json.loads(sys.argv[1])
def b(v): return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v]))
def n(v): return tf.train.Feature(int64_list=tf.train.Int64List(value=[v]))
for split, path in job["shards"].items():
    arrays = np.load(job["arrays"][split])
    images, masks = arrays["images"], arrays["masks"]
    with tf.io.TFRecordWriter(path) as w:
        for i, (image, mask) in enumerate(zip(images, masks)):
            h, wd = image.shape[:2]
            mask_png = tf.io.encode_png(mask[..., None]).numpy()
            bad = job["bad"].get(str(i)) if split == "train" else None
            if bad == "mask_size":
                mask_png = tf.io.encode_png(mask[:-4, :, None]).numpy()
            elif bad == "mask_label_range":
                wrong = mask.copy(); wrong[8:12, 8:12] = 7
                mask_png = tf.io.encode_png(wrong[..., None]).numpy()
            elif bad == "mask_decode":
                mask_png = b"this is not a PNG" + mask_png[40:80]
            jpeg = i % 4 == 1
            enc = (tf.io.encode_jpeg(image, quality=97) if jpeg else tf.io.encode_png(image)).numpy()
            w.write(tf.train.Example(features=tf.train.Features(feature={
                "image/encoded": b(enc), "image/filename": b(b"%s_%03d" % (split.encode(), i)),
                "image/format": b(b"jpeg" if jpeg else b"png"), "image/height": n(h), "image/width": n(wd),
                "image/segmentation/class/encoded": b(mask_png),
                "image/segmentation/class/format": b(b"png")})).SerializeToString())
"""


def scenes(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Noisy grey-brown surfaces; a bright scratch band (class 1) and a dark spot (class 2); an ignored border."""
    rng = np.random.default_rng(seed)
    images = rng.integers(90, 140, (n, SIZE, SIZE, 3)).astype(np.int16)
    masks = np.zeros((n, SIZE, SIZE), np.uint8)
    for image, mask in zip(images, masks):
        row, col = rng.integers(2, SIZE - 6), rng.integers(0, SIZE // 3)
        mask[row:row + 3, col:col + rng.integers(SIZE // 2, SIZE - col)] = 1
        r, c = rng.integers(0, SIZE - 9, 2)
        mask[r:r + 8, c:c + 8] = 2
        image[mask == 1] += 100
        image[mask == 2] -= 70
        mask[-1, :] = 255  # unlabelled border row, as DeepLab datasets mark it
    return images.clip(0, 255).astype(np.uint8), masks


CONFIG = """
[pipeline]
out = "out"
nproc_per_node = "1"

[check]
fail_on = "corrupt>0,quarantined_fraction>0.1"

[run]
name = "tf-deeplab"
seed = 0
deterministic = true
log_every = 5

[task]
kind = "segmentation"
class_weights = [0.3, 1.0, 1.0]

[data]
train = ["data/train.tfrecord"]
val = ["data/val.tfrecord"]
classes = {classes}
image_size = {size}
channels = 3
mean = [0.45, 0.45, 0.45]
std = [0.2, 0.2, 0.2]
num_workers = 0

[model]
architecture = "unet_small"

[optimizer]
name = "adamw"
lr = 0.01

[train]
epochs = 2
batch_size = 8
precision = "fp32"

[checkpoint]
every_steps = 100
keep_last = 1
keep_best = 0
min_free_gb = 0.0

[quantize]
calib_samples = 32
max_drop = 1.0

[compile]
targets = ["x86_64", "aarch64"]

[package]
target = "aarch64"

[verify]
min_agreement = 0.995
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """TensorFlow writes the shards; `appliance pipeline` runs every stage on them, offline."""
    from conftest import INTEROP_PYTHON

    if not INTEROP_PYTHON.exists():
        pytest.fail(".venv-interop missing: run installer/bootstrap.sh --interop")
    root = tmp_path_factory.mktemp("tf-seg")
    (root / "data").mkdir()
    job = {"shards": {}, "arrays": {}, "bad": {str(k): v for k, v in BAD.items()}}
    for split, n, seed in (("train", 48, 1), ("val", 16, 2)):
        images, masks = scenes(n, seed)
        np.savez(root / f"{split}.npz", images=images, masks=masks)
        job["shards"][split], job["arrays"][split] = str(root / "data" / f"{split}.tfrecord"), str(root / f"{split}.npz")
    done = subprocess.run([str(INTEROP_PYTHON), "-c", TF_WRITE, json.dumps(job)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (root / "pipeline.toml").write_text(CONFIG.format(classes=json.dumps(CLASSES), size=SIZE))
    proc = subprocess.run(offline_cmd(appliance_cmd("pipeline", str(root / "pipeline.toml")), loopback=True),
                          capture_output=True, text=True, timeout=1500)
    return root, proc


def test_bad_masks_are_quarantined_with_file_record_and_reason_and_never_trained_on(run):
    root, proc = run
    check = root / "out" / "check"
    report = json.loads((check / "report.json").read_text())
    assert report["records_total"] == 64 and report["records_quarantined"] == 3, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (check / "quarantine" / "reasons.jsonl").read_text().splitlines()[1:]]
    assert {(x["file"], x["record_number"], x["check"]) for x in lines} == {
        (str(root / "data" / "train.tfrecord"), number, reason) for number, reason in BAD.items()}
    assert all(x["detail"] and x["offset"] is not None for x in lines)
    assert report["segmentation"]["num_classes"] == 3
    # Training read the clean shards only: 45 train records, every one of them labelled in range.
    train_config = (root / "out" / "train" / "config.toml").read_text()
    assert str(check / "clean") in train_config and str(root / "data" / "train.tfrecord") not in train_config


def test_train_gate_and_export_report_miou(run):
    root, proc = run
    out = root / "out"
    evals = [r for r in map(json.loads, (out / "train" / "metrics.jsonl").read_text().splitlines()) if "val_miou" in r]
    assert len(evals) == 2 and set(evals[-1]["val_iou"]) == set(CLASSES), proc.stderr[-3000:]
    quality = json.loads((out / "gate" / "quality.json").read_text())
    assert quality["passed"] and quality["val_miou"] > quality["required_miou"] > quality["baseline_miou"], quality
    parity = json.loads((out / "export" / "parity.json").read_text())["parity"]
    # onnxruntime's class maps against PyTorch's, per pixel of every validation image.
    assert parity["passed"] and parity["samples"] == 16 and parity["top1_agreement"] >= 0.999, parity


def test_the_summary_names_each_finished_stage_in_miou_and_pixel_agreement(run):
    """The summary of the stages that finished, built from their results on disk as the pipeline builds it."""
    from appliance.pipeline.config import load_pipeline_config
    from appliance.pipeline.plan import Results, plan
    from appliance.pipeline.summary import build_summary, index_html

    root, proc = run
    cfg = load_pipeline_config(root / "pipeline.toml")
    results = Results(cfg)
    for stage in plan(cfg):
        record = root / "out" / ".pipeline" / f"{stage.out_dir.name}.json"
        if record.exists() and json.loads(record.read_text())["completed"]:
            stage.keep(results, stage.load(stage.out_dir))
    assert results.compiled.keys() == {"x86_64", "aarch64"}, proc.stderr[-3000:]
    summary = build_summary(cfg, results, [], 0.0)
    acc = summary["accuracy"]
    assert summary["task"] == {"kind": "segmentation", "metric": "miou", "metric_label": "mIoU"}
    quality = json.loads((root / "out" / "gate" / "quality.json").read_text())
    assert acc["train_val_miou"] == pytest.approx(quality["val_miou"])
    assert acc["val_most_common_class_baseline_miou"] == quality["baseline_miou"] < acc["train_val_miou"]
    assert acc["quality_gate_required_miou"] == quality["required_miou"]
    assert acc["export_pixel_agreement_with_pytorch"] >= 0.999
    assert acc["compile_x86_64_pixel_agreement_with_ort"] >= 0.995
    assert "top1" not in " ".join(acc)  # no classification names on a segmentation summary
    page = index_html(summary, results)
    assert "mIoU at each stage" in page and f"{100 * acc['train_val_miou']:.2f} %" in page


# The segmentation deploy work (branch segdeploy, issue 29 item 5) gives the task its device agreement bar
# (Segmentation.min_agreement); without it `package` stops in write_selftest (package.py compares per-image
# margins and gets (K, H, W) arrays: "truth value of an array is ambiguous") and quantize scores pixel
# accuracy as top-1. With segdeploy's tip merged this test passes (checked on the merged tree).
@pytest.mark.xfail(not hasattr(Segmentation, "min_agreement"), strict=True,
                   reason="segmentation package/verify (branch segdeploy) not merged yet: package fails in write_selftest")
def test_every_stage_reports_miou_and_the_device_agrees_with_the_host(run):
    root, proc = run
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((root / "out" / "summary.json").read_text())
    acc = summary["accuracy"]
    assert summary["task"] == {"kind": "segmentation", "metric": "miou", "metric_label": "mIoU"}
    for key in ("train_val_miou", "val_most_common_class_baseline_miou", "quality_gate_required_miou",
                "export_pixel_agreement_with_pytorch", "fp32_miou", "int8_miou", "quantized_miou_drop_points",
                "int8_symmetric_miou", "int8_asymmetric_miou", "compile_x86_64_pixel_agreement_with_ort",
                "edge_agreement_with_host", "edge_miou"):
        assert isinstance(acc.get(key), float), (key, acc)
    assert acc["train_val_miou"] > acc["val_most_common_class_baseline_miou"]
    assert acc["quantized_miou_drop_points"] <= 1.0 and acc["edge_agreement_with_host"] >= 0.995
    assert "mIoU at each stage" in (root / "out" / "index.html").read_text()
    assert "fp32_miou" in proc.stdout and "%" in proc.stdout
