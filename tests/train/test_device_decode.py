"""[data] decode = "gpu" on CPU tensors (issue 27): the device path's workers hand over encoded JPEGs
with the CPU path's parameters; the training process decodes, augments and normalises the batch as
tensor ops. Same samples, same order, same parameters per sample, the pixel difference measured and
bounded, other formats decoded by the workers, a damaged JPEG one line naming its record, exact resume
through a real `appliance train` killed mid-epoch."""

import io
import os
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from torchvision.io import decode_jpeg
from torchvision.transforms.v2 import functional as F

from appliance.core.errors import ConfigError, DataError
from appliance.train import data, device_decode
from appliance.train.config import load_config
from conftest import appliance_cmd
from data_tools.augment import TrainTransform
from data_tools.augment_batch import augment_batch
from data_tools.example import encode_example
from data_tools.tfrecord import write_records
from train_data import CLASSES, make_config

# Augmented, the tensor path on CPU tensors is bit-identical to the CPU path (libjpeg-turbo decodes as
# Pillow does and the augmentation is the same arithmetic). Not augmented, torchvision's antialiased
# bilinear resize differs from Pillow's BILINEAR: measured on this data (RGB JPEG q90, 20..40 px to
# 16 px) mean 0.03, max 1 level of 255; at 224 and 512 px mean 0.067 and 0.050, max 1 (docs/train.md).
# The tolerance: at most 1 level anywhere, a mean of at most 0.1.
RESIZE_MAX_LEVELS, RESIZE_MEAN_LEVELS = 1, 0.1


