"""Segmentation through quantize, compile, package and edge verify: a real unet_small trained for a few
seconds on DeepLab-convention TFRecords, its INT8 gated on mIoU with both activation schemes, its x86
build checked per pixel against onnxruntime, its aarch64 package run under qemu, writing PNG class maps."""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from seg_data import SEG_CLASSES, seg_records  # noqa: E402

from appliance.core.errors import GateFailed
from appliance.deploy.samples import load_samples
from appliance.deploy.verify import compare_with_host
from appliance.tasks import task_for
from data_tools.tfrecord import write_records

SIZE = 16
PRE = {"image_size": SIZE, "mean": [0.4], "std": [0.2], "channel_order": "L"}
HEADER = Path(__file__).resolve().parents[2] / "appliance" / "deploy" / "edge" / "class_map_png.h"


@pytest.fixture(scope="module")
def seg_export(tmp_path_factory):
    """(export dir, calibration shard, validation shard) of a unet_small that learned the scenes."""
    import torch

    from appliance.deploy.export import export_model
    from appliance.models import ModelCard, save_trained_model
    from appliance.tasks.segmentation_models import build_segmentation_model

    root = tmp_path_factory.mktemp("seg")
    write_records(root / "train.tfrecord", seg_records(64, seed=1, size=SIZE))
    write_records(root / "val.tfrecord", seg_records(12, seed=2, size=SIZE))
    train = load_samples([root / "train.tfrecord"], PRE)
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
    torch.manual_seed(0)
    model = build_segmentation_model("unet_small", 3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny batches: a second thread only waits on a shared, loaded box (30x slower here)
    try:
        for _ in range(10):
            for i in range(0, len(x), 16):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[i:i + 16]), y[i:i + 16], ignore_index=255).backward()
                opt.step()
    finally:
        torch.set_num_threads(threads)
    card = ModelCard("unet_small", 3, 1, SIZE, mean=(0.4,), std=(0.2,), channel_order="L", class_names=SEG_CLASSES,
                     extra={"task": {"kind": "segmentation", "ignore_label": 255}})
    save_trained_model(root / "run" / "model", model.eval(), card)
    export_model(root / "run", root / "export", sample_files=[root / "val.tfrecord"])
    return root / "export", root / "train.tfrecord", root / "val.tfrecord"


def test_int8_gate_counts_miou_points_and_reports_both_activation_schemes(seg_export, tmp_path):
    import onnx

    from appliance.deploy.onnx_model import ort_session, run_ort
    from appliance.deploy.quantize import quantize_stage

    export, calib, val = seg_export
    # No drop can be <= -50 points: the gate must fail, after writing the report, in mIoU words.
    with pytest.raises(GateFailed, match=r"int8 mIoU dropped -?\d+\.\d\d points, more than --max-drop -50"):
        quantize_stage(export / "model.onnx", [calib], [val], tmp_path, mode="int8", method="minmax",
                       per_channel=False, calib_samples=32, max_drop=-50.0, fallback="none", sensitivity=False)
    report = json.loads((tmp_path / "accuracy.json").read_text())
    assert report["metric"] == "miou" and "top1" not in report["fp32"] and not report["gate_passed"]
    rows = {r["scheme"]: r for r in report["schemes"]}
    assert list(rows) == ["FP32", "INT8 symmetric", "INT8 asymmetric"]
    kept = rows[f"INT8 {report['activation_scheme']}"]
    assert kept["miou"] == max(rows["INT8 symmetric"]["miou"], rows["INT8 asymmetric"]["miou"])
    # The figures are the shipped model's, measured again here with the task's own mIoU.
    samples = load_samples([val], PRE)
    seg = task_for({"kind": "segmentation"})
    int8 = run_ort(ort_session(tmp_path / "model.int8.onnx"), samples.x)
    assert seg.score(int8, samples.y) == pytest.approx(report["quantized"]["miou"])
    assert report["fp32"]["miou"] > 0.6  # the model learned the scenes: a meaningful gate
    assert report["miou_drop_points"] == pytest.approx((report["fp32"]["miou"] - report["quantized"]["miou"]) * 100)
    zero_points = [onnx.numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "model.int8.onnx")).graph.initializer
                   if t.name.endswith("_zero_point") and t.data_type == onnx.TensorProto.INT8]
    symmetric = all((z == 0).all() for z in zero_points)
    assert symmetric == (report["activation_scheme"] == "symmetric")
    html = (tmp_path / "accuracy.html").read_text()
    assert "Activation schemes" in html and "INT8 symmetric" in html and "<th>mIoU</th>" in html


@pytest.mark.slow  # a TVM build (20-40 s here)
def test_x86_build_is_checked_per_pixel_against_onnxruntime(seg_export, tmp_path):
    from appliance.deploy.compiler.driver import compile_model

    export, _, val = seg_export
    info = compile_model(export / "model.onnx", "x86_64", tmp_path, sample_files=[val])
    check = info["check"]
    assert check["task"] == "segmentation" and check["passed"] and check["samples"] == 12
    assert check["pixel_agreement"] >= check["min_pixel_agreement"] == 0.995


