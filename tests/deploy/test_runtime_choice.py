"""Never slower than the runtime beside it: compile compares its build with onnxruntime on the same model,
chooses the runtime the edge package uses (--runtime auto|tvm|onnxruntime) and says so in compile.json,
the stage's figures, the package's model.json and manifest; an onnxruntime package runs and proves itself
through the Python runner under qemu, beside the native runner's TVM build."""

import json
import tarfile

import pytest

from conftest import run_appliance
from appliance.deploy.compiler.runtime_choice import choose_runtime


def test_auto_picks_the_faster_and_a_split_verdict_says_so():
    chosen, why = choose_runtime("auto", {"ratios": {"cortex-a76": 0.8, "cortex-a55": 1.1}})
    assert chosen == "tvm"  # geometric mean 0.94
    assert "0.80x on cortex-a76, 1.10x on cortex-a55" in why
    assert "faster on cortex-a76 but slower on cortex-a55" in why and why.endswith("auto uses tvm")
    chosen, why = choose_runtime("auto", {"ratios": {"cortex-a76": 0.9, "cortex-a55": 1.3}})
    assert chosen == "onnxruntime" and why.endswith("auto uses onnxruntime")
    assert choose_runtime("auto", {"ratios": {"host": 2.0}})[0] == "onnxruntime"
    chosen, why = choose_runtime("tvm", {"ratios": {"host": 2.0}})
    assert chosen == "tvm" and "slower than onnxruntime" in why and why.endswith("--runtime tvm asked for")
    chosen, why = choose_runtime("auto", {"compared": False, "reason": "no device estimate (--no-device-estimate)"})
    assert (chosen, why) == ("tvm", "not compared with onnxruntime (no device estimate (--no-device-estimate))")
    assert choose_runtime("onnxruntime", {"compared": False, "reason": "x"}) == (
        "onnxruntime", "not compared with onnxruntime (x); --runtime onnxruntime asked for")


def test_host_build_is_measured_against_onnxruntime_and_the_choice_is_stated(tmp_path, exported, val_npz):
    from appliance.deploy.compile import CompileResult

    out = tmp_path / "x86"
    proc = run_appliance("compile", str(exported / "model.onnx"), "--target", "x86_64", "--out", str(out),
                         "--samples", str(val_npz))
    assert proc.returncode == 0, proc.stderr
    info = json.loads((out / "compile.json").read_text())
    comparison = info["onnxruntime_comparison"]
    assert comparison["tvm_ms"] > 0 and comparison["onnxruntime_ms"] > 0 and comparison["ratios"]["host"] > 0
    assert info["runtime_requested"] == "auto"
    assert info["runtime"] == ("tvm" if comparison["ratios"]["host"] <= 1.0 else "onnxruntime")
    assert f"{comparison['ratios']['host']:.2f}x on host" in info["runtime_reason"]
    assert f"runtime of the edge package: {info['runtime']} (" in proc.stdout
    result = CompileResult.load(out)
    assert result.figures()["runtime"] == info["runtime"] == result.runtime

    from appliance.pipeline.summary import format_summary

    summary = {"seconds": 1, "out_dir": str(tmp_path), "accuracy": {}, "sizes_bytes": {}, "artifacts": {},
               "latency_ms": {}, "builds": {"x86_64": {"runtime": info["runtime"],
                                                       "runtime_reason": info["runtime_reason"]}}}
    assert f"runtime x86_64" in format_summary(summary) and info["runtime_reason"] in format_summary(summary)


def test_a_bad_runtime_is_one_line(tmp_path, exported):
    from appliance.core.errors import DataError
    from appliance.deploy.compiler.driver import compile_model

    with pytest.raises(DataError, match=r"--runtime must be one of auto, tvm, onnxruntime, not 'ort'$"):
        compile_model(exported / "model.onnx", "x86_64", tmp_path / "x", runtime="ort")


@pytest.mark.slow
def test_an_onnxruntime_package_runs_it_on_the_python_runner_and_proves_both(tmp_path, exported, calib_tfrecord,
                                                                              val_tfrecord):
    """compile --runtime onnxruntime on the int8 model -> the package adds the Python runner with
    onnxruntime's wheels -> edge verify runs the native runner (TVM), the Python runner (onnxruntime) and
    both self-tests under qemu."""
    from appliance.deploy.compiler.driver import compile_model
    from appliance.deploy.edge.sysroot import default_debs_dir
    from appliance.deploy.package import build_package
    from appliance.deploy.quantize import quantize_model
    from appliance.deploy.verify import verify_package

    if not (default_debs_dir() / "manifest.json").is_file():
        pytest.skip("no arm64 python3.11 .debs (installer/bootstrap.sh --edge-sysroot)")
    quantize_model(exported / "model.onnx", [calib_tfrecord], tmp_path / "int8", val_files=[val_tfrecord])
    info = compile_model(tmp_path / "int8" / "model.int8.onnx", "aarch64", tmp_path / "arm", runtime="onnxruntime")
    assert info["runtime"] == "onnxruntime" and info["runtime_reason"].endswith("--runtime onnxruntime asked for")
    build_package(tmp_path / "arm", tmp_path / "ort.tar")
    with tarfile.open(tmp_path / "ort.tar") as tar:
        names = tar.getnames()
        model = json.load(tar.extractfile("edge-package/model.json"))
        manifest = json.load(tar.extractfile("edge-package/manifest.json"))
    assert model["runtime"] == "onnxruntime" and model["onnx_model"] == "reference/model.onnx"
    assert manifest["params"]["runtime"] == "onnxruntime" and manifest["params"]["with_python"] is True
    assert any(n.startswith("edge-package/wheels/onnxruntime-") for n in names)
    report = verify_package(tmp_path / "ort.tar", sample_files=[val_tfrecord], num_samples=8, bench_runs=0)
    native, python = report["routes"]
    assert report["runtime"] == "onnxruntime" and python["runtime"] == "onnxruntime"
    assert native["top1_agreement"] == 1.0 and python["top1_agreement"] == 1.0, report
    assert report["selftest"]["passed"] and report["python_selftest"]["passed"], report
    assert report["python_selftest"]["runtime"] == "onnxruntime" and report["passed"]
