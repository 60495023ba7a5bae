"""appliance quantize: INT8 (S8S8 QDQ) and FP16 with an accuracy report, and the gate both ways."""

import json

import numpy as np
import onnx
import pytest

from conftest import run_appliance
from appliance.core.manifest import read_manifest


@pytest.mark.parametrize("mode,scheme", [("int8", "s8s8"), ("int8", "u8s8"), ("fp16", "s8s8")])
def test_quantize_passes_the_gate_with_a_report(tmp_path, exported, calib_tfrecord, val_tfrecord, mode, scheme):
    out = tmp_path / mode
    proc = run_appliance("quantize", str(exported / "model.onnx"), "--calib", str(calib_tfrecord),
                         "--val", str(val_tfrecord), "--out", str(out), "--mode", mode, "--calib-samples", "48",
                         "--scheme", scheme, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "accuracy.json").read_text())
    assert json.loads(proc.stdout) == report  # --json: the report as one object on stdout
    assert report["fp32"]["top1"] >= 0.9  # the fixture model really learned the task
    assert report["gate_passed"] and report["top1_drop_points"] <= 1.0
    assert report["validation_samples"] == 96 and report["calibration_samples"] == 48 and report["prediction_agreement"] >= 0.98
    assert report["quantized"]["bytes"] < report["fp32"]["bytes"] * (0.35 if mode == "int8" else 0.6)

    model = onnx.load(str(out / f"model.{mode}.onnx"))
    ops = {n.op_type for n in model.graph.node}
    if mode == "int8":
        assert {"QuantizeLinear", "DequantizeLinear"} <= ops
        scales = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
        zero_points = {i.name: i for i in model.graph.initializer}
        activation = onnx.TensorProto.INT8 if scheme == "s8s8" else onnx.TensorProto.UINT8
        # Weights are stored already quantized: every QuantizeLinear is an activation.
        assert scales and all(zero_points[n.input[2]].data_type == activation for n in scales)
    else:
        assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in model.graph.initializer)
    assert "appliance.preprocessing" in {p.key for p in model.metadata_props}

    page = (out / "accuracy.html").read_text()
    assert "<svg" in page and "PASS" in page and "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    manifest = read_manifest(out)
    assert {i["path"] for i in manifest["inputs"]} >= {str(calib_tfrecord), str(val_tfrecord)}
    assert manifest["params"]["gate_passed"] and manifest["lineage"][-1]["stage"] == "export"


def test_gate_fails_when_calibration_misses_the_signal(tmp_path, exported, val_tfrecord):
    # Calibrating on flat background images sets activation ranges that clip every bright square.
    flat = tmp_path / "flat.npz"
    np.savez(flat, x=np.full((4, 3, 16, 16), -0.66, np.float32), y=np.zeros(4, np.int64))
    out = tmp_path / "bad"
    proc = run_appliance("quantize", str(exported / "model.onnx"), "--calib", str(flat), "--val", str(val_tfrecord),
                         "--out", str(out), "--fallback", "none", "--no-sensitivity")
    assert proc.returncode == 3 and len(proc.stderr.strip().splitlines()) == 1  # GateFailed
    assert "top-1 dropped" in proc.stderr and "more than --max-drop 1" in proc.stderr
    report = json.loads((out / "accuracy.json").read_text())
    assert not report["gate_passed"] and report["top1_drop_points"] > 1.0 and report["produced_by"] == "none (gate failed)"
    assert "FAIL" in (out / "accuracy.html").read_text()
    # ... and that model does not slip through to a device.
    proc = run_appliance("compile", str(out / "model.int8.onnx"), "--target", "aarch64", "--out", str(tmp_path / "c"))
    assert proc.returncode == 2 and "failed the accuracy gate of `appliance quantize`" in proc.stderr


def test_calibration_set_of_the_wrong_shape_is_one_line(tmp_path, exported):
    wrong = tmp_path / "calib.npz"
    np.savez(wrong, x=np.zeros((4, 1, 28, 28), np.float32), y=np.zeros(4, np.int64))
    proc = run_appliance("quantize", str(exported / "model.onnx"), "--calib", str(wrong), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert f"{wrong}: samples have shape (N, 1, 28, 28) but" in lines[0] and "expects (batch, 3, 16, 16)" in lines[0]
    assert not (tmp_path / "o" / "model.int8.onnx").exists()


def test_fallback_auto_recovers_what_a_bad_calibration_lost(tmp_path, exported, val_tfrecord):
    # The same flat calibration: by default the first convolution, whose input range the flat
    # images miss, stays in float and the model passes; the report says so.
    flat = tmp_path / "flat.npz"
    np.savez(flat, x=np.full((4, 3, 16, 16), -0.66, np.float32), y=np.zeros(4, np.int64))
    out = tmp_path / "auto"
    proc = run_appliance("quantize", str(exported / "model.onnx"), "--calib", str(flat), "--val", str(val_tfrecord),
                         "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "accuracy.json").read_text())
    assert report["gate_passed"] and report["produced_by"] == "float layers"
    assert report["float_layers"] == ["/0/0.0/Conv"] and "kept in float: /0/0.0/Conv" in proc.stdout
    manifest = read_manifest(out)
    assert manifest["params"]["float_layers"] == ["/0/0.0/Conv"] and manifest["params"]["gate_passed"]
    proc = run_appliance("compile", str(out / "model.int8.onnx"), "--target", "aarch64", "--out", str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr  # a passing fallback model is not refused
