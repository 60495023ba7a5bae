"""appliance compile: TVM Relax builds for the host (checked vs onnxruntime) and for aarch64."""

import json
import os
import subprocess

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import VENV_BIN, run_appliance
from appliance.core.manifest import read_manifest


def machine_of(path) -> str:
    out = subprocess.run(["readelf", "-h", str(path)], capture_output=True, text=True, check=True).stdout
    return next(line.split(":", 1)[1].strip() for line in out.splitlines() if "Machine:" in line)


def test_host_build_matches_onnxruntime(tmp_path, exported, val_npz):
    """With --dump-ir, the module after import and after each pass of the pipeline, in its order,
    and compile.json's record of the passes."""
    from appliance.deploy.compiler.pipeline import PASSES

    out, dumps = tmp_path / "x86", tmp_path / "ir"
    proc = run_appliance("compile", str(exported / "model.onnx"), "--target", "x86_64", "--out", str(out),
                         "--samples", str(val_npz), "--dump-ir", str(dumps))
    assert proc.returncode == 0, proc.stderr
    info = json.loads((out / "compile.json").read_text())
    check = info["check"]
    assert check["samples"] == 32 and check["passed"]
    assert check["max_abs_diff"] <= 1e-4 and check["top1_agreement"] == 1.0
    assert "X86-64" in machine_of(out / "model.so")
    names = [name for name, _ in PASSES]
    assert [p["pass"] for p in info["passes"]] == names
    assert sorted(f.name for f in dumps.iterdir()) == ["00-imported.py"] + [f"{i:02d}-{n}.py" for i, n in enumerate(names, 1)]
    dispatched = (dumps / "02-kernel_dispatch.py").read_text()
    assert "fp32_conv2d_" in dispatched and "fp32_conv2d_" not in (dumps / "00-imported.py").read_text()
    assert info["passes"][1]["counts"]["float32"] == info["fp32_kernels"] and info["fp32_kernels"]["layers"] > 0


def test_aarch64_build_is_an_arm_elf_with_lineage(compiled_arm, exported):
    assert machine_of(compiled_arm / "model.so") == "AArch64"
    manifest = read_manifest(compiled_arm)
    assert manifest["params"]["tvm_target"]["mtriple"] == "aarch64-linux-gnu"
    stages = [step["stage"] for step in manifest["lineage"]]
    assert stages == ["export"]  # the export manifest's inputs travel on (weights, card, samples)
    assert any(i["path"].endswith("model.safetensors") for i in manifest["lineage"][0]["inputs"])


@pytest.fixture(scope="module")
def mobilenet_onnx(tmp_path_factory):
    from appliance.deploy.export import export_model
    from appliance.models import ModelCard, build_model, save_trained_model

    root = tmp_path_factory.mktemp("mobilenet")
    card = ModelCard("mobilenet_v2", 10, 3, 64, class_names=tuple(map(str, range(10))))
    save_trained_model(root / "model", build_model("mobilenet_v2", 10), card)
    export_model(root, root / "export", batch=1, max_rel_error=1e-4)
    return root / "export" / "model.onnx"


@pytest.mark.parametrize("target", ["x86_64", "aarch64"])
def test_mobilenet_v2_compiles_for_both_targets(tmp_path, mobilenet_onnx, target):
    proc = run_appliance("compile", str(mobilenet_onnx), "--target", target, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert machine_of(tmp_path / "model.so") == ("AArch64" if target == "aarch64" else "Advanced Micro Devices X86-64")
    if target == "x86_64":
        assert json.loads((tmp_path / "compile.json").read_text())["check"]["passed"]


def one_line_error(proc) -> str:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_non_onnx_file_is_one_line(tmp_path):
    bogus = tmp_path / "model.onnx"
    bogus.write_bytes(b"PK\x03\x04 this is a zip, not a protobuf" * 10)
    line = one_line_error(run_appliance("compile", str(bogus), "--target", "x86_64", "--out", str(tmp_path / "o")))
    assert f"{bogus}: not a valid ONNX model" in line


def test_model_without_an_image_input_is_one_line(tmp_path):
    graph = helper.make_graph([helper.make_node("Relu", ["features"], ["y"])], "g",
                              [helper.make_tensor_value_info("features", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])])
    path = tmp_path / "tabular.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    line = one_line_error(run_appliance("compile", str(path), "--target", "x86_64", "--out", str(tmp_path / "o")))
    assert f"{path}: expected one float image input shaped (batch, C, H, W); found inputs: features[1, 8]" in line


def test_missing_cross_compiler_is_one_line(tmp_path, exported):
    env = {**os.environ, "PATH": str(VENV_BIN)}  # the venv only: no aarch64-linux-gnu-g++
    line = one_line_error(run_appliance("compile", str(exported / "model.onnx"), "--target", "aarch64",
                                        "--out", str(tmp_path / "o"), env=env))
    assert "aarch64-linux-gnu-g++: cross compiler not found on PATH" in line
    assert not (tmp_path / "o" / "model.so").exists()


