"""Fine-tuning from weights a site already has ([model] init): real torchrun runs on the digits
(8x8 images), ONNX graphs imported with onnx2torch, trained and exported back; frozen layers and
their BatchNorm statistics untouched; lineage and exact resume."""

import io
import json
import os
import random
import subprocess

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import appliance_cmd
from train_data import _toml

from data_tools.example import encode_example
from data_tools.tfrecord import write_records

SPLIT_SEED = 0
FT_STEPS = 6  # fine-tuning length: 6 steps of 2 x 16 images, well short of one epoch (about 22 steps)
FROZEN = ["0.", "1.", "3."]  # small_cnn's first three conv blocks; blocks 4 and 6 and the head (9) train
LR_MULT = {"9": 10.0, "6.": 0.5}


def _png(pixels) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8), mode="L").save(buf, format="PNG")
    return buf.getvalue()


def digits_shards(directory, digits):
    """train/val TFRecords of scikit-learn's bundled digits `digits`, labelled 0..len(digits)-1."""
    from sklearn.datasets import load_digits

    data = load_digits()
    keep = np.isin(data.target, digits)
    images = np.rint(data.images[keep] * (255 / 16)).clip(0, 255)
    labels = np.searchsorted(digits, data.target[keep])
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    val, train = order[: len(order) // 5], order[len(order) // 5:]
    directory.mkdir(parents=True, exist_ok=True)
    for name, index in (("train", train), ("val", val)):
        write_records(directory / f"{name}.tfrecord",
                      (encode_example({"image/encoded": _png(images[i]), "image/format": b"png",
                                       "image/class/label": int(labels[i])}) for i in index))
    return images[val], labels[val]


def write_config(path, name, data_dir, digits, **sections):
    config = {
        "run": {"name": name, "out_dir": "runs", "seed": 3, "deterministic": True, "log_every": 4},
        "data": {"train": [f"{data_dir}/train.tfrecord"], "val": [f"{data_dir}/val.tfrecord"],
                 "classes": [str(d) for d in digits], "image_size": 8, "channels": 1, "mean": [0.3],
                 "std": [0.3], "num_workers": 0},
        "model": {"architecture": "small_cnn"},
        "optimizer": {"name": "adamw", "lr": 0.003, "weight_decay": 0.05},
        "train": {"epochs": 1, "batch_size": 16, "precision": "fp32", "baseline_margin": 0.0,
                  "max_predicted_share": 1.0},
        "checkpoint": {"every_steps": 5, "keep_last": 5, "keep_best": 0, "min_free_gb": 0.0},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    path.write_text("".join(f"[{s}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in t.items()) for s, t in config.items()))
    return path


def train(config, *args, nproc=2, fault="", timeout=300):
    env = {**os.environ, "APPLIANCE_TEST_FAULT": fault, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(appliance_cmd("train", str(config), "--nproc-per-node", str(nproc), *args),
                          capture_output=True, text=True, env=env, cwd=config.parent, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def accuracy(model_dir, images, labels) -> float:
    """Top-1 of a trained-model directory on held-out images, preprocessed as its card says."""
    from appliance.models import load_trained_model

    model, card = load_trained_model(model_dir)
    x = torch.from_numpy(((images / 255.0 - card.mean[0]) / card.std[0]).astype(np.float32))[:, None]
    with torch.no_grad():
        return float((model(x).argmax(1).numpy() == labels).mean())


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("finetune")


@pytest.fixture(scope="module")
def pretrained(work):
    """small_cnn trained on the digits 0-4: the weights a site already has."""
    digits_shards(work / "digits-0-4", [0, 1, 2, 3, 4])
    config = write_config(work / "base.toml", "base", "digits-0-4", [0, 1, 2, 3, 4], train={"epochs": 3})
    train(config, nproc=1)
    return work / "runs" / "base"


@pytest.fixture(scope="module")
def new_task(work):
    return digits_shards(work / "digits-5-9", [5, 6, 7, 8, 9])



@pytest.fixture(scope="module")
def finetuned(work, pretrained, new_task):
    """Warm start from the base run's last checkpoint (weights only), head trained at 10x lr."""
    last = sorted((pretrained / "checkpoints").glob("step-*"))[-1]
    config = write_config(work / "ft.toml", "ft", "digits-5-9", [5, 6, 7, 8, 9],
                          model={"init": str(last), "frozen_prefixes": FROZEN, "reset": ["9"]},
                          optimizer={"lr_mult": LR_MULT}, train={"max_steps": FT_STEPS},
                          checkpoint={"every_steps": 2})
    return config, train(config)


def test_fine_tuning_transfers_what_the_first_task_learned(work, pretrained, finetuned, new_task):
    config, proc = finetuned
    assert "init: 30 tensors from" in proc.stdout and "re-initialised by [model] reset: 9.weight, 9.bias" in proc.stdout
    # The same steps, data, frozen layers and learning rates; only the starting weights differ.
    scratch = write_config(work / "scratch.toml", "scratch", "digits-5-9", [5, 6, 7, 8, 9],
                           model={"frozen_prefixes": FROZEN}, optimizer={"lr_mult": LR_MULT},
                           train={"max_steps": FT_STEPS})
    train(scratch)
    fine = accuracy(work / "runs" / "ft" / "model", *new_task)
    random_init = accuracy(work / "runs" / "scratch" / "model", *new_task)
    assert fine > random_init + 0.2, (fine, random_init)


def test_frozen_parameters_and_their_batchnorm_statistics_are_byte_identical(work, pretrained, finetuned):
    start = load_file(sorted((pretrained / "checkpoints").glob("step-*"))[-1] / "model.safetensors")
    end = load_file(work / "runs" / "ft" / "model" / "model.safetensors")
    frozen = [k for k in start if k.split(".")[0] in ("0", "1", "3")]
    assert any("running_mean" in k for k in frozen) and any(k.endswith(".weight") for k in frozen)
    for key in frozen:
        assert torch.equal(start[key], end[key]), f"{key} changed although frozen"
    trained = [k for k in start if k.split(".")[0] in ("4", "6")]
    assert any(not torch.equal(start[k], end[k]) for k in trained if "running" in k), "BatchNorm of trained layers froze"
    assert not torch.equal(start["4.0.weight"], end["4.0.weight"])


def test_param_groups_and_the_init_report_are_in_the_run(work, finetuned):
    run = work / "runs" / "ft"
    last = sorted((run / "checkpoints").glob("step-*"))[-1]
    groups = json.loads((last / "optimizer.json").read_text())["param_groups"]
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"decay lr_mult=1", "no_decay lr_mult=1", "decay lr_mult=0.5", "no_decay lr_mult=0.5",
                            "decay lr_mult=10", "no_decay lr_mult=10"}, sorted(by_name)
    assert by_name["no_decay lr_mult=10"]["weight_decay"] == 0.0 and by_name["decay lr_mult=10"]["weight_decay"] == 0.05
    assert by_name["decay lr_mult=10"]["initial_lr"] == pytest.approx(0.03)
    manifest = json.loads((run / "manifest.json").read_text())
    init = manifest["params"]["init"]
    assert init["kind"] == "checkpoint" and init["reset"] == ["9.weight", "9.bias"] and init["missing"] == []
    assert manifest["params"]["config"]["init_sha256"] == init["sha256"]
    assert {"path": init["path"], "sha256": init["sha256"]} in manifest["inputs"]  # the lineage carries it
    assert json.loads((run / "init.json").read_text()) == init


def test_a_killed_fine_tuning_run_resumes_bit_identical(work, finetuned):
    config, _ = finetuned
    step = random.Random().choice([3, 5])  # between checkpoints (every 2 steps): lost work is redone
    killed = config.parent / "ft-killed.toml"
    killed.write_text(config.read_text().replace('name = "ft"', 'name = "ft-killed"'))
    proc = train(killed, "--max-restarts", "1", fault=f"step:{step}:1")
    assert "exitcode: -9" in proc.stderr and "resumed from" in proc.stdout, (step, proc.stdout[-2000:], proc.stderr[-3000:])
    for name in ("model/model.safetensors", f"checkpoints/step-{FT_STEPS:08d}/optimizer.safetensors"):
        a, b = load_file(work / "runs" / "ft" / name), load_file(work / "runs" / "ft-killed" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (step, name)


def test_other_init_weights_change_the_config_hash(work, pretrained):
    from appliance.train.config import load_config

    newest, older = sorted((pretrained / "checkpoints").glob("step-*"))[:-3:-1]
    first, second = (load_config(write_config(work / f"hash-{i}.toml", f"hash-{i}", "digits-0-4", [0, 1, 2, 3, 4],
                                              model={"init": str(path)}))
                     for i, path in enumerate((newest, older)))
    assert second.init_sha256 != first.init_sha256 and second.training_hash() != first.training_hash()
    # The same weights from another place (the final model is the newest checkpoint's): the same hash.
    third = load_config(write_config(work / "hash-2.toml", "hash-2", "digits-0-4", [0, 1, 2, 3, 4],
                                     model={"init": str(pretrained)}))
    assert third.init_sha256 == first.init_sha256 and third.training_hash() == first.training_hash()


def test_a_damaged_checkpoint_as_init_is_one_line(work, pretrained):
    """Another run's checkpoint is read as resume reads it: weights that differ from its SHA256SUMS, or a
    damaged SHA256SUMS, are refused before any process starts."""
    import shutil

    from appliance.core.errors import ConfigError
    from appliance.train.config import load_config

    newest = sorted((pretrained / "checkpoints").glob("step-*"))[-1]
    for damage, expected in (("weights", "fails its sha256 check against"), ("sums", "SHA256SUMS line 1 is not")):
        copy = work / f"damaged-{damage}" / newest.name
        shutil.copytree(newest, copy, dirs_exist_ok=True)
        if damage == "weights":
            data = bytearray((copy / "model.safetensors").read_bytes())
            data[-1] ^= 1
            (copy / "model.safetensors").write_bytes(bytes(data))
        else:
            (copy / "SHA256SUMS").write_text("not a sums line\n")
        with pytest.raises(ConfigError) as err:
            load_config(write_config(work / f"damaged-{damage}.toml", f"damaged-{damage}", "digits-0-4",
                                     [0, 1, 2, 3, 4], model={"init": str(copy)}))
        assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


def export_onnx(model, path, shape):
    model.eval()
    torch.onnx.export(model, (torch.zeros(shape),), str(path), dynamo=False, input_names=["input"],
                      output_names=["logits"], dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                      opset_version=17)


@pytest.mark.parametrize("architecture", ["small_cnn", "resnet18"])
def test_an_onnx_model_is_fine_tuned_checkpointed_and_exported_back(work, new_task, architecture):
    """A vendor's ONNX graph (here one exported by the test, with random weights and 10 classes)
    becomes a torch module, trains (killed once and resumed), and exports back to ONNX with parity."""
    from appliance.models import build_model

    torch.manual_seed(0)
    vendor = work / f"vendor-{architecture}.onnx"
    export_onnx(build_model(architecture, 10, 1), vendor, (1, 1, 8, 8))
    config = write_config(work / f"onnx-{architecture}.toml", f"onnx-{architecture}", "digits-5-9",
                          [5, 6, 7, 8, 9], model={"architecture": "onnx", "init": vendor.name},
                          optimizer={"lr_mult": {"fc/" if architecture == "resnet18" else "9/": 10.0}},
                          train={"max_steps": 8})
    proc = train(config, "--max-restarts", "1", fault="step:6:1")
    assert "classifier head" in proc.stdout and "(10 classes in the graph, 5 here)" in proc.stdout
    assert "resumed from" in proc.stdout and "step-00000005" in proc.stdout
    run = work / "runs" / f"onnx-{architecture}"
    if architecture == "small_cnn":  # killed and resumed equals uninterrupted, as for built-in architectures
        reference = config.parent / "onnx-reference.toml"
        reference.write_text(config.read_text().replace(f'name = "onnx-{architecture}"', 'name = "onnx-reference"'))
        train(reference)
        a = load_file(run / "model" / "model.safetensors")
        b = load_file(work / "runs" / "onnx-reference" / "model" / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (run / "model" / "source.onnx").read_bytes() == vendor.read_bytes()
    out = work / f"export-{architecture}"
    export = subprocess.run(appliance_cmd("export", str(run), "--out", str(out), "--max-rel-error", "1e-5"),
                            capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-3000:]
    parity = json.loads((out / "parity.json").read_text())["parity"]
    assert parity["passed"] and parity["max_rel_error"] <= 1e-5 and parity["top1_agreement"] == 1.0
    if architecture == "small_cnn":  # and deploys like any other: TVM builds it, checked against onnxruntime
        built = work / f"compile-{architecture}"
        proc = subprocess.run(appliance_cmd("compile", str(out / "model.onnx"), "--target", "x86_64", "--out", str(built)),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        check = json.loads((built / "compile.json").read_text())["check"]
        assert check["passed"] and check["top1_agreement"] == 1.0
    # The graph trained: its weights are not the vendor's any more.
    import onnx
    from onnx import numpy_helper

    before = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(vendor)).graph.initializer}
    trained = load_file(run / "model" / "model.safetensors")
    conv = next(k for k in trained if k.endswith("Conv.weight"))
    assert not any(v.shape == trained[conv].shape and np.array_equal(v, trained[conv].numpy()) for v in before.values())
