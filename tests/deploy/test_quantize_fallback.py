"""INT8 that keeps its accuracy: per-layer sensitivity and --fallback auto, on a network plain PTQ breaks.

The network is trained here in seconds, then given outlier channels the way real networks have
them (two channels of one activation tensor sitting at ~1e4 while the rest stay below ~10) by an
exact rewrite: conv1 adds OFFSET to two channels, conv2 (no padding, so every window sees them)
subtracts what that adds to its sums, and FP32 computes the same function. Per-tensor INT8 of
that tensor cannot hold both: a range that covers 1e4 rounds the signal away, one that clips
breaks conv2's compensation. Whichever calibration, plain PTQ collapses; fallback keeps the
layers around that tensor in float.
"""

import json

import numpy as np
import onnx
import pytest

from conftest import run_appliance
from deploy.conftest import synthetic_images

OFFSET, OUTLIER_CHANNELS = 1e4, (3, 11)


def outlier_model(path):
    """(path to the ONNX model, calibration .npz, validation .npz) of a trained conv net with outlier channels."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    images, labels = synthetic_images(640, seed=3)
    x = (images.transpose(0, 3, 1, 2).astype(np.float32) / 255.0 - 0.2) / 0.3
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 2, stride=2),
                        nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 4))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    tx, ty = torch.from_numpy(x[:512]), torch.from_numpy(labels[:512])
    for _ in range(8):
        for i in range(0, 512, 64):
            opt.zero_grad()
            nn.functional.cross_entropy(net(tx[i:i + 64]), ty[i:i + 64]).backward()
            opt.step()
    with torch.no_grad():  # the exact rewrite: ReLU(z + OFFSET) = z + OFFSET wherever z > -OFFSET
        for c in OUTLIER_CHANNELS:
            net[0].bias[c] += OFFSET
            net[2].bias -= OFFSET * net[2].weight[:, c].sum(dim=(1, 2))
    net.eval()
    model = path / "outlier.onnx"
    torch.onnx.export(net, (tx[:1],), str(model), dynamo=False, input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17)
    np.savez(path / "calib.npz", x=x[512:576], y=labels[512:576])
    np.savez(path / "val.npz", x=x[512:], y=labels[512:])
    return model, path / "calib.npz", path / "val.npz"


@pytest.fixture(scope="module")
def outlier(tmp_path_factory):
    return outlier_model(tmp_path_factory.mktemp("outlier"))


@pytest.fixture(scope="module")
def fallback_run(tmp_path_factory, outlier):
    model, calib, val = outlier
    out = tmp_path_factory.mktemp("fallback")
    proc = run_appliance("quantize", str(model), "--calib", str(calib), "--val", str(val), "--out", str(out))
    return proc, out


def test_plain_ptq_loses_far_more_than_a_point(tmp_path, outlier):
    model, calib, val = outlier
    for method in ("minmax", "entropy", "percentile"):
        out = tmp_path / method
        proc = run_appliance("quantize", str(model), "--calib", str(calib), "--val", str(val), "--out", str(out),
                             "--method", method, "--per-channel", "--fallback", "none", "--no-sensitivity")
        assert proc.returncode == 3 and "top-1 dropped" in proc.stderr, proc.stderr
        report = json.loads((out / "accuracy.json").read_text())
        assert report["fp32"]["top1"] >= 0.9 and report["top1_drop_points"] > 10, (method, report["top1_drop_points"])
        assert report["produced_by"] == "none (gate failed)" and report["float_layers"] == []


def test_fallback_keeps_the_outlier_layers_in_float_and_passes(fallback_run):
    proc, out = fallback_run
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "accuracy.json").read_text())
    assert report["gate_passed"] and report["top1_drop_points"] <= 1.0 and report["produced_by"] == "float layers"
    floats = report["float_layers"]
    # conv2 reads the outlier tensor: without it in float nothing passes.
    assert "/2/Conv" in floats and len(floats) <= 3, floats
    assert f"kept in float: {', '.join(floats)}" in proc.stdout
    steps = [a["step"] for a in report["fallback"]["attempts"]]
    assert steps[0] == "ptq" and "calibration" in steps and steps[-1] == "float layers"
    assert not any(a["passed"] for a in report["fallback"]["attempts"] if a["step"] != "float layers")
    cost = report["fallback"]["cost"]
    assert cost["extra_bytes"] == cost["bytes"] - cost["all_int8_bytes"] > 0
    assert {c["layer"] for c in cost["layers"]} == set(floats)

    # The model is still QDQ, with the float layers reading float tensors.
    model = onnx.load(str(out / "model.int8.onnx"))
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    for node in model.graph.node:
        if node.name in floats:
            assert all(producers.get(i) != "DequantizeLinear" for i in node.input), node.name
    assert sum(n.op_type == "QuantizeLinear" for n in model.graph.node) >= 1

    sens = report["sensitivity"]
    assert sens["layers"] == len(sens["ranking"]) >= 4 and sens["ranking"][0]["rank"] == 1
    top = sens["ranking"][0]
    assert top["layer"] in floats and top["top1_only_this_quantized"] < sens["top1_fp32"] - 0.3
    errors = [r["sqnr_db_only_this_quantized"] for r in sens["ranking"]]
    assert errors == sorted(errors)
    assert sorted(p.name for p in out.iterdir()) == ["accuracy.html", "accuracy.json", "manifest.json", "model.int8.onnx"]
    page = (out / "accuracy.html").read_text()
    assert "Per-layer sensitivity" in page and 'class="sensitivity"' in page and "Kept in float" in page


def test_fallback_within_a_float_layer_budget_of_zero_fails_with_exit_3(tmp_path, outlier):
    model, calib, val = outlier
    out = tmp_path / "o"
    proc = run_appliance("quantize", str(model), "--calib", str(calib), "--val", str(val), "--out", str(out),
                         "--max-float-layers", "0")
    # Progress of the sensitivity run goes to stderr first; the error is one line, the last.
    assert proc.returncode == 3 and "top-1 dropped" in proc.stderr.strip().splitlines()[-1], proc.stderr
    report = json.loads((out / "accuracy.json").read_text())
    assert not report["gate_passed"] and report["float_layers"] == []
    assert len(report["fallback"]["attempts"]) >= 3  # the calibration knobs were tried


def test_tvm_build_of_the_mixed_model_agrees_with_onnxruntime(tmp_path, fallback_run):
    proc, out = fallback_run
    assert proc.returncode == 0, proc.stderr
    build = tmp_path / "x86"
    proc = run_appliance("compile", str(out / "model.int8.onnx"), "--target", "x86_64", "--out", str(build))
    assert proc.returncode == 0, proc.stderr
    info = json.loads((build / "compile.json").read_text())
    layers, check = info["layers"], info["check"]
    assert layers["int8"] >= 1 and layers["fp32"] >= 1, layers  # mixed int8/fp32 in one library
    assert check["top1_agreement"] == 1.0 and check["passed"], check


def test_pipeline_quantize_stage_falls_back_and_its_summary_names_the_path(tmp_path, outlier):
    from types import SimpleNamespace

    from appliance.core.errors import GateFailed
    from appliance.deploy.quantize import quantize_stage
    from appliance.pipeline.plan import Results
    from appliance.pipeline.summary import build_summary, format_summary

    model, calib, val = outlier
    settings = dict(mode="int8", method="minmax", per_channel=True, calib_samples=64, max_drop=1.0)
    with pytest.raises(GateFailed):  # [quantize] fallback = "none": the pipeline stops at the gate as before
        quantize_stage(model, [calib], [val], tmp_path / "none", fallback="none", **settings)
    result = quantize_stage(model, [calib], [val], tmp_path / "auto", **settings)
    assert result.gate_passed and result.report["produced_by"] == "float layers"
    cfg = SimpleNamespace(out_dir=tmp_path, source=tmp_path / "pipeline.toml")
    summary = build_summary(cfg, Results(cfg, quantize=result), ["quantize"], 1.0)
    assert summary["quantize_path"] == {"produced_by": "float layers", "method": "minmax", "per_channel": True,
                                        "float_layers": result.report["float_layers"]}
    assert f"float layers (minmax, per-channel); kept in float: {', '.join(result.report['float_layers'])}" \
        in format_summary(summary)


def test_the_int8_error_unit_follows_float_layers_after_the_last_quantized_one():
    from onnx import TensorProto, helper, numpy_helper

    from appliance.deploy.compiler.passes.int8_arith import output_scale

    w = np.array([[1.0, -2.0, 0.5], [0.25, 0.25, -3.0]], dtype=np.float32)  # (N=2, K=3), transB
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "s"), numpy_helper.from_array(np.array(0, np.int8), "z"),
             numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.zeros(2, np.float32), "b")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("Relu", ["xd"], ["r"]),
             helper.make_node("Gemm", ["r", "w", "b"], ["y"], transB=1)]

    def model(nodes):
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                                  [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)], inits)
        return helper.make_model(graph)

    assert output_scale(model(nodes[:2])) == pytest.approx(0.05)  # the output is dequantized: its step
    assert output_scale(model(nodes)) == pytest.approx(0.05 * 3.5)  # carried through the float Gemm: |row|_1 max
    assert output_scale(model([helper.make_node("Relu", ["x"], ["y"])])) is None  # no int8 upstream: FP32 bound
    unknown = nodes[:2] + [helper.make_node("Erf", ["xd"], ["y"])]
    assert output_scale(model(unknown)) is None  # no bound claimed through an op it does not know


def test_a_mixed_model_whose_last_layer_stayed_float_compiles_and_passes_its_check(tmp_path, outlier):
    from appliance.deploy.int8_builder import Int8Builder, Recipe

    model, calib, _ = outlier
    with Int8Builder(model, np.load(calib)["x"], "input") as builder:
        last = [n.name for n in onnx.load(str(builder.prepared)).graph.node if n.op_type == "Gemm"]
        mixed = builder.build(tmp_path / "mixed.onnx", Recipe(float_layers=tuple(last)))
    graph = onnx.load(str(mixed)).graph
    assert next(n for n in graph.node if graph.output[0].name in n.output).op_type == "Gemm"  # float last layer
    proc = run_appliance("compile", str(mixed), "--target", "x86_64", "--out", str(tmp_path / "x86"))
    assert proc.returncode == 0, proc.stderr
    check = json.loads((tmp_path / "x86" / "compile.json").read_text())["check"]
    assert check["passed"] and check["top1_agreement"] == 1.0, check


def test_the_mixed_model_packages_and_verifies_under_qemu(tmp_path, fallback_run, outlier):
    """int8 and float layers in one aarch64 library: packaged and run under qemu-aarch64, agreeing with the host."""
    _, out = fallback_run
    _, _, val = outlier
    assert json.loads((out / "accuracy.json").read_text())["float_layers"]
    mixed = onnx.load(str(out / "model.int8.onnx"))  # the metadata export writes, which package and verify read
    for key, value in (("appliance.preprocessing", {"image_size": 20, "mean": [0.2] * 3, "std": [0.3] * 3,
                                                    "channel_order": "RGB"}),
                       ("appliance.class_names", ["a", "b", "c", "d"])):
        entry = mixed.metadata_props.add()
        entry.key, entry.value = key, json.dumps(value)
    onnx.save(mixed, str(tmp_path / "mixed.onnx"))
    proc = run_appliance("compile", str(tmp_path / "mixed.onnx"), "--target", "aarch64", "--out", str(tmp_path / "arm"))
    assert proc.returncode == 0, proc.stderr
    layers = json.loads((tmp_path / "arm" / "compile.json").read_text())["layers"]
    assert layers["int8"] >= 1 and layers["fp32"] >= 1, layers
    proc = run_appliance("package", str(tmp_path / "arm"), "--out", str(tmp_path / "edge.tar"), "--samples", str(val))
    assert proc.returncode == 0, proc.stderr
    proc = run_appliance("edge", "verify", str(tmp_path / "edge.tar"), "--samples", str(val), "--num-samples", "16",
                         "--bench-runs", "0", "--out", str(tmp_path / "verify"))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "verify" / "verify.json").read_text())
    assert report["samples"] == 16, report