def test_pixel_agreement_gate_holds_at_99_5_and_fails_at_99_percent():
    seg = task_for({"kind": "segmentation"})
    host = np.random.default_rng(0).standard_normal((4, 3, 10, 10)).astype(np.float32)
    masks = host.argmax(1)
    edge = host.copy()
    edge[0, :, 0, :2] = np.roll(edge[0, :, 0, :2], 1, axis=0)  # two pixels of 400 change class: 0.5 %
    route = compare_with_host("device", edge, host, 1.0, "p.tar", seg.min_agreement, 10.0, masks, task=seg)
    assert route["pixel_agreement"] == 0.995 and route["passed"]
    edge[1, :, 5, :2] = np.roll(edge[1, :, 5, :2], 1, axis=0)  # two more: 1 %
    route = compare_with_host("device", edge, host, 1.0, "p.tar", seg.min_agreement, 10.0, masks, task=seg)
    assert route["pixel_agreement"] == 0.99 and not route["passed"] and route["disagreeing_samples"] == [0, 1]
    assert route["host_miou"] == 1.0 and route["miou"] < 1.0
    assert len(route["max_logit_diff_per_sample"]) == 4


def test_class_map_png_writer_round_trips_through_pil(tmp_path):
    """Two stored deflate blocks (a 300 x 300 map is over 65535 bytes), decoded by PIL's own zlib."""
    from PIL import Image

    driver = tmp_path / "png.cc"
    driver.write_text(f'#include "{HEADER}"\n#include <cstdlib>\n'
                      "int main(int, char** argv) { std::vector<uint8_t> m(300 * 300);\n"
                      "  for (size_t i = 0; i < m.size(); ++i) m[i] = static_cast<uint8_t>((i * 7 + i / 300) % 5);\n"
                      "  return classmap::Write(argv[1], m, 300, 300) ? 0 : 1; }\n")
    subprocess.run(["g++", "-std=c++17", "-O1", str(driver), "-o", str(tmp_path / "png")], check=True)
    subprocess.run([str(tmp_path / "png"), str(tmp_path / "map.png")], check=True)
    with Image.open(tmp_path / "map.png") as image:
        image.load()
        assert image.mode == "L" and image.size == (300, 300)
        got = np.asarray(image)
    i = np.arange(300 * 300)
    assert np.array_equal(got.ravel(), ((i * 7 + i // 300) % 5).astype(np.uint8))


@pytest.mark.slow  # a TVM build (20-40 s here)
def test_edge_package_writes_class_maps_and_verify_compares_pixels_and_miou(seg_export, tmp_path):
    from PIL import Image

    from appliance.deploy.compiler.driver import compile_model
    from appliance.deploy.edge.qemu import DEFAULT_SYSROOT, find_qemu
    from appliance.deploy.onnx_model import ort_session, run_ort
    from appliance.deploy.package import build_package
    from appliance.deploy.verify import verify_stage

    export, _, val = seg_export
    compile_model(export / "model.onnx", "aarch64", tmp_path / "arm")
    build_package(tmp_path / "arm", tmp_path / "edge.tar", sample_files=[val], golden_count=4)
    result = verify_stage(tmp_path / "edge.tar", tmp_path / "verify", sample_files=[val], num_samples=6, bench_runs=1)
    report = result.report
    route = report["routes"][0]
    assert report["task"] == "segmentation" and report["min_agreement"] == 0.995 and result.passed
    assert route["pixel_agreement"] >= 0.995 and route["class_maps"]["written"] == 6
    assert route["miou"] == pytest.approx(route["host_miou"], abs=0.01) and route["host_miou"] > 0.6
    assert report["selftest"]["passed"] and report["selftest"]["pixel_agreement"] >= 0.995
    assert "mIoU: native runner" in (tmp_path / "verify" / "verify.html").read_text()

    with tarfile.open(tmp_path / "edge.tar") as tar:
        tar.extractall(tmp_path / "pkg", filter="data")
    root = tmp_path / "pkg" / "edge-package"
    info = json.loads((root / "model.json").read_text())
    assert info["task"]["kind"] == "segmentation" and info["task"]["num_classes"] == 3
    golden = np.load(root / "selftest" / "masks.npy")
    assert golden.dtype == np.uint8 and golden.shape == (4, SIZE, SIZE)
    # bin/run on the device's own terms: one PNG per image and one JSON line each.
    x = load_samples([val], PRE, limit=3).x
    np.save(tmp_path / "in.npy", x)
    done = subprocess.run([find_qemu(), "-L", DEFAULT_SYSROOT, str(root / "bin" / "run"), "--input",
                           str(tmp_path / "in.npy"), "--masks", str(tmp_path / "masks")],
                          capture_output=True, text=True, timeout=120, check=True)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    host = run_ort(ort_session(root / "reference" / "model.onnx", optimize=False), x).argmax(1)
    for i, line in enumerate(lines):
        assert line["mask"].endswith(f"{i:04d}.png") and sum(line["class_pixels"]) == SIZE * SIZE
        with Image.open(line["mask"]) as image:
            assert (np.asarray(image) == host[i]).mean() >= 0.995
    assert len(lines) == 3


def test_python_runner_writes_the_same_class_map_png(tmp_path, monkeypatch):
    """python/run.py's writer (zlib-compressed, unlike bin/run's stored blocks) decodes to the argmax."""
    import importlib.util

    from PIL import Image

    # run.py sets TVM_USE_RUNTIME_LIB when unset; set here, so that it is unset again after this test.
    monkeypatch.setenv("TVM_USE_RUNTIME_LIB", "1")
    spec = importlib.util.spec_from_file_location("edge_run", HEADER.parent / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    logits = np.random.default_rng(3).standard_normal((4, 5, 7)).astype(np.float32)
    line = run.write_class_map(logits, 2, tmp_path / "masks")
    assert line["mask"].endswith("0002.png") and (line["height"], line["width"]) == (5, 7)
    assert sum(line["class_pixels"]) == 35
    with Image.open(line["mask"]) as image:
        assert image.mode == "L" and np.array_equal(np.asarray(image), logits.argmax(0))
