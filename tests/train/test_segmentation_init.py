"""Fine-tuning a segmentation model ([model] init): a classification network's weights (the bundle's
torchvision file, or any saved state dict) renamed onto the backbone with the head fresh, and a
segmentation checkpoint of other classes with its head re-initialised; the report names every key."""

import hashlib
import json

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from appliance.core.errors import DataError
from appliance.tasks.segmentation_models import UNetSmall
from appliance.train.config import load_config
from appliance.train.ddp import prepare_model
from seg_data import make_seg_config


def bundle_weights(tmp_path, name: str) -> dict:
    """weights/ as the bundle lays it out: torchvision's classification network saved as a state dict."""
    directory = tmp_path / "weights"
    directory.mkdir()
    torch.manual_seed(3)
    state = getattr(torchvision.models, name)(weights=None).state_dict()
    path = directory / f"{name}-0123abcd.pth"
    torch.save(state, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    (directory / "index.json").write_text(json.dumps({name: {"file": path.name, "sha256": digest, "url": "",
                                                             "weights": "test", "num_classes": 1000}}))
    return state


@pytest.mark.parametrize("architecture", ["lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large"])
def test_a_classification_backbone_starts_a_segmentation_model_with_a_fresh_head(tmp_path, monkeypatch,
                                                                                 architecture):
    state = bundle_weights(tmp_path, "mobilenet_v3_large")
    monkeypatch.setenv("APPLIANCE_WEIGHTS_DIR", str(tmp_path / "weights"))
    config = make_seg_config(tmp_path, model={"architecture": architecture, "init": "torchvision:mobilenet_v3_large"},
                             data={"channels": 3, "mean": [0.4] * 3, "std": [0.2] * 3, "image_size": 32})
    lines = []
    torch.manual_seed(0)
    model, report = prepare_model(load_config(config), lines.append)
    own = model.state_dict()
    backbone = [k for k in own if k.startswith("net.backbone.")]
    # Every backbone tensor is the classification network's features.N, by its renamed key.
    assert backbone and all(torch.equal(own[k], state["features." + k[len("net.backbone."):]]) for k in backbone)
    assert sorted(report["loaded_keys"]) == sorted(backbone) and report["backbone_keys_mapped"] == len(backbone)
    assert report["classification_keys_not_used"] == sorted(k for k in state if k.startswith("classifier."))
    head = [k for k in own if k.startswith("net.classifier.")]
    assert head and sorted(report["head_reinitialised"]) == sorted(head) and report["missing"] == head
    assert any("head net.classifier starts fresh" in line for line in lines), lines
    with torch.no_grad():
        assert model.eval()(torch.zeros(1, 3, 32, 32)).shape == (1, 3, 32, 32)


def test_resnet50_classification_weights_start_fcn_resnet50(tmp_path):
    """A state dict file of the site's own (not the bundle's): resnet50's conv1 ... layer4 become the backbone."""
    torch.manual_seed(4)
    state = torchvision.models.resnet50(weights=None).state_dict()
    torch.save(state, tmp_path / "resnet50-classifier.pth")
    config = make_seg_config(tmp_path, model={"architecture": "fcn_resnet50", "init": "resnet50-classifier.pth"},
                             data={"channels": 1, "image_size": 32})
    model, report = prepare_model(load_config(config), lambda line: None)
    own = model.state_dict()
    assert torch.equal(own["net.backbone.layer4.2.conv3.weight"], state["layer4.2.conv3.weight"])
    # A grey model: the RGB stem is summed over its input channels, as for classification.
    assert report["input_channels_adapted"] == {"net.backbone.conv1.weight": (3, 1)}
    assert torch.allclose(own["net.backbone.conv1.weight"], state["conv1.weight"].sum(1, keepdim=True))
    assert report["classification_keys_not_used"] == ["fc.bias", "fc.weight"]
    assert len(report["loaded_keys"]) == len([k for k in state if not k.startswith("fc.")])


def test_a_segmentation_checkpoint_of_other_classes_keeps_all_but_its_head(tmp_path):
    torch.manual_seed(5)
    previous = UNetSmall(num_classes=5, in_channels=1).state_dict()
    save_file(previous, str(tmp_path / "unet5.safetensors"))
    config = make_seg_config(tmp_path, model={"init": "unet5.safetensors"})  # unet_small, 3 classes
    model, report = prepare_model(load_config(config), lambda line: None)
    own = model.state_dict()
    assert report["head_reinitialised"] == ["head.weight", "head.bias"] and "backbone_mapping" not in report
    assert set(report["loaded_keys"]) == set(own) - {"head.weight", "head.bias"}
    assert all(torch.equal(own[k], previous[k]) for k in report["loaded_keys"])
    assert own["head.weight"].shape[0] == 3


def test_classification_weights_of_another_family_are_one_line(tmp_path):
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), tmp_path / "r18.pth")
    config = make_seg_config(tmp_path, model={"architecture": "lraspp_mobilenet_v3_large", "init": "r18.pth"},
                             data={"channels": 3, "mean": [0.4] * 3, "std": [0.2] * 3, "image_size": 32})
    with pytest.raises(DataError, match=r"r18.pth: weights do not fit lraspp_mobilenet_v3_large"):
        prepare_model(load_config(config), lambda line: None)
