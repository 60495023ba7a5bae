"""Quantization-aware fine-tuning: the QDQ model it exports, and QAT passing where PTQ and fallback fail.

The failing case is a calibration set that misses the signal (the site's images dimmed to 5 %):
every calibration method then sets activation ranges far too small, and plain PTQ collapses by tens
of points. With no float layers allowed (--max-float-layers 0) fallback cannot help, and QAT,
whose ranges come from training on the run's own data through the same launcher, passes.
"""

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from conftest import run_appliance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_data import make_config  # noqa: E402

from appliance.deploy.onnx_model import ort_session, run_ort  # noqa: E402
from appliance.deploy.qat import fold_constant_quantization  # noqa: E402
from appliance.deploy.samples import load_samples  # noqa: E402
from appliance.tasks.fake_quant import ActivationFakeQuant, fold_batchnorms, insert_fake_quant  # noqa: E402


def _net():
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU6(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))


def test_batchnorm_folding_keeps_the_function():
    torch.manual_seed(0)
    net = _net()
    net.train()
    for _ in range(3):  # BatchNorm statistics that are not the identity
        net(torch.randn(16, 3, 12, 12) * 3 + 1)
    net.eval()
    x = torch.randn(4, 3, 12, 12)
    before = net(x)
    assert fold_batchnorms(net) == ["1", "4"]
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules())
    torch.testing.assert_close(net(x), before, rtol=1e-4, atol=1e-5)


