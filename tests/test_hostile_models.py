"""Hostile model files (issue 31): an ONNX ConstantOfShape memory bomb, NaN weights and a safetensors
dtype relabelled with the same bytes are one line naming the file and the tensor, in training's init,
export, quantize and compile, and a checkpoint with NaN weights is set aside, not resumed."""

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from appliance.cli import main
from appliance.core.errors import DataError
from appliance.models import ModelCard, build_model, load_trained_model, save_trained_model

sys.path.insert(0, str(Path(__file__).resolve().parent / "train"))
from train_data import CLASSES, make_config  # noqa: E402
from test_hardening import one_line  # noqa: E402


def bomb(path: Path) -> Path:
    """A valid graph (image in, logits out) whose ConstantOfShape asks for 2^40 floats."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    shape = numpy_helper.from_array(np.array([1, 1 << 20, 1 << 20], dtype=np.int64), "bomb_shape")
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    nodes = [helper.make_node("ConstantOfShape", ["bomb_shape"], ["big"], name="big", value=one),
             helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
             helper.make_node("Flatten", ["input"], ["flat"]),
             helper.make_node("Add", ["flat", "total"], ["logits"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 64])], [shape])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


BOMB = "ConstantOfShape node 'big' makes a tensor of 1099511627776 elements (1x1048576x1048576), more than"


@pytest.mark.parametrize("verb", ["quantize", pytest.param("compile", marks=pytest.mark.slow)])
def test_a_constant_of_shape_bomb_is_one_line_in_deploy(capsys, tmp_path, verb):
    model = bomb(tmp_path / "bomb.onnx")
    extra = ["--calib", str(model)] if verb == "quantize" else ["--target", "x86_64"]
    line = one_line(capsys, verb, str(model), "--out", str(tmp_path / "out"), *extra)
    assert line == f"appliance {verb}: error: {model}: {BOMB} 268435456 (a memory bomb, not an image model)"


@pytest.mark.slow  # onnx2torch and torch.fx: ~8 s of imports
def test_a_constant_of_shape_bomb_as_init_stops_the_dry_run(capsys, tmp_path):
    bomb(tmp_path / "vendor.onnx")
    config = make_config(tmp_path, train_records=8, val_records=3, model={"architecture": "onnx", "init": "vendor.onnx"})
    assert BOMB in one_line(capsys, "train", str(config), "--dry-run")


def small_cnn_state():
    return {k: v.clone() for k, v in build_model("small_cnn", len(CLASSES), 1).state_dict().items()}


def relabel_first_float_tensor(path: Path, dtype: str = "I32") -> str:
    """Rewrite a safetensors header so its first F32 tensor says `dtype`; the bytes stay as they are."""
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    header[name]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    assert len(text) == size
    path.write_bytes(data[:8] + text + data[8 + size:])
    return name


@pytest.mark.parametrize("damage", ["nan", "relabelled"])
def test_init_weights_with_nan_or_a_relabelled_dtype_are_named(capsys, tmp_path, damage):
    state = small_cnn_state()
    first = next(k for k, v in state.items() if v.is_floating_point())
    if damage == "nan":
        state[first].view(-1)[0] = float("nan")
    save_file(state, str(tmp_path / "init.safetensors"))
    if damage == "relabelled":
        first = relabel_first_float_tensor(tmp_path / "init.safetensors")
    config = make_config(tmp_path, train_records=8, val_records=3, model={"init": "init.safetensors"})
    line = one_line(capsys, "train", str(config), "--dry-run")
    expected = (f"{first} holds 1 NaN or infinite value(s)" if damage == "nan"
                else f"{first} is torch.int32 where the model has torch.float32")
    assert f"{tmp_path / 'init.safetensors'}: {expected}" in line, line


@pytest.mark.parametrize("damage", ["nan", "relabelled"])
def test_export_of_nan_or_relabelled_weights_is_one_line(capsys, tmp_path, damage):
    model = build_model("small_cnn", len(CLASSES), 1)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("nan") if damage == "nan" else 0.5
    card = ModelCard("small_cnn", len(CLASSES), 1, 8, mean=(0.3,), std=(0.25,), channel_order="L",
                     class_names=CLASSES)
    directory = save_trained_model(tmp_path / "model", model, card)
    if damage == "relabelled":
        relabel_first_float_tensor(directory / "model.safetensors")
    with pytest.raises(DataError, match="these weights cannot be used"):
        load_trained_model(directory)
    line = one_line(capsys, "export", str(directory), "--out", str(tmp_path / "out"))
    assert line.startswith(f"appliance export: error: {directory / 'model.safetensors'}: ")
    assert ("NaN or infinite" if damage == "nan" else "torch.int32 where the model has torch.float32") in line


@pytest.mark.parametrize("damage", ["nan", "relabelled"])
def test_a_checkpoint_with_nan_or_relabelled_weights_is_set_aside_not_resumed(tmp_path, damage):
    from appliance.core.manifest import sha256_file
    from appliance.train.checkpoint import CHECKSUMS, CheckpointManager

    model = build_model("small_cnn", len(CLASSES), 1)
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=3, model_state=model.state_dict())
    card = ModelCard("small_cnn", len(CLASSES), 1, 8, mean=(0.3,), std=(0.25,), channel_order="L")
    saved = []
    for step in (5, 10):
        saved.append(_save(manager, step, model, card))
    # Step 10's weights become NaN (or a float tensor says int32, the same bytes) and its checksums are
    # rewritten to match: only the values or the dtypes tell.
    path = saved[-1]
    if damage == "nan":
        state = {k: v.clone() for k, v in model.state_dict().items()}
        first = next(k for k, v in state.items() if v.is_floating_point())
        state[first].fill_(float("nan"))
        save_file(state, str(path / "model.safetensors"))
        expected = f"model.safetensors: {first} holds {state[first].numel()} NaN or infinite value(s)"
    else:
        first = relabel_first_float_tensor(path / "model.safetensors")
        expected = f"model.safetensors: {first} is torch.int32 where the model has torch.float32"
    sums = (path / CHECKSUMS).read_text().splitlines()
    sums = [f"{sha256_file(path / 'model.safetensors')}  model.safetensors" if line.endswith("  model.safetensors")
            else line for line in sums]
    (path / CHECKSUMS).write_text("\n".join(sums) + "\n")
    lines = []
    manager.log = lines.append
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 5  # the previous good checkpoint
    assert any(f"checkpoint {path} skipped: {expected}" in line for line in lines), lines
    assert not path.exists()  # set aside under another name: never loaded again


def _save(manager, step, model, card):
    from appliance.train.determinism import rng_state

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = {"epoch": 0, "batches_done": step, "sampler": {}, "scheduler": {}, "scaler": {}, "metrics": {},
               "config_hash": "h"}
    return manager.save(step, model=model, card=card, optimizer_state=optimizer.state_dict(),
                        optimizer_sharded=False, trainer=trainer, rng=rng_state())
