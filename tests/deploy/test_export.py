"""appliance export: ONNX from a run directory, checked and proven equal to PyTorch."""

import json

import numpy as np
import onnx
import onnxruntime as ort

from conftest import offline_cmd, run_appliance
from appliance.core.manifest import read_manifest, verify_outputs


def test_export_offline_from_run_dir_with_parity(tmp_path, run_dir, val_tfrecord, val_npz):
    import subprocess

    from conftest import appliance_cmd

    out = tmp_path / "export"
    proc = subprocess.run(offline_cmd(appliance_cmd("export", str(run_dir), "--out", str(out),
                                                    "--samples", str(val_tfrecord))),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "parity on 64 tfrecord samples" in proc.stdout
    report = json.loads((out / "parity.json").read_text())
    assert "<svg" in (out / "parity.html").read_text()
    assert report["parity"]["passed"] and report["parity"]["max_rel_error"] <= 1e-5
    assert report["parity"]["top1_agreement"] == 1.0

    model = onnx.load(str(out / "model.onnx"))
    onnx.checker.check_model(model)
    assert [i.name for i in model.graph.input] == ["input"] and [o.name for o in model.graph.output] == ["logits"]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    meta = {p.key: json.loads(p.value) for p in model.metadata_props}
    assert meta["appliance.preprocessing"] == {"image_size": 16, "mean": [0.2] * 3, "std": [0.3] * 3,
                                               "channel_order": "RGB"}
    assert meta["appliance.class_names"][0] == "north-west"

    manifest = read_manifest(out)
    assert manifest["stage"] == "export" and verify_outputs(out) == []
    assert {p.rsplit("/", 1)[-1] for p in (i["path"] for i in manifest["inputs"])} >= {
        "model.safetensors", "model.json", "val.tfrecord"}

    # The dynamic batch axis really is dynamic.
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    x = np.load(val_npz)["x"][:5]
    assert session.run(None, {"input": x})[0].shape == (5, 4)


def test_export_fixed_batch_from_checkpoint_dir(tmp_path, run_dir):
    out = tmp_path / "export"
    proc = run_appliance("export", str(run_dir / "model"), "--out", str(out), "--batch", "3")
    assert proc.returncode == 0, proc.stderr
    assert "16 synthetic samples" in proc.stdout
    dim = onnx.load(str(out / "model.onnx")).graph.input[0].type.tensor_type.shape.dim[0]
    assert dim.dim_value == 3  # 16 samples: the last chunk of 3 is padded for the parity run


def test_export_rejects_a_directory_without_a_model(tmp_path):
    proc = run_appliance("export", str(tmp_path), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a run directory or trained-model directory" in lines[0]
    assert str(tmp_path) in lines[0]


def test_parity_gate_fails_when_limit_is_below_float_noise(tmp_path, run_dir, val_npz):
    proc = run_appliance("export", str(run_dir), "--out", str(tmp_path / "o"), "--samples", str(val_npz),
                         "--max-rel-error", "0")
    # float32 convolution order differs between PyTorch and onnxruntime: exactly 0 is unreachable.
    assert proc.returncode == 2
    assert "ONNX differs from PyTorch: max relative error" in proc.stderr
    assert json.loads((tmp_path / "o" / "parity.json").read_text())["parity"]["passed"] is False
