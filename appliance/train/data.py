"""From TFRecord files to batches: decode, resize, normalise; the resumable sampler per rank.

`decode_image` applies the one definition of preprocessing (data_tools/preprocessing.py;
export and the edge runner read the same mean/std/size from the model card).
"""

from __future__ import annotations

import functools
import os
import signal
import time

import torch

from appliance.core.errors import DataError
from appliance.tasks import task_for
from appliance.train import device_decode, faults
from data_tools.image_decode import DEFAULT_MAX_PIXELS, ImageProblem, decode_image as bounded_decode, record_problem
from data_tools.labels import image_problem, label_problem
from data_tools.preprocessing import preprocess_image
from data_tools.dataset import TFRecordDataset, ShardedSampler
from data_tools.augment import SeededAugmentation, TrainTransform


def decode_image(encoded: bytes, image_size: int, channels: int, mean, std,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> torch.Tensor:
    """PNG/JPEG bytes -> float32 tensor [C, H, W]: resized to image_size, normalised with mean/std.

    The arithmetic is data_tools.preprocessing.preprocess_image, the function export
    parity, calibration and the edge runner use too, so training and deployment agree.
    """
    preprocessing = {"image_size": image_size, "mean": mean, "std": std,
                     "channel_order": "RGB" if channels == 3 else "L"}
    # Every failure of the bytes is the record's (the bounded decoder's one line); preprocess_image's
    # own ValueErrors are of the config.
    image = decode_for_augmentation(encoded, channels, max_pixels)
    return torch.from_numpy(preprocess_image(image, preprocessing))


def decode_pixels(encoded: bytes, image_size: int, channels: int, max_pixels: int = DEFAULT_MAX_PIXELS) -> torch.Tensor:
    """PNG/JPEG bytes -> uint8 tensor [C, H, W], resized: decode_image's first steps (channel order,
    bilinear resize); step.Normalise finishes its arithmetic on the device, bit for bit (a test holds
    them together). A quarter of float32's bytes cross to the GPU."""
    import numpy as np
    from PIL import Image

    image = decode_for_augmentation(encoded, channels, max_pixels)
    if image.size != (image_size, image_size):
        image = image.resize((image_size, image_size), Image.BILINEAR)
    pixels = np.array(image, dtype=np.uint8)  # a writable copy
    pixels = pixels[:, :, None] if pixels.ndim == 2 else pixels
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def decode_for_augmentation(encoded: bytes, channels: int, max_pixels: int = DEFAULT_MAX_PIXELS):
    """PNG/JPEG bytes -> a PIL image in the model's channel order; the augmentation resizes and normalises.
    The bytes go through data_tools.image_decode, the bounded decoder the data check uses: what it
    quarantines (image_too_large, image_decode) is refused here in the same words."""
    try:
        return bounded_decode(encoded, "RGB" if channels == 3 else "L", max_pixels)
    except ImageProblem as err:
        raise DataError(record_problem(err)) from None


def _dataset(cfg, files, augment: bool = False, pixels: bool = False, decode: str = "cpu"):
    """pixels: uint8 samples, normalised on the device (without augmentation). decode "gpu": the
    samples are device_decode.Encoded (a JPEG's bytes, its parameters), decoded by the training process."""
    samples = task_for(cfg.task).dataset(cfg, files, augment)
    if samples is not None:  # the task makes its own samples (segmentation: image and mask, normalised here)
        return samples
    limit = cfg.data.max_pixels
    if augment:
        transform = functools.partial(decode_for_augmentation, channels=cfg.data.channels, max_pixels=limit)
    elif pixels or decode == "gpu":
        transform = functools.partial(decode_pixels, image_size=cfg.data.image_size, channels=cfg.data.channels,
                                      max_pixels=limit)
    else:
        transform = functools.partial(decode_image, image_size=cfg.data.image_size, channels=cfg.data.channels,
                                      mean=cfg.data.mean, std=cfg.data.std, max_pixels=limit)
    if decode == "gpu":  # the CPU path's decode stays the fallback for what the device does not decode
        transform = functools.partial(device_decode.encode_for_device, fallback=transform, max_pixels=limit)
    slow = faults.slow_decode_seconds()
    if slow and files == cfg.data.train:
        transform = functools.partial(_slowed, transform, slow)
    # "raw": the image feature and the label are judged by data_tools.labels, the definitions the data
    # check uses; the image is then decoded by decode_image above, the one preprocessing definition.
    dataset = TFRecordDataset(files, features={cfg.data.image_key: "raw", cfg.data.label_key: "raw"},
                              image_key=cfg.data.image_key, label_key=cfg.data.label_key)
    dataset = CheckedSamples(dataset, cfg.data.image_key, cfg.data.label_key, cfg.num_classes, transform)
    if decode == "gpu":  # every sample learns its index (and its augmentation's parameters)
        return SeededAugmentation(dataset, device_decode.DeviceParams(train_transform(cfg) if augment else None))
    if augment:
        # Seeded by (seed, epoch, sample index): a resumed run augments each sample as before.
        dataset = SeededAugmentation(dataset, train_transform(cfg))
    return dataset


def train_transform(cfg) -> TrainTransform:
    """The seeded training augmentation of [augment] (both decode paths draw its parameters)."""
    a = cfg.augment
    return TrainTransform(
        cfg.data.image_size, seed=cfg.run.seed, degrees=a.degrees, hue=a.hue, saturation=a.saturation,
        value=a.value, scale=tuple(a.crop_scale), flip_probability=a.flip_probability,
        mean=cfg.data.mean, std=cfg.data.std, debug=a.debug)


def _slowed(transform, seconds: float, encoded: bytes):
    """The test hook's expensive decode (faults.SLOW_DECODE_ENV)."""
    time.sleep(seconds)
    return transform(encoded)


class CheckedSamples(torch.utils.data.Dataset):
    """(image, label) samples whose label is valid by data_tools.labels (present, one int64 value,
    a class of the config) and whose image decodes; a failure names the file and the record."""

    def __init__(self, dataset, image_key: str, label_key: str, num_classes: int, transform):
        self.dataset, self.image_key, self.label_key, self.num_classes = dataset, image_key, label_key, num_classes
        self.transform = transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        raw_image, raw_label = self.dataset[index]
        problem = image_problem(raw_image, self.image_key) or label_problem(raw_label, self.label_key, self.num_classes)
        try:
            if problem is not None:
                if problem[0] == "label_range":  # caught here, not as an index error deep in the loss
                    raise DataError(f"label {int(raw_label[0])} is outside 0..{self.num_classes - 1} "
                                    f"(the config has {self.num_classes} classes)")
                raise DataError(problem[1])
            return self.transform(raw_image[0]), int(raw_label[0])
        except DataError as err:
            file, number = self.dataset.locate(int(index))
            raise DataError(f"{file}: record {number}: {err}") from None


class _EpochIndices(torch.utils.data.Sampler):
    """The sampler's indices as (epoch, index): persistent loader workers keep their copy of the
    dataset across epochs, so the epoch that seeds augmentation travels with each index."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        epoch = self.sampler.epoch
        return ((epoch, index) for index in self.sampler)


class _Epoched(torch.utils.data.Dataset):
    """Sample (epoch, index): a SeededAugmentation's transform gets the epoch with the index."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index = key
        if hasattr(self.dataset, "item_at"):  # a task's own samples (segmentation: image and mask)
            return self.dataset.item_at(index, epoch)
        if not isinstance(self.dataset, SeededAugmentation):  # nothing seeded by the epoch
            return self.dataset[index]
        image, label = self.dataset.dataset[index]
        return self.dataset.transform(image, index, epoch), label


def train_loader(cfg, rank: int, world: int, generator: torch.Generator, pin: bool, decode: str = "cpu",
                 device: torch.device | None = None):
    """(DataLoader, ShardedSampler) for this rank's share of the training files; with pin (a GPU)
    the samples are uint8 pixels unless augmented (step.Normalise finishes them on the device).
    decode "gpu" (device_decode.py): the batches are decoded and augmented on `device` as they are drawn.

    The sampler trims each epoch to a multiple of the process count so every rank runs the same
    number of steps (DDP needs that); which up-to-(processes - 1) samples are left out changes
    with the epoch's shuffle.
    """
    dataset = _dataset(cfg, cfg.data.train, augment=cfg.augment.enabled, pixels=pin, decode=decode)
    sampler = ShardedSampler(len(dataset), rank=rank, world_size=world, seed=cfg.run.seed, shuffle=True,
                             drop_last=True)
    finish = _device_decoder(cfg, dataset, device, cfg.augment.enabled)
    return _loader(cfg, _Epoched(dataset), _EpochIndices(sampler), generator, pin, finish), sampler


def val_loader(cfg, rank: int, world: int, generator: torch.Generator, pin: bool, decode: str = "cpu",
               device: torch.device | None = None):
    """Every validation record exactly once across ranks (shares may differ by one; eval sums)."""
    dataset = _dataset(cfg, cfg.data.val, pixels=pin, decode=decode)
    sampler = ShardedSampler(len(dataset), rank=rank, world_size=world, seed=cfg.run.seed, shuffle=False)
    return _loader(cfg, dataset, sampler, generator, pin, _device_decoder(cfg, dataset, device, False))


def _device_decoder(cfg, dataset, device, augment: bool):
    """The training process's half of decode "gpu" (None for the CPU path's datasets)."""
    if not isinstance(dataset, SeededAugmentation) or not isinstance(dataset.transform, device_decode.DeviceParams):
        return None
    records = dataset.dataset.dataset  # SeededAugmentation(CheckedSamples(TFRecordDataset))
    return device_decode.DeviceDecoder(device or torch.device("cpu"), cfg.data.image_size, cfg.data.channels,
                                       dataset.transform.transform if augment else None, records.locate)


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _worker_ignores_stop_signals(worker_id: int) -> None:
    # SIGINT/SIGTERM (Ctrl-C, a scheduler's preemption) reach the whole process group. The
    # training process stops at the next step boundary and saves; a loader worker killed by the
    # same signal first would turn that clean stop into a crash. The worker starts with them
    # blocked (see _Loader), so none can arrive before they are ignored; a pending one is dropped.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class _Loader(torch.utils.data.DataLoader):
    """Starts its worker processes with the stop signals blocked: a signal between a worker's fork
    and its worker_init_fn would kill it (the validation loader starts workers every epoch, so a
    Ctrl-C during evaluation hit that window). The trainer gets a blocked signal on unblocking."""

    _starting = False  # start_workers: an iterator that draws no index from the sampler

    @property
    def _index_sampler(self):
        return () if self._starting else super()._index_sampler

    def __iter__(self):
        if not self.num_workers:
            return super().__iter__()
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _DecodingLoader(_Loader):
    """decode "gpu": each batch the workers collate (device_decode.EncodedBatch) is decoded, resized or
    augmented on the device by `finish` as the training process draws it."""

    def __init__(self, *args, finish, **kwargs):
        super().__init__(*args, collate_fn=device_decode.collate, **kwargs)
        self.finish = finish

    def __iter__(self):
        return map(self.finish, super().__iter__())


THREADS_AT_FORK: list[int] = []  # the training process's thread count each time start_workers forked (tests read it)


def start_workers(loader) -> None:
    """Fork a loader's persistent workers now, with no sample asked for (the sampler is not drawn
    from: the epoch's first iter() resumes these workers). setup.start_processes calls it before the
    process group exists, while the training process has one thread to copy into each child."""
    if loader is None or not loader.num_workers:
        return
    THREADS_AT_FORK.append(len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0)
    loader._starting = True
    try:
        iter(loader)
    finally:
        loader._starting = False
    loader._iterator._index_sampler = loader._index_sampler  # the iterator keeps the one it was made with


def _loader(cfg, dataset, sampler, generator, pin, finish=None):
    """Workers persist across epochs (starting them each epoch cost a third of a short epoch)."""
    workers = cfg.data.num_workers
    kind, extra = (_Loader, {}) if finish is None else (_DecodingLoader, {"finish": finish})
    collate = getattr(getattr(dataset, "dataset", dataset), "collate", None)  # a task's own (detection: boxes)
    if collate is not None and finish is None:
        extra["collate_fn"] = collate
    return kind(
        dataset, batch_size=cfg.train.batch_size, sampler=sampler, num_workers=workers, pin_memory=pin,
        generator=generator, prefetch_factor=4 if workers else None, persistent_workers=workers > 0,
        worker_init_fn=_worker_ignores_stop_signals if workers else None, **extra)
