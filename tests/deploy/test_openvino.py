"""The OpenVINO route for x86 servers: compile (ONNX -> IR, checked against onnxruntime, timed under both
hints), package (a signed server package with its Python runner) and `edge verify` on this host, for the
demo tasks' models (classification FP32 and QDQ INT8, segmentation); refused in one line without the wheel."""

import json
import os

import numpy as np
import pytest
from conftest import run_appliance
from deploy.test_segmentation_deploy import seg_export  # noqa: F401 (a fixture: the trained unet_small)


@pytest.mark.slow  # CLI runs, OpenVINO timing or a TVM build: tens of seconds
def test_classification_compiles_packages_and_verifies_from_the_command_line(exported, val_tfrecord, tmp_path):
    proc = run_appliance("compile", str(exported / "model.onnx"), "--target", "openvino", "--out", str(tmp_path / "c"),
                         "--samples", str(val_tfrecord), offline=True)
    assert proc.returncode == 0, proc.stderr
    info = json.loads((tmp_path / "c" / "compile.json").read_text())
    assert info["target"] == "openvino" and info["runtime"] == "openvino" and info["inference_precision"] == "f32"
    assert (tmp_path / "c" / "model.xml").is_file() and (tmp_path / "c" / "model.bin").is_file()
    check = info["check"]
    assert check["passed"] and check["samples"] == 32 and check["top1_agreement"] == 1.0
    assert check["max_abs_diff"] <= check["allowed"] <= 1e-4 * max(1, 100)
    for hint in ("LATENCY", "THROUGHPUT"):
        assert info["hints"][hint]["median_ms"] > 0
    assert info["hints"]["THROUGHPUT"]["throughput"]["inferences_per_s"] > 0
    assert info["host_latency_ms"] == info["hints"]["LATENCY"]["median_ms"] and info["onnxruntime_latency_ms"] > 0
    assert "max abs diff" in proc.stdout and "THROUGHPUT hint" in proc.stdout

    tar = tmp_path / "server.tar"
    proc = run_appliance("package", str(tmp_path / "c"), "--target", "x86_64-openvino", "--out", str(tar),
                         "--samples", str(val_tfrecord), offline=True)
    assert proc.returncode == 0, proc.stderr
    proc = run_appliance("edge", "verify", str(tar), "--samples", str(val_tfrecord), "--bench-runs", "3",
                         "--out", str(tmp_path / "v"), offline=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "v" / "verify.json").read_text())
    route = report["routes"][0]
    assert report["passed"] and report["runtime"] == "openvino" and route["runner"].startswith("OpenVINO runner")
    assert route["top1_agreement"] == 1.0 and route["max_logit_diff"] <= route["allowed_logit_diff"]
    assert route["top1"] == route["host_top1"] > 0.5  # the trained model's accuracy, the same on both
    assert report["selftest"]["passed"] and report["selftest"]["samples"] == 8
    assert set(report["bench"]["hints"]) == {"LATENCY", "THROUGHPUT"}
    # The wrong package target for this build is one line.
    proc = run_appliance("package", str(tmp_path / "c"), "--target", "aarch64", "--out", str(tmp_path / "x.tar"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "compiled for openvino, not for --target aarch64" in proc.stderr


def test_qdq_int8_runs_int8_in_openvino_and_agrees_within_output_steps(exported, val_npz, tmp_path):
    from appliance.deploy.compile import CompileResult, compile_stage
    from appliance.deploy.quantize import quantize_int8

    x = np.load(val_npz)["x"]
    quantize_int8(exported / "model.onnx", tmp_path / "q.onnx", x[:32], "input", "minmax", per_channel=True,
                  scheme="s8s8")
    result = compile_stage(tmp_path / "q.onnx", "openvino", tmp_path / "c", sample_files=[val_npz], log=lambda _: None)
    assert isinstance(result, CompileResult) and result.library == tmp_path / "c" / "model.xml"
    assert CompileResult.load(tmp_path / "c").info == result.info
    info = result.info
    assert info["precision"] == "fp32" and info["layers"]["int8"] > 0  # int8 kernels, not float emulation
    check = info["check"]
    assert check["passed"] and check["max_quantized_units"] is not None and check["max_quantized_units"] <= 8
    assert check["top1_agreement"] >= 0.95


def test_a_build_that_disagrees_with_its_reference_is_caught(exported, val_npz, tmp_path):
    """The check can fail: an IR of one model measured against another model's onnxruntime outputs."""
    from appliance.deploy.openvino_route.build import check_against_ort, compile_openvino
    from appliance.deploy.openvino_route.run import compile_ir
    from appliance.deploy.quantize import quantize_int8

    x = np.load(val_npz)["x"]
    quantize_int8(exported / "model.onnx", tmp_path / "q.onnx", x[:4], "input", "minmax", per_channel=False,
                  scheme="u8s8")
    compile_openvino(exported / "model.onnx", tmp_path / "c", timing_s=0.1, log=lambda _: None)
    shape = json.loads((tmp_path / "c" / "compile.json").read_text())["input"]["shape"]
    check = check_against_ort(compile_ir(tmp_path / "c" / "model.xml"), tmp_path / "q.onnx", shape, [val_npz], {},
                              1e-4, "input")
    assert not check["passed"] and check["max_abs_diff"] > check["allowed"]


@pytest.mark.slow  # CLI runs, OpenVINO timing or a TVM build: tens of seconds
def test_segmentation_compiles_packages_and_verifies_per_pixel(seg_export, tmp_path):  # noqa: F811
    from appliance.deploy.compile import compile_stage
    from appliance.deploy.package import package_stage
    from appliance.deploy.verify import verify_stage

    export, _, val = seg_export
    build = compile_stage(export / "model.onnx", "openvino", tmp_path / "c", sample_files=[val], log=lambda _: None)
    assert build.info["check"]["task"] == "segmentation" and build.info["check"]["pixel_agreement"] >= 0.995
    package = package_stage(build, tmp_path / "p", sample_files=[val])
    assert package.package.name == "edge-package-openvino.tar" and package.info["runtime"] == "openvino"
    result = verify_stage(package, tmp_path / "v", sample_files=[val], bench_runs=0)
    report = result.report
    assert result.passed and report["task"] == "segmentation" and report["bench"] is None
    route = report["routes"][0]
    assert route["pixel_agreement"] >= 0.995 and route["class_maps"]["written"] == report["samples"]
    assert report["selftest"]["pixel_agreement"] >= 0.995


def test_without_the_openvino_wheel_the_route_refuses_in_one_line(exported, tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "openvino.py").write_text("raise ImportError('hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": str(hide)}
    proc = run_appliance("compile", str(exported / "model.onnx"), "--target", "openvino", "--out",
                         str(tmp_path / "c"), env=env)
    assert proc.returncode != 0 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "the openvino wheel is not installed" in proc.stderr and str(exported / "model.onnx") in proc.stderr
    assert not (tmp_path / "c" / "compile.json").exists()

