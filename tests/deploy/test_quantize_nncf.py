"""`appliance quantize --engine nncf`: NNCF's PTQ and accuracy control beside our quantizer, on the
outlier-channel network plain PTQ breaks (tests/deploy/test_quantize_fallback.py), under one --max-drop
gate; NNCF's QDQ model then compiles like ours (TVM on the host, OpenVINO)."""

import json
import os

import onnx
import pytest

from conftest import run_appliance
from deploy.test_quantize_fallback import outlier  # noqa: F401 (the module's fixture: model, calib, val)


@pytest.mark.slow  # CLI runs, OpenVINO timing or a TVM build: tens of seconds
def test_both_engines_side_by_side_and_nncf_model_compiles_with_tvm(outlier, tmp_path):  # noqa: F811
    from appliance.deploy.compile import compile_stage

    model, calib, val = outlier
    out = tmp_path / "q"
    proc = run_appliance("quantize", str(model), "--calib", str(calib), "--val", str(val), "--out", str(out),
                         "--engine", "nncf", "--no-sensitivity", offline=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "accuracy.json").read_text())
    ours, nncf = report["engines"]
    assert (ours["engine"], nncf["engine"]) == ("ours", "nncf") and report["engine"] == "nncf"
    # Plain PTQ broke (tens of points): NNCF needed its accuracy control, which kept layers in float.
    assert nncf["step"] == "accuracy control" and nncf["passed"] and 1 <= len(nncf["float_layers"]) <= 10
    assert ours["passed"] and ours["float_layers"] and ours["seconds"] > 0 and nncf["seconds"] > 0
    assert report["produced_by"] == "nncf accuracy control" and report["float_layers"] == nncf["float_layers"]
    assert report["gate_passed"] and report["top1_drop_points"] == nncf["top1_drop_points"] <= 1.0
    ops = {n.op_type for n in onnx.load(str(out / "model.int8.onnx")).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert "Quantizers side by side" in (out / "accuracy.html").read_text()
    assert "engine nncf (accuracy control)" in proc.stdout
    # Every later stage takes it as it takes ours: the TVM host build, checked against onnxruntime.
    build = compile_stage(out / "model.int8.onnx", "x86_64", tmp_path / "c", sample_files=[val], log=lambda _: None)
    assert build.info["check"]["passed"] and build.info["layers"]["int8"] >= 1


def test_a_failing_engine_is_named_with_its_reason(outlier, tmp_path):  # noqa: F811
    model, calib, val = outlier
    out = tmp_path / "q"
    proc = run_appliance("quantize", str(model), "--calib", str(calib), "--val", str(val), "--out", str(out),
                         "--engine", "nncf", "--fallback", "none", "--no-sensitivity")
    assert proc.returncode == 3 and "top-1 dropped" in proc.stderr
    report = json.loads((out / "accuracy.json").read_text())
    ours, nncf = report["engines"]
    assert not ours["passed"] and not nncf["passed"] and report["produced_by"] == "none (gate failed)"
    assert "accuracy control not tried (--fallback none)" in nncf["why"] and "PTQ dropped" in nncf["why"]
    assert "no INT8 model within 1 points" in ours["why"]
    assert "FAIL: PTQ dropped" in (out / "accuracy.html").read_text()


def test_without_nncf_the_engine_refuses_in_one_line(outlier, tmp_path):  # noqa: F811
    model, calib, val = outlier
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "nncf.py").write_text("raise ImportError('hidden by the test')\n")
    proc = run_appliance("quantize", str(model), "--calib", str(calib), "--val", str(val), "--out", str(tmp_path / "q"),
                         "--engine", "nncf", env={**os.environ, "PYTHONPATH": str(hide)})
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--engine nncf needs the nncf wheel" in proc.stderr and not (tmp_path / "q" / "accuracy.json").exists()
