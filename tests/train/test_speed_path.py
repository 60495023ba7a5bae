"""The loop's fast path on CPU tensors (issue 27): uint8 batches normalised on the device equal the
one preprocessing definition bit for bit; the Guard finds the first non-finite step without a read
per step; persistent loader workers still augment each epoch with that epoch's parameters; loaded
optimizer state takes its parameter's memory layout; more processes than GPUs is one line
(a pure function of the two numbers, and the CLI on this machine)."""

import io
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

from appliance.core.errors import ConfigError
from appliance.train import data, launcher
from appliance.train.config import load_config
from appliance.train.ddp import match_layout
from appliance.train.step import Guard, Normalise, to_device
from conftest import appliance_cmd
from train_data import make_config


def _encoded(mode: str, fmt: str, size=(13, 9), seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("mode,fmt,channels,mean,std", [
    ("RGB", "JPEG", 3, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ("RGB", "PNG", 1, [0.45], [0.226]),  # grey from RGB
    ("L", "PNG", 1, [0.3], [0.25]),
    ("L", "PNG", 3, [0.5, 0.4, 0.3], [0.2, 0.3, 0.4]),
])
def test_uint8_batches_normalised_on_the_device_equal_the_cpu_preprocessing(mode, fmt, channels, mean, std):
    encoded = [_encoded(mode, fmt, seed=s) for s in range(3)]
    reference = torch.stack([data.decode_image(e, 8, channels, mean, std) for e in encoded])
    pixels = torch.stack([data.decode_pixels(e, 8, channels) for e in encoded])
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, channels, 8, 8)
    images, labels = to_device(pixels, torch.tensor([0, 1, 2]), torch.device("cpu"),
                               Normalise(mean, std, channels, torch.device("cpu")), torch.channels_last)
    assert images.dtype == torch.float32 and images.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(images, reference)  # the same float32 arithmetic, in the same order


def test_undecodable_pixels_are_a_data_error():
    from appliance.core.errors import DataError

    with pytest.raises(DataError, match="image_decode: image: not an image format Pillow reads"):
        data.decode_pixels(b"\x89PNG\r\n\x1a\n not a png", 8, 3)


def test_guard_names_the_first_non_finite_step_and_rank_only_when_asked():
    guard = Guard(torch.device("cpu"), rank=0, world=1, horizon=100)
    for step, loss in enumerate([1.0, 0.5, float("nan"), float("inf"), 0.2], start=1):
        guard.note(torch.tensor(loss), step)
    assert guard.agree() == (False, 3, 0)
    clean = Guard(torch.device("cpu"), rank=0, world=1, horizon=100)
    clean.note(torch.tensor(0.1), 1)
    assert clean.agree() == (False, -1, -1) and not clean.stop_requested()
    clean.local = True  # what SIGTERM's handler sets
    assert clean.stop_requested() and clean.agree() == (True, -1, -1)


def test_guard_and_window_keep_step_scalars_across_folds():
    """Past FOLD_EVERY steps the kept scalars are reduced: the first bad step, the sums and the
    maximum come out as if every step had been added one by one."""
    from appliance.train.step import FOLD_EVERY, TrainWindow

    steps = 2 * FOLD_EVERY + 9
    bad = {FOLD_EVERY + 5, FOLD_EVERY + 30, steps}  # the first bad step lies in the second fold
    guard = Guard(torch.device("cpu"), rank=0, world=1, horizon=steps)
    window = TrainWindow(torch.device("cpu"), clip=2.0)
    norms = [0.5 + (i % 7) for i in range(steps)]
    for step in range(1, steps + 1):
        loss = torch.tensor(float("nan") if step in bad else 0.25)
        guard.note(loss, step)
        window.count_step(torch.tensor(norms[step - 1]))
        window.count_predictions(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0]))
        window.count_loss(torch.tensor(0.25))
    assert guard.agree() == (False, FOLD_EVERY + 5, 0)
    figures = window.figures()
    assert figures["grad_norm"] == pytest.approx(sum(norms) / steps) and figures["grad_norm_max"] == max(norms)
    assert figures["clipped_fraction"] == sum(n > 2.0 for n in norms) / steps
    assert figures["train_acc"] == 0.5 and figures["loss_sum"] == 0.25 * steps


