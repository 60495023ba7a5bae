"""[model] init without processes: key matching and its report, torchvision files found through the
install's weights/ index, refusals (another architecture, a code-running pickle, an ONNX operator
onnx2torch lacks), frozen BatchNorm, linear probe and the optimizer's parameter groups."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from appliance.core.errors import ApplianceError, ConfigError, DataError
from appliance.models import build_model
from appliance.train.config import load_config
from appliance.train.ddp import prepare_model
from appliance.train.optimizer import build_optimizer
from train_data import make_config


def weights_dir(tmp_path, name="resnet18", num_classes=1000):
    """An install's weights/ as the bundle lays it out: a torchvision-style .pth and index.json."""
    directory = tmp_path / "weights"
    directory.mkdir()
    torch.manual_seed(1)
    state = build_model(name, num_classes).state_dict()
    path = directory / f"{name}-0123abcd.pth"
    torch.save(state, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    (directory / "index.json").write_text(json.dumps({name: {"file": path.name, "sha256": digest, "url": "",
                                                             "weights": "test", "num_classes": num_classes}}))
    return directory, state


def test_torchvision_weights_load_by_name_and_a_different_head_is_reinitialised(tmp_path, monkeypatch):
    directory, state = weights_dir(tmp_path)
    monkeypatch.setenv("APPLIANCE_WEIGHTS_DIR", str(directory))
    config = make_config(tmp_path, model={"architecture": "resnet18", "init": "torchvision:resnet18",
                                          "reset": ["conv1"]})
    cfg = load_config(config)
    assert cfg.init_sha256 == hashlib.sha256(next(directory.glob("*.pth")).read_bytes()).hexdigest()
    lines = []
    model, report = prepare_model(cfg, lines.append)
    assert any("classifier head fc re-initialised (1000 classes in the weights, 3 here)" in line for line in lines)
    assert report["kind"] == "torchvision" and report["reset"] == ["conv1.weight"]
    assert [m["key"] for m in report["shape_mismatched"]] == ["conv1.weight", "fc.weight", "fc.bias"]
    assert report["head_reinitialised"] == ["fc.weight", "fc.bias"]
    own = model.state_dict()
    assert torch.equal(own["layer4.1.bn2.running_var"], state["layer4.1.bn2.running_var"])
    assert own["fc.weight"].shape == (3, 512) and own["conv1.weight"].shape[1] == 1


def test_rgb_weights_start_a_grey_model_with_the_input_conv_adapted(tmp_path, monkeypatch):
    """Grey images (1 channel) from RGB pretrained weights: conv1 keeps what it learned, summed over
    RGB, so a grey image gives exactly what the RGB filters give on that image repeated to RGB."""
    directory, state = weights_dir(tmp_path)
    monkeypatch.setenv("APPLIANCE_WEIGHTS_DIR", str(directory))
    cfg = load_config(make_config(tmp_path, model={"architecture": "resnet18", "init": "torchvision:resnet18"}))
    lines = []
    model, report = prepare_model(cfg, lines.append)
    assert {k: list(v) for k, v in report["input_channels_adapted"].items()} == {"conv1.weight": [3, 1]}
    assert [m["key"] for m in report["shape_mismatched"]] == ["fc.weight", "fc.bias"]
    assert any("input conv conv1.weight adapted from 3 to 1 channels" in line for line in lines)
    grey = torch.rand(2, 1, 32, 32)
    ours = torch.nn.functional.conv2d(grey, model.state_dict()["conv1.weight"], stride=2, padding=3)
    rgb = torch.nn.functional.conv2d(grey.repeat(1, 3, 1, 1), state["conv1.weight"], stride=2, padding=3)
    assert torch.allclose(ours, rgb, atol=1e-5)
    assert not torch.equal(model.state_dict()["conv1.weight"], build_model("resnet18", 3, 1).state_dict()["conv1.weight"])


def test_weights_of_another_architecture_name_the_first_mismatched_keys(tmp_path):
    weights = tmp_path / "cnn.safetensors"
    save_file(build_model("small_cnn", 3, 1).state_dict(), str(weights))
    cfg = load_config(make_config(tmp_path, model={"architecture": "resnet18", "init": weights.name}))
    with pytest.raises(DataError) as err:
        prepare_model(cfg, lambda line: None)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{weights}: weights do not fit resnet18: first mismatched keys "
                                               "conv1.weight (missing)") and "unexpected 0.0.weight" in line


def test_a_pickle_that_would_run_code_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "the-pickle-ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    evil = tmp_path / "model.pth"
    torch.save({"0.0.weight": Payload()}, evil)
    cfg = load_config(make_config(tmp_path, model={"init": evil.name}))
    with pytest.raises(DataError, match=r"not a weights-only file \(its pickle would run code, so it is not loaded\)"):
        prepare_model(cfg, lambda line: None)
    assert not marker.exists()