def test_operator_tvm_cannot_import_is_named(tmp_path, exported, val_npz):
    from onnxruntime.quantization import QuantFormat, quantize_static

    from appliance.deploy.quantize import CalibrationSet

    qop = tmp_path / "qoperator.onnx"
    quantize_static(str(exported / "model.onnx"), str(qop), CalibrationSet("input", np.load(val_npz)["x"][:8]),
                    quant_format=QuantFormat.QOperator)
    line = one_line_error(run_appliance("compile", str(qop), "--target", "x86_64", "--out", str(tmp_path / "o")))
    assert "TVM cannot import operator QLinearConv (node" in line and "FP32" in line


def test_fp16_model_is_checked_at_fp16_tolerance(tmp_path, exported, val_npz):
    from appliance.deploy.quantize import quantize_fp16

    fp16 = tmp_path / "model.fp16.onnx"
    quantize_fp16(onnx.load(str(exported / "model.onnx")), fp16)
    proc = run_appliance("compile", str(fp16), "--target", "x86_64", "--out", str(tmp_path / "o"),
                         "--samples", str(val_npz))
    assert proc.returncode == 0, proc.stderr
    info = json.loads((tmp_path / "o" / "compile.json").read_text())
    # TVM and onnxruntime round float16 differently: well above 1e-4, well inside 1e-2.
    assert info["precision"] == "fp16" and info["check"]["top1_agreement"] == 1.0
    assert info["check"]["max_abs_diff"] <= info["check"]["allowed"]
    proc = run_appliance("compile", str(fp16), "--target", "x86_64", "--out", str(tmp_path / "strict"),
                         "--samples", str(val_npz), "--tolerance", "1e-6")
    assert proc.returncode == 2 and "TVM output differs from onnxruntime by" in proc.stderr


def test_dotprod_target_builds_an_arm_elf(tmp_path, exported):
    proc = run_appliance("compile", str(exported / "model.onnx"), "--target", "aarch64-dotprod", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert machine_of(tmp_path / "model.so") == "AArch64"
    assert "+dotprod" in json.loads((tmp_path / "compile.json").read_text())["tvm_target"]["mattr"]


@pytest.mark.slow
# "onnx" is no network of its own but the graph a site brings ([model] init); test_finetune exports
# such a run back to ONNX, and that graph compiles like any other.
@pytest.mark.parametrize("architecture", [a for a in __import__("appliance.models", fromlist=["ARCHITECTURES"]).ARCHITECTURES
                                          if a != "onnx"])
def test_every_trainable_architecture_compiles(tmp_path, architecture):
    """What `appliance train` can make, `appliance compile` can build (exported with the dynamic
    batch axis users get; shufflenet_v2's channel shuffle needs the shape folding before import)."""
    from appliance.deploy.compiler.driver import compile_model
    from appliance.deploy.export import export_model
    from appliance.models import ModelCard, build_model, save_trained_model

    card = ModelCard(architecture, 10, 3, 32, class_names=tuple(map(str, range(10))))
    save_trained_model(tmp_path / "model", build_model(architecture, 10), card)
    export_model(tmp_path, tmp_path / "export", max_rel_error=1e-4)
    info = compile_model(tmp_path / "export" / "model.onnx", "x86_64", tmp_path / "x86", log=lambda line: None)
    assert info["check"]["passed"] and info["check"]["top1_agreement"] == 1.0
    assert info["layers"]["fp32"] > 0 and info["layers"]["simulated"] == 0
    assert machine_of(tmp_path / "x86" / "model.so") == "Advanced Micro Devices X86-64"


def test_shufflenet_int8_compiles_for_aarch64_with_int8_layers(tmp_path):
    from appliance.deploy.compiler.driver import compile_model
    from appliance.deploy.export import export_model
    from appliance.deploy.quantize import quantize_int8
    from appliance.models import ModelCard, build_model, save_trained_model

    card = ModelCard("shufflenet_v2_x1_0", 10, 3, 32, class_names=tuple(map(str, range(10))))
    save_trained_model(tmp_path / "model", build_model("shufflenet_v2_x1_0", 10), card)
    export_model(tmp_path, tmp_path / "export", max_rel_error=1e-4)
    calib = np.random.default_rng(0).standard_normal((8, 3, 32, 32)).astype(np.float32)
    quantize_int8(tmp_path / "export" / "model.onnx", tmp_path / "q.onnx", calib, "input", "minmax", per_channel=True)
    info = compile_model(tmp_path / "q.onnx", "aarch64", tmp_path / "arm", log=lambda line: None)
    assert info["layers"]["int8"] == 57 and info["layers"]["simulated"] == 0
    assert machine_of(tmp_path / "arm" / "model.so") == "AArch64"