def test_window_counts_class_labels_on_the_host_and_mask_pixels_past_the_logits_as_ignored():
    """Class labels are all counted (the loader refuses a label outside the classes) without a device
    operation; a mask's ignored label (255: past the logits) is no prediction, correct or not."""
    from appliance.train.step import TrainWindow

    window = TrainWindow(torch.device("cpu"))
    window.count_predictions(torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 1.0]]), torch.tensor([0, 0, 1]))
    assert window._labelled == [] and window.figures()["train_acc"] == 1 / 3
    masks = TrainWindow(torch.device("cpu"))
    logits = torch.tensor([[[[2.0, 0.0, 0.0]], [[0.0, 1.0, 5.0]]]])  # [N=1, C=2, H=1, W=3]: argmax 0, 1, 1
    masks.count_predictions(logits, torch.tensor([[[0, 255, 0]]]))
    assert masks.figures()["train_acc"] == 1 / 2  # pixel 0 right, pixel 1 ignored, pixel 2 wrong


def test_total_norm_equals_torchs_own_bit_for_bit():
    from appliance.train.step import total_norm

    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(shape, generator=gen) for shape in [(32, 1, 3, 3), (32,), (64, 32, 3, 3), (3, 128)]]
    assert torch.equal(total_norm(grads), torch.nn.utils.get_total_norm(grads))
    mixed = grads + [torch.randn(5, generator=gen, dtype=torch.float64)]
    assert torch.equal(total_norm(mixed), torch.nn.utils.get_total_norm(mixed))


def test_persistent_workers_augment_each_epoch_with_its_own_parameters(tmp_path):
    cfg = load_config(make_config(tmp_path, augment={"enabled": True}, data={"num_workers": 2}))
    loader, sampler = data.train_loader(cfg, 0, 1, torch.Generator(), pin=False)
    assert loader.persistent_workers
    augmented = loader.dataset.dataset  # SeededAugmentation, as the CPU path applies it
    seen = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        batch_images, _ = next(iter(loader))  # the same workers both epochs
        indices = sampler.share(epoch)[:len(batch_images)]
        expected = []
        for index in indices:
            image, _ = augmented.dataset[int(index)]
            expected.append(augmented.transform(image, int(index), epoch))
        assert torch.equal(batch_images, torch.stack(expected))
        seen.append(batch_images)
    assert not torch.equal(seen[0], seen[1])
    data_iter = loader._iterator
    assert data_iter is not None and data_iter._workers[0].is_alive()
    data_iter._shutdown_workers()


def test_loaded_optimizer_state_takes_the_parameters_memory_layout():
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(conv.parameters(), lr=0.1)
    conv(torch.randn(2, 3, 5, 5).contiguous(memory_format=torch.channels_last)).sum().backward()
    optimizer.step()
    saved = {k: ({i: {n: v.contiguous() if torch.is_tensor(v) else v for n, v in s.items()} for i, s in v.items()}
                 if k == "state" else v) for k, v in optimizer.state_dict().items()}
    fresh = torch.optim.AdamW(conv.parameters(), lr=0.1)
    fresh.load_state_dict(saved)
    assert fresh.state[conv.weight]["exp_avg"].stride() != conv.weight.stride()
    match_layout(fresh)
    for name in ("exp_avg", "exp_avg_sq"):
        assert fresh.state[conv.weight][name].stride() == conv.weight.stride()
        assert torch.equal(fresh.state[conv.weight][name], optimizer.state[conv.weight][name])


@pytest.mark.parametrize("nproc,gpus,refused", [
    (2, 1, "--nproc-per-node 2 is more than the 1 GPU of this machine (one process per GPU): "
           "use --nproc-per-node 1 or auto"),
    (5, 4, "--nproc-per-node 5 is more than the 4 GPUs of this machine (one process per GPU): "
           "use --nproc-per-node 4 or auto"),
    (1, 1, None), (4, 8, None), (8, 8, None),
    (2, 0, None), (7, 0, None),  # no GPU: CPU processes with gloo, any number
])
def test_more_processes_than_gpus_is_refused_naming_both_numbers(nproc, gpus, refused):
    if refused is None:
        launcher.check_nproc_fits(nproc, gpus)
        return
    with pytest.raises(ConfigError) as err:
        launcher.check_nproc_fits(nproc, gpus)
    assert str(err.value) == refused


def test_the_cli_checks_processes_against_this_machines_gpus_before_torchrun(tmp_path):
    """`appliance train --nproc-per-node 2 --dry-run`, nothing faked: on this CPU-only box two gloo
    processes are accepted; on a one-GPU machine the same command is the one refusal line."""
    config = make_config(tmp_path)
    proc = subprocess.run(appliance_cmd("train", str(config), "--nproc-per-node", "2", "--dry-run"),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    gpus = launcher.gpu_count()
    if gpus == 0 or gpus >= 2:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "--nproc-per-node 2" in proc.stdout
    else:
        assert proc.returncode != 0
        assert proc.stderr.strip().splitlines() == [
            "appliance train: error: --nproc-per-node 2 is more than the 1 GPU of this machine (one process per "
            "GPU): use --nproc-per-node 1 or auto"]