def test_an_onnx_operator_onnx2torch_lacks_is_one_line_naming_it(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Flatten", ["input"], ["flat"], name="flatten"),
                               helper.make_node("Hardmax", ["flat"], ["logits"], name="vendor_hardmax")], "g",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 1, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 64])])
    path = tmp_path / "vendor.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    cfg = load_config(make_config(tmp_path, model={"architecture": "onnx", "init": path.name}))
    with pytest.raises(DataError) as err:
        prepare_model(cfg, lambda line: None)
    assert str(err.value) == (f"{path}: onnx2torch cannot convert operator Hardmax (opset 17) of node "
                              "'vendor_hardmax'; re-export the model without it")


def test_an_onnx_graph_for_rgb_images_on_grey_data_is_one_line(tmp_path):
    """The vendor's graph takes 3 channels, the site's data has 1: refused before any process starts."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.zeros((4, 3, 3, 3), np.float32), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["image", "w"], ["features"], name="conv"),
                               helper.make_node("Flatten", ["features"], ["logits"], name="flatten")], "g",
                              [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 144])], [weight])
    path = tmp_path / "vendor-rgb.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    cfg = load_config(make_config(tmp_path, model={"architecture": "onnx", "init": path.name}))
    assert cfg.data.channels == 1
    with pytest.raises(DataError) as err:
        prepare_model(cfg, lambda line: None)
    assert str(err.value) == f"{path}: the graph's input 'image' takes 3 channels, the data has 1 ([data] channels)"


@pytest.mark.parametrize("model, message", [
    ({"init": "torchvision:resnet18"}, "no such pretrained weights in this install"),
    ({"init": "nowhere.safetensors"}, "nowhere.safetensors does not exist"),
    ({"init": "notes.txt"}, "notes.txt is not .safetensors, .pth, .pt or .onnx"),
    ({"architecture": "onnx"}, '"onnx" goes with an ONNX init'),
])
def test_init_settings_that_cannot_work_are_refused_when_the_config_is_read(tmp_path, monkeypatch, model, message):
    monkeypatch.setenv("APPLIANCE_WEIGHTS_DIR", str(tmp_path / "empty"))
    (tmp_path / "notes.txt").write_text("not weights\n")
    with pytest.raises(ConfigError, match=message):
        load_config(make_config(tmp_path, model=model))


def test_frozen_batchnorm_keeps_its_statistics_through_train_mode(tmp_path):
    weights = tmp_path / "cnn.safetensors"
    torch.manual_seed(0)
    save_file(build_model("small_cnn", 3, 1).state_dict(), str(weights))
    cfg = load_config(make_config(tmp_path, model={"init": weights.name, "frozen_prefixes": ["0.", "1."]}))
    model, _ = prepare_model(cfg, lambda line: None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):  # train mode, a forward pass, eval (as validation does), train mode again
        model.train()
        model(torch.randn(4, 1, 8, 8))
        model.eval()
    model.train()
    after = model.state_dict()
    assert not model[0][1].training and model[3][1].training
    for key in before:
        if key.startswith(("0.", "1.")):
            assert torch.equal(before[key], after[key]), key
    assert not torch.equal(before["3.1.running_mean"], after["3.1.running_mean"])


def test_linear_probe_trains_the_head_only_and_param_groups_split_decay(tmp_path):
    cfg = load_config(make_config(tmp_path, model={"linear_probe": True}, optimizer={"weight_decay": 0.1}))
    model, report = prepare_model(cfg, lambda line: None)
    assert report is None
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["9.weight", "9.bias"]
    assert all(not m.training for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    groups = build_optimizer(cfg, model).state_dict()["param_groups"]
    assert [(g["name"], g["weight_decay"], g["params"]) for g in groups] == [
        ("decay lr_mult=1", 0.1, [0]), ("no_decay lr_mult=1", 0.0, [1])]


def test_an_lr_mult_prefix_that_matches_nothing_is_named(tmp_path):
    cfg = load_config(make_config(tmp_path, optimizer={"lr_mult": {"fc": 10.0}}))
    model, _ = prepare_model(cfg, lambda line: None)
    with pytest.raises(ApplianceError, match=r"\[optimizer\] lr_mult: 'fc' matches no parameter"):
        build_optimizer(cfg, model)


def test_the_pipeline_writes_init_and_lr_mult_into_the_training_config(tmp_path):
    import tomllib

    from appliance.train.stage import train_sections, write_train_config

    sections = train_sections({"model": {"init": "base/model.safetensors"}, "optimizer": {"lr_mult": {"fc": 10.0}}},
                              tmp_path / "runs" / "r", [], [], None, tmp_path / "pipeline.toml")
    write_train_config(tmp_path / "config.toml", sections, "pipeline.toml")
    written = tomllib.loads((tmp_path / "config.toml").read_text())
    # The training config lives in the run directory; a relative init was the pipeline config's.
    assert written["model"]["init"] == str(tmp_path / "base" / "model.safetensors")
    assert written["optimizer"]["lr_mult"] == {"fc": 10.0}