def _image(rng, label: int, fmt: str) -> bytes:
    h, w = (int(v) for v in rng.integers(20, 41, 2))
    img = rng.integers(0, 90, (h, w, 3))
    img[:, : w // 2 if label == 0 else w] += [150, 20, 60] if label != 1 else [20, 150, 60]
    buf = io.BytesIO()
    Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _records(n: int, seed: int, damaged: int = -1):
    """RGB JPEGs of several sizes, every seventh a PNG (the workers' fallback); `damaged` truncated."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        label = i % len(CLASSES)
        encoded = _image(rng, label, "PNG" if i % 7 == 3 else "JPEG")
        if i == damaged:
            encoded = encoded[: len(encoded) // 2]
        yield encode_example({"image/encoded": encoded, "image/class/label": label})


def _config(tmp_path, name="run", damaged=-1, **sections):
    data_dir = tmp_path / "data"
    if not data_dir.exists():
        data_dir.mkdir()
        write_records(data_dir / "train-0.tfrecord", _records(48, seed=1, damaged=damaged))
        write_records(data_dir / "train-1.tfrecord", _records(48, seed=2))
        write_records(data_dir / "val-0.tfrecord", _records(20, seed=3))
    values = {"image_size": 16, "channels": 3, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
              "num_workers": 0, **sections.pop("data", {})}
    return make_config(tmp_path, name=name, data=values, **sections)


def _epoch(cfg, decode: str, epoch: int = 0):
    """Every training batch of an epoch through the real loaders (the sampler's shuffle), as the loop draws them."""
    loader, sampler = data.train_loader(cfg, 0, 1, torch.Generator(), pin=False, decode=decode,
                                        device=torch.device("cpu"))
    sampler.set_epoch(epoch)
    return [(images.clone(), labels.clone()) for images, labels in loader]


@pytest.fixture(scope="module")
def augmented(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("decode")
    return load_config(_config(tmp, augment={"enabled": True, "crop_scale": [0.3, 1.0]}, data={"num_workers": 2}))


def test_augmented_batches_match_the_cpu_path_sample_for_sample(augmented):
    for epoch in (0, 1):
        cpu, device = _epoch(augmented, "cpu", epoch), _epoch(augmented, "gpu", epoch)
        assert len(cpu) == len(device) == 96 // 16
        for (a, la), (b, lb) in zip(cpu, device):
            assert torch.equal(la, lb)  # the same samples in the same order
            assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape == (16, 3, 16, 16)
            assert torch.equal(a, b), (a - b).abs().max()  # measured: bit-identical on CPU tensors


def test_one_channel_runs_match_the_cpu_path_on_colour_and_grey_jpegs(tmp_path):
    # The CPU path makes a colour JPEG grey with Pillow's convert("L"); libjpeg's own GRAY decode (the
    # luma plane) differed from it by up to 9 levels on this data. The device path decodes as stored and
    # converts with Pillow's arithmetic: bit-identical again.
    rng = np.random.default_rng(7)

    def records(n):
        for i in range(n):
            h, w = (int(v) for v in rng.integers(20, 41, 2))
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            image = Image.fromarray(pixels if i % 3 else pixels[..., 0])  # every third a grey JPEG
            buf = io.BytesIO()
            image.save(buf, format="PNG" if i % 7 == 3 else "JPEG", quality=85)
            yield encode_example({"image/encoded": buf.getvalue(), "image/class/label": i % len(CLASSES)})

    (tmp_path / "data").mkdir()
    write_records(tmp_path / "data" / "train-0.tfrecord", records(64))
    write_records(tmp_path / "data" / "val-0.tfrecord", records(8))
    grey = {"channels": 1, "mean": [0.5], "std": [0.25]}
    for augment in (True, False):
        cfg = load_config(_config(tmp_path, name=f"grey-{augment}", data=grey, augment={"enabled": augment}))
        if augment:  # float32, normalised
            cpu = _epoch(cfg, "cpu")
        else:  # uint8 (pinned batches stay pixels); Pillow's resize against torchvision's, as for colour
            loader, sampler = data.train_loader(cfg, 0, 1, torch.Generator(), pin=True, decode="cpu")
            sampler.set_epoch(0)
            cpu = [(images.clone(), labels.clone()) for images, labels in loader]
        device = _epoch(cfg, "gpu")
        assert len(cpu) == len(device) == 4
        for (a, la), (b, lb) in zip(cpu, device):
            assert torch.equal(la, lb) and a.shape == b.shape == (16, 1, 16, 16) and a.dtype == b.dtype
            if augment:
                assert torch.equal(a, b), (a - b).abs().max()
            else:
                assert (a.int() - b.int()).abs().max() <= RESIZE_MAX_LEVELS


def test_pillow_grey_is_pillows_convert_to_l():
    pixels = np.random.default_rng(3).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    expected = torch.from_numpy(np.asarray(Image.fromarray(pixels).convert("L"))).unsqueeze(0)
    assert torch.equal(device_decode.pillow_grey(torch.from_numpy(pixels).permute(2, 0, 1)), expected)
    assert torch.equal(device_decode.pillow_grey(expected), expected)  # one channel: as it is


def test_workers_hand_over_the_jpeg_bytes_with_the_cpu_paths_parameters(augmented):
    encoded = data._dataset(augmented, augmented.data.train, augment=True, decode="gpu")
    cpu = data._dataset(augmented, augmented.data.train, augment=True)
    kinds = set()
    for index in range(0, 30):
        sample, label = encoded.dataset[index]
        sample = encoded.transform(sample, index, 3)
        image, cpu_label = cpu.dataset[index]  # the CPU path's decoded image, before augmentation
        assert label == cpu_label and sample.index == index
        assert sample.params == cpu.transform.sample_params(image.height, image.width, index, 3)
        kinds.add(type(sample.data).__name__)
        assert isinstance(sample.data, bytes) == (index % 7 != 3)  # PNGs are decoded by the worker
    assert kinds == {"bytes", "Tensor"}


def test_batched_tensor_augmentation_is_the_per_image_augmentation():
    transform = TrainTransform(24, seed=5, degrees=15.0, hue=0.1, saturation=0.1, value=0.1)
    g = torch.Generator().manual_seed(0)
    for channels in (3, 1):
        images = [torch.randint(0, 256, (channels, 20 + i, 31 - i), dtype=torch.uint8, generator=g) for i in range(9)]
        params = [transform.sample_params(im.shape[1], im.shape[2], i, 2) for i, im in enumerate(images)]
        expected = torch.stack([transform.apply(im, p) for im, p in zip(images, params)])
        assert torch.equal(augment_batch(transform, images, params), expected)
    assert {p.flip for p in params} == {True, False}


def test_plain_batches_differ_from_pillows_resize_by_a_bounded_amount(tmp_path):
    cfg = load_config(_config(tmp_path))
    loader, _ = data.train_loader(cfg, 0, 1, torch.Generator(), pin=True, decode="cpu")  # uint8, Pillow's resize
    cpu = [images for images, _ in loader]
    device = [images for images, _ in _epoch(cfg, "gpu")]
    diffs = torch.cat([(a.int() - b.int()).abs().flatten() for a, b in zip(cpu, device)]).float()
    assert all(b.dtype == torch.uint8 and b.shape == (16, 3, 16, 16) for b in device)
    assert 0 < diffs.mean() <= RESIZE_MEAN_LEVELS and diffs.max() <= RESIZE_MAX_LEVELS, (diffs.mean(), diffs.max())
    val = data.val_loader(cfg, 0, 1, torch.Generator(), pin=False, decode="gpu")
    assert sum(len(labels) for _, labels in val) == 20  # evaluation decodes the same way


def test_a_batch_of_one_size_is_resized_in_one_call_as_image_by_image():
    rng = np.random.default_rng(4)
    jpegs = []
    for _ in range(5):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (30, 22, 3), dtype=np.uint8)).save(buf, format="JPEG")
        jpegs.append(buf.getvalue())
    samples = [device_decode.Encoded(j, 30, 22, index=i) for i, j in enumerate(jpegs)]
    batch, labels = device_decode.collate([(s, 0) for s in samples])
    decoder = device_decode.DeviceDecoder(torch.device("cpu"), 16, 3, None, locate=None)
    images, _ = decoder((batch, labels))
    one_by_one = [F.resize(decode_jpeg(torch.frombuffer(bytearray(j), dtype=torch.uint8)), [16, 16], antialias=True)
                  for j in jpegs]
    assert torch.equal(images, torch.stack(one_by_one))


def test_a_damaged_jpeg_is_one_line_naming_its_record(tmp_path):
    cfg = load_config(_config(tmp_path, damaged=5))
    loader, _ = data.train_loader(cfg, 0, 1, torch.Generator(), pin=False, decode="gpu")
    with pytest.raises(DataError) as err:
        for _ in loader:
            pass
    assert "train-0.tfrecord: record 5: undecodable JPEG (" in str(err.value) and "\n" not in str(err.value)


def test_a_jpeg_the_device_refuses_is_decoded_on_the_cpu_instead(tmp_path, monkeypatch):
    """nvJPEG lacks some JPEG variants: the batch is decoded one image at a time and the refused image on
    the CPU. Here the device's refusal is played by a decode_jpeg that refuses record 4 on the device."""
    cfg = load_config(_config(tmp_path))
    expected = _epoch(cfg, "gpu")
    refused = next(r for i, r in enumerate(_records(48, seed=1)) if i == 4)
    real = device_decode.decode_jpeg
    refusals = []

    def device_refuses(data, mode, device="cpu"):
        items = data if isinstance(data, list) else [data]
        on_the_device = isinstance(device, torch.device)  # the decoder's device; its CPU fallback names "cpu"
        if not on_the_device or not any(bytes(t.numpy()) in refused for t in items):
            return real(data, mode=mode)
        refusals.append(len(items))
        raise RuntimeError("decode_jpeg, nvjpeg.cpp:1, unsupported JPEG variant")

    monkeypatch.setattr(device_decode, "decode_jpeg", device_refuses)
    got = _epoch(cfg, "gpu")
    assert len(refusals) == 2 and refusals[0] > 1 and refusals[1] == 1  # the batch's JPEGs, then the one alone
    for (a, la), (b, lb) in zip(expected, got):
        assert torch.equal(la, lb) and torch.equal(a, b)


def test_decode_setting(tmp_path):
    assert device_decode.decode_mode("auto", torch.device("cpu")) == "cpu"
    assert device_decode.decode_mode("gpu", torch.device("cpu")) == "gpu"  # the documented tensor path on the CPU
    with pytest.raises(ConfigError, match=r"\[data\] decode 'nvjpeg' is not one of auto, cpu, gpu"):
        load_config(_config(tmp_path, data={"decode": "nvjpeg"}))
    with pytest.raises(ConfigError, match=r"\[data\] decode \"gpu\" decodes classification images"):
        load_config(_config(tmp_path, data={"decode": "gpu"}, task={"kind": "segmentation"},
                                 model={"architecture": "unet_small"}))
    # Only a setting other than auto enters the training hash (older runs' hashes stay valid).
    hashes = {d: load_config(_config(tmp_path, data={"decode": d})).training_hash() for d in ("auto", "cpu", "gpu")}
    assert len(set(hashes.values())) == 3
    assert hashes["auto"] == load_config(_config(tmp_path)).training_hash()


def test_a_resumed_loader_draws_the_rest_of_the_epoch_exactly(augmented):
    """What a restarted process does: a fresh loader (fresh workers) from the sampler's saved state."""
    loader, sampler = data.train_loader(augmented, 0, 1, torch.Generator(), pin=False, decode="gpu")
    sampler.set_epoch(1)
    whole = [(images, labels) for images, labels in loader]
    saved = {**sampler.state_dict(), "epoch": 1, "position": 2 * augmented.train.batch_size}
    loader, sampler = data.train_loader(augmented, 0, 1, torch.Generator(), pin=False, decode="gpu")
    sampler.load_state_dict(saved)
    sampler.set_epoch(1)
    rest = [(images, labels) for images, labels in loader]
    assert len(rest) == len(whole) - 2
    for (a, la), (b, lb) in zip(whole[2:], rest):
        assert torch.equal(la, lb) and torch.equal(a, b)


def _start(config, fault=""):
    env = {**os.environ, "APPLIANCE_TEST_FAULT": fault, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(appliance_cmd("train", str(config), "--nproc-per-node", "1", "--max-restarts", "1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=config.parent)


@pytest.mark.slow
def test_exact_resume_with_device_decode(tmp_path):
    """A real run SIGKILLed mid-epoch and restarted by torchrun ends bit-identical to one never stopped
    (both run at once: the test costs one run's start-ups, not two)."""
    sections = {"augment": {"enabled": True}, "data": {"decode": "gpu", "num_workers": 1},
                "train": {"epochs": 2}, "checkpoint": {"every_steps": 4}}
    configs = {name: _config(tmp_path, name=name, **sections) for name in ("reference", "killed")}
    procs = {"reference": _start(configs["reference"]), "killed": _start(configs["killed"], "step:7:0")}
    outputs = {name: proc.communicate(timeout=300) for name, proc in procs.items()}
    runs = {}
    for name, (out, err) in outputs.items():
        assert procs[name].returncode == 0, err[-3000:]
        assert "decoded and augmented by the training process on cpu" in out + err
        runs[name] = load_file(tmp_path / "runs" / name / "model" / "model.safetensors")
    out, err = outputs["killed"]
    assert "exitcode: -9" in err and "resumed from" in out
    assert runs["reference"].keys() == runs["killed"].keys()
    for key, value in runs["reference"].items():
        assert torch.equal(value, runs["killed"][key]), key
