"""Detection through export and quantize: a real fcos_tiny trained for a few seconds on Object
Detection API records, exported to raw head outputs with onnxruntime parity, its INT8 gated in
mAP@.5 points measured by the task's own decoding and COCO evaluation."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from det_data import DET_CLASSES, det_records  # noqa: E402

from appliance.core.errors import GateFailed
from appliance.deploy.samples import load_samples
from appliance.tasks import task_for
from data_tools.tfrecord import write_records

SIZE = 48
PRE = {"image_size": SIZE, "mean": [0.4], "std": [0.2], "channel_order": "L"}


@pytest.fixture(scope="module")
def det_export(tmp_path_factory):
    """(export dir, calibration shard, validation shard) of an fcos_tiny that learned the scenes."""
    import torch

    from appliance.deploy.export import export_model
    from appliance.models import ModelCard, save_trained_model
    from appliance.tasks.detection_models import FCOSLoss, TinyFCOS

    root = tmp_path_factory.mktemp("det")
    write_records(root / "train.tfrecord", det_records(64, seed=1, size=SIZE))
    write_records(root / "val.tfrecord", det_records(24, seed=2, size=SIZE))
    train = load_samples([root / "train.tfrecord"], PRE)
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
    torch.manual_seed(0)
    model, loss = TinyFCOS(2, 1), FCOSLoss(8)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(12):
            for i in range(0, len(x), 16):
                opt.zero_grad()
                loss(model(x[i:i + 16]), y[i:i + 16]).backward()
                opt.step()
    finally:
        torch.set_num_threads(threads)
    task = task_for({"kind": "detection"})
    card = ModelCard("fcos_tiny", 2, 1, SIZE, mean=(0.4,), std=(0.2,), channel_order="L", class_names=DET_CLASSES,
                     extra=task.card_extra())
    save_trained_model(root / "run" / "model", model.eval(), card)
    export_model(root / "run", root / "export", sample_files=[root / "val.tfrecord"])
    return root / "export", root / "train.tfrecord", root / "val.tfrecord"


def test_export_ends_at_raw_outputs_with_parity(det_export):
    from appliance.deploy.onnx_model import ort_session, run_ort

    export, _, val = det_export
    parity = json.loads((export / "parity.json").read_text())
    assert parity["parity"]["passed"] and parity["parity"]["samples"] == 24
    samples = load_samples([val], PRE)
    raw = run_ort(ort_session(export / "model.onnx"), samples.x)
    assert raw.shape == (24, (SIZE // 8) ** 2, 5 + 2)
    assert task_for({"kind": "detection"}).score(raw, samples.y) > 0.3  # it learned: a meaningful gate below


def test_int8_gate_counts_map50_points(det_export, tmp_path):
    from appliance.deploy.onnx_model import ort_session, run_ort
    from appliance.deploy.quantize import quantize_stage

    export, calib, val = det_export
    with pytest.raises(GateFailed, match=r"mAP@\.5 dropped -?\d+\.\d\d points, more than --max-drop -50"):
        quantize_stage(export / "model.onnx", [calib], [val], tmp_path, mode="int8", method="minmax",
                       per_channel=True, calib_samples=32, max_drop=-50.0, fallback="none", sensitivity=False)
    report = json.loads((tmp_path / "accuracy.json").read_text())
    assert report["metric"] == "map50" and not report["gate_passed"]
    samples = load_samples([val], PRE)
    det = task_for({"kind": "detection"})
    int8 = run_ort(ort_session(tmp_path / "model.int8.onnx"), samples.x)
    assert det.score(int8, samples.y) == pytest.approx(report["quantized"]["map50"])
    assert report["map50_drop_points"] == pytest.approx((report["fp32"]["map50"] - report["quantized"]["map50"]) * 100)


@pytest.mark.slow  # a TVM build
def test_x86_build_is_checked_on_decoded_boxes_against_onnxruntime(det_export, tmp_path):
    from appliance.deploy.compiler.driver import compile_model

    export, _, val = det_export
    info = compile_model(export / "model.onnx", "x86_64", tmp_path, sample_files=[val])
    check = info["check"]
    assert check["task"] == "detection" and check["passed"] and check["samples"] == 24
    assert check["box_agreement"] >= check["min_box_agreement"] == 0.99


def test_verify_matches_device_boxes_to_host_boxes(det_export):
    from appliance.deploy.onnx_model import ort_session, run_ort
    from appliance.deploy.verify import compare_with_host

    export, _, val = det_export
    det = task_for({"kind": "detection"})
    samples = load_samples([val], PRE)
    host = run_ort(ort_session(export / "model.onnx"), samples.x)
    route = compare_with_host("device", host.copy(), host, 1.0, "p.tar", det.min_agreement, 10.0, samples.y, task=det)
    assert route["box_agreement"] == 1.0 and route["passed"] and route["map50"] == route["host_map50"] > 0.3
    moved = host.copy()
    moved[:12, :, :4] += 0.5  # half the images' boxes grow 1.6 times each way: no longer matched
    route = compare_with_host("device", moved, host, 1.0, "p.tar", det.min_agreement, 10.0, samples.y, task=det)
    assert route["box_agreement"] < 0.99 and not route["passed"] and route["map50"] < route["host_map50"]