def test_exported_qdq_model_carries_the_scales_training_learnt(tmp_path):
    torch.manual_seed(0)
    net = insert_fake_quant(_net())
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    net.train()
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.randn(16, 3, 12, 12) * 2), torch.randint(0, 3, (16,))).backward()
        opt.step()
    net.eval()
    learnt = sorted(float(m.scale) for m in net.modules() if isinstance(m, ActivationFakeQuant))
    path = tmp_path / "qat.onnx"
    x = torch.randn(8, 3, 12, 12) * 2
    torch.onnx.export(net, (x[:1],), str(path), dynamo=False, input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}}, opset_version=17)
    proto = onnx.load(str(path))
    assert fold_constant_quantization(proto) > 0
    onnx.save(proto, str(path))
    consts = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    producers = {o: n for n in proto.graph.node for o in n.output}
    layers = [n for n in proto.graph.node if n.op_type in ("Conv", "Gemm")]
    assert len(layers) == 3
    for layer in layers:
        x_dq, w_dq = (producers[i] for i in layer.input[:2])
        assert x_dq.op_type == w_dq.op_type == "DequantizeLinear"
        weights = consts[w_dq.input[0]]  # an int8 initializer, symmetric: zero point 0, never -128
        assert weights.dtype == np.int8 and weights.min() >= -127 and not consts[w_dq.input[2]].any()
        assert producers[x_dq.input[0]].op_type == "QuantizeLinear"
    exported = sorted(consts[n.input[1]].item() for n in proto.graph.node
                      if n.op_type == "QuantizeLinear" and n.input[1] in consts and consts[n.input[1]].size == 1)
    np.testing.assert_allclose(exported, learnt, rtol=1e-6)
    with torch.no_grad():
        expected = net(x).numpy()
    got = run_ort(ort_session(path), x.numpy())
    assert np.abs(got - expected).max() <= 1e-2 * np.abs(expected).max()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small_cnn run trained by the real launcher, exported; and a calibration set dimmed to 5 %."""
    work = tmp_path_factory.mktemp("qat")
    config = make_config(work, name="base", train_records=128, train={"epochs": 2})
    proc = run_appliance("train", str(config), "--nproc-per-node", "1")
    assert proc.returncode == 0, proc.stderr
    run = work / "runs" / "base"
    proc = run_appliance("export", str(run), "--out", str(work / "export"))
    assert proc.returncode == 0, proc.stderr
    preprocessing = {"image_size": 8, "mean": [0.3], "std": [0.25], "channel_order": "L"}
    samples = load_samples([work / "data" / "train-0.tfrecord"], preprocessing, limit=64)
    dim = ((samples.x * 0.25 + 0.3) * 0.05 - 0.3) / 0.25
    np.savez(work / "dim.npz", x=dim.astype(np.float32), y=samples.y)
    return work, run


def test_qat_passes_where_ptq_and_fallback_fail(trained):
    work, run = trained
    out = work / "quantize"
    proc = run_appliance("quantize", str(work / "export" / "model.onnx"), "--calib", str(work / "dim.npz"),
                         "--val", str(work / "data" / "val-0.tfrecord"), "--out", str(out), "--max-float-layers", "0",
                         "--no-sensitivity", "--qat", str(run), "--qat-epochs", "1")
    assert proc.returncode == 0, proc.stderr
    assert "trying quantization-aware fine-tuning" in proc.stdout
    report = json.loads((out / "accuracy.json").read_text())
    assert report["ptq"]["top1_drop_points"] > 10 and report["ptq"]["produced_by"] == "none (gate failed)"
    assert report["qat"]["passed"] and report["gate_passed"] and report["produced_by"] == "qat"
    assert report["top1_drop_points"] == report["qat"]["top1_drop_points"] <= 1.0
    shipped = onnx.load(str(out / "model.int8.onnx"))
    assert sum(n.op_type == "DequantizeLinear" for n in shipped.graph.node) >= 6
    assert "FP32, PTQ and QAT side by side" in (out / "accuracy.html").read_text()
    qat_config = (out / "qat-run" / "config.toml").read_text()
    assert "[qat]\nenabled = true" in qat_config and str(run.resolve()) in qat_config
    card = json.loads((out / "qat-run" / "model" / "model.json").read_text())
    assert "qat" in card["extra"]


def test_pipeline_qat_keys_are_read_and_checked(tmp_path):
    from appliance.core.errors import ConfigError
    from appliance.pipeline.config import load_pipeline_config

    for name in ("t.tfrecord", "v.tfrecord"):
        (tmp_path / name).write_bytes(b"")
    base = '[data]\ntrain = ["t.tfrecord"]\nval = ["v.tfrecord"]\nclasses = ["a", "b"]\n'
    path = tmp_path / "pipeline.toml"
    path.write_text(base)
    assert load_pipeline_config(path).quantize.qat is False
    path.write_text(base + "[quantize]\nqat = true\nqat_epochs = 3\n")
    q = load_pipeline_config(path).quantize
    assert q.qat is True and q.qat_epochs == 3 and q.qat_lr_scale == 0.1
    path.write_text(base + "[quantize]\nqat_lr_scale = 0\n")
    with pytest.raises(ConfigError, match=r"\[quantize\] qat_lr_scale"):
        load_pipeline_config(path)


def test_the_summary_names_qat_as_the_path(tmp_path):
    from appliance.pipeline.summary import _path_html, format_summary

    path = {"produced_by": "qat", "method": "minmax", "per_channel": True, "float_layers": [],
            "qat": {"top1": 1.0, "top1_drop_points": 0.0, "passed": True}, "ptq_top1_drop_points": 33.3}
    summary = {"accuracy": {}, "sizes_bytes": {}, "latency_ms": {}, "quantize_path": path, "artifacts": {},
               "out_dir": str(tmp_path), "config": "p.toml", "ran": [], "seconds": 1}
    assert "int8 made by                     qat" in format_summary(summary)
    assert "<b>qat</b>" in _path_html(path) and "33.30" in _path_html(path)


def test_a_killed_qat_run_resumes_bit_identical(tmp_path):
    """The observers' ranges live in the checkpoints: killed mid-epoch and resumed equals uninterrupted."""
    from safetensors.torch import load_file
    from test_resume import _train

    options = dict(qat={"enabled": True}, train={"epochs": 1}, checkpoint={"every_steps": 2})
    plain = make_config(tmp_path, name="qat", train_records=128, **options)
    killed = make_config(tmp_path, name="qat-killed", train_records=128, **options)
    first = _train(plain)
    second = _train(killed, "--max-restarts", "1", fault="step:3:0")  # 4 steps: resumes from step 2
    assert first.returncode == 0 and second.returncode == 0, (first.stderr[-2000:], second.stderr[-2000:])
    assert "exitcode: -9" in second.stderr and "resumed from" in second.stdout
    final = [load_file(tmp_path / "runs" / n / "model" / "model.safetensors") for n in ("qat", "qat-killed")]
    assert any(k.endswith("input_quant.scale") for k in final[0])
    assert final[0].keys() == final[1].keys()
    for key in final[0]:
        assert torch.equal(final[0][key], final[1][key]), f"{key} differs"
