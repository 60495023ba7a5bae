"""`appliance compile --target cuda-ort | tensorrt`: one-line refusals without a GPU, the real
builds where there is one, and the symmetric INT8 Q/DQ model TensorRT is built from (runs on CPU)."""

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from appliance.deploy.gpu import routes as gpu_routes
from appliance.core.errors import EnvironmentProblem
from conftest import run_appliance


def _gpu_reason() -> str | None:
    try:
        gpu_routes.cuda_devices()
    except EnvironmentProblem as err:
        return str(err)
    return None


@pytest.mark.parametrize("target", gpu_routes.GPU_TARGETS)
def test_gpu_target_refuses_in_one_line_without_a_gpu_or_builds_with_one(tmp_path, exported, val_tfrecord,
                                                                          calib_tfrecord, target):
    out = tmp_path / "out"
    extra = ["--int8-calib", str(calib_tfrecord)] if target == "tensorrt" else []
    proc = run_appliance("compile", str(exported / "model.onnx"), "--target", target, "--out", str(out),
                         "--samples", str(val_tfrecord), *extra)
    reason = _gpu_reason()
    if reason is not None:
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert str(exported / "model.onnx") in lines[0] and f"--target {target} needs an NVIDIA GPU" in lines[0]
        assert reason in lines[0]
        assert not out.exists()  # refused before writing anything
        return
    # A GPU box (benchmarks/gpu_check.py runs this too): the build passed its gates and says so.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads((out / "compile.json").read_text())
    assert [b["precision"] for b in info["builds"]] == (["fp16", "int8"] if target == "tensorrt" else ["fp16"])
    for build in info["builds"]:
        assert build["passed"] and build["check"]["samples"] == 96
        assert build["accuracy"]["validation_samples"] == 96
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "compile" and manifest["params"]["target"] == target


def test_compile_help_lists_the_gpu_targets():
    proc = run_appliance("compile", "--help")
    assert "cuda-ort" in proc.stdout and "tensorrt" in proc.stdout and "--int8-calib" in proc.stdout


def test_int8_qdq_for_tensorrt_has_zero_points_of_zero(tmp_path, exported, calib_tfrecord):
    """TensorRT rejects Q/DQ with non-zero zero points; onnxruntime's default activations have them."""
    from appliance.deploy.onnx_model import metadata, ort_session, run_ort
    from appliance.deploy.samples import load_samples

    model_path = exported / "model.onnx"
    calib = load_samples([calib_tfrecord], metadata(onnx.load(str(model_path)))["preprocessing"])
    out = tmp_path / "model.int8-qdq.onnx"
    gpu_routes.symmetric_qdq(model_path, out, calib.x, "input")
    model = onnx.load(str(out))
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    quant = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert quant, "no Q/DQ nodes written"
    for node in quant:
        zero_point = init[node.input[2]]
        assert zero_point.dtype == np.int8 and not zero_point.any(), node.name
    # still the same classifier on CPU: most predictions agree with FP32
    x = calib.x
    agree = (run_ort(ort_session(out), x).argmax(1) == run_ort(ort_session(model_path), x).argmax(1)).mean()
    assert agree >= 0.9


def test_parity_gate_bounds_fp16_and_leaves_int8_to_the_accuracy_gate():
    expected = np.array([[10.0, 0.0], [0.0, 5.0]])
    assert gpu_routes._parity(expected + 0.05, expected, 1e-2)["passed"]  # 0.05 <= 1e-2 * 10
    assert not gpu_routes._parity(expected + 0.2, expected, 1e-2)["passed"]
    int8 = gpu_routes._parity(expected + 3.0, expected, None)
    assert int8["passed"] and int8["allowed"] is None and int8["top1_agreement"] == 1.0
