"""[data] decode = "gpu": JPEGs decoded in batches on the device, augmented and normalised there.

The loader's workers still read and check every record (data_tools.dataset's TFRecord reader: the
CRCs, the label by data_tools.labels, the JPEG's header) but hand over the ENCODED bytes, with the
sample's seeded augmentation parameters drawn exactly as the CPU path draws them
(TrainTransform.sample_params from (seed, epoch, index) and the image's size from its header). The
training process decodes the batch with `torchvision.io.decode_jpeg(list, device=...)` (nvJPEG on a
GPU), then resizes (or crops and augments: data_tools.augment_batch) as tensor ops on the device.
Another format (PNG, a CMYK JPEG) is decoded by the worker, as on the CPU path, and joins the batch as
pixels. The sampler, its order and its resume are the CPU path's: only where the pixels are made moves.

On a device that is not CUDA the same tensor path runs on the CPU (the training process decodes and
augments, the workers only read): `decode = "gpu"` on a CPU-only machine is that documented fallback,
slower than the CPU path, and what the tests run. `auto` picks "gpu" only on CUDA where a probe JPEG
decodes on the device.
"""

from __future__ import annotations

import dataclasses
import functools
import io

import torch
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as F

from appliance.core.errors import DataError
from data_tools.image_decode import DEFAULT_MAX_PIXELS, ImageProblem, open_image, record_problem
from data_tools.augment import AugmentParams, TrainTransform, _as_uint8_tensor, log  # log: [augment] debug's
from data_tools.augment_batch import augment_batch, normalisation

JPEG_MAGIC = b"\xff\xd8\xff"
DEVICE_MODES = ("RGB", "L")  # PIL's modes of JPEGs that decode_jpeg decodes as PIL does (CMYK goes the CPU way)


def decode_mode(setting: str, device: torch.device) -> str:
    """The decode a run uses: "cpu" or "gpu" (the tensor path, on the CPU when the device is not CUDA)."""
    if setting == "auto":
        return "gpu" if device.type == "cuda" and device_decode_works(device) else "cpu"
    return setting


@functools.cache
def device_decode_works(device: torch.device) -> bool:
    """Whether torchvision decodes a JPEG on the device (a build without nvJPEG raises)."""
    from PIL import Image  # late: Pillow only where a run probes its GPU

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 90)).save(buf, format="JPEG")
    try:
        decoded = decode_jpeg([torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)],
                              mode=ImageReadMode.RGB, device=device)
        return tuple(decoded[0].shape) == (3, 16, 16)
    except Exception:  # noqa: BLE001 - RuntimeError, NotImplementedError: any failure means "use the CPU"
        return False


@dataclasses.dataclass
class Encoded:
    """One sample as a worker hands it over: a JPEG's bytes, or the pixels of another format."""

    data: bytes | torch.Tensor  # bytes: a JPEG; a uint8 [C, H, W] tensor: decoded by the worker
    height: int
    width: int
    index: int = -1
    params: AugmentParams | None = None


def encode_for_device(encoded: bytes, fallback, max_pixels: int = DEFAULT_MAX_PIXELS) -> Encoded:
    """Worker side: a JPEG whose header PIL reads in a mode the device decodes stays encoded; anything
    else is decoded by `fallback` (the CPU path's decode for this dataset) into uint8 pixels. The header
    is judged by the bounded decoder (data_tools.image_decode): a size past the limit never reaches nvJPEG."""
    if encoded[:3] == JPEG_MAGIC:
        try:
            header = open_image(encoded, max_pixels)  # reads the header, decodes nothing
            mode, (width, height) = header.mode, header.size
        except ImageProblem as err:
            raise DataError(record_problem(err)) from None
        if mode in DEVICE_MODES:
            return Encoded(encoded, height, width)
    pixels = _as_uint8_tensor(fallback(encoded))
    return Encoded(pixels, pixels.shape[-2], pixels.shape[-1])


class DeviceParams:
    """The SeededAugmentation transform of the gpu decode: an Encoded sample gets its index and, when
    augmenting, the parameters the CPU path would apply (drawn from (seed, epoch, index))."""

    def __init__(self, transform: TrainTransform | None):
        self.transform = transform

    def set_epoch(self, epoch: int) -> None:
        if self.transform is not None:
            self.transform.set_epoch(epoch)

    def __call__(self, sample: Encoded, index: int, epoch: int | None = None) -> Encoded:
        sample.index = int(index)
        if self.transform is not None:
            sample.params = self.transform.sample_params(sample.height, sample.width, index, epoch)
            if self.transform.debug:  # the CPU path's debug line (data_tools.augment), word for word
                log.debug("augment seed=%d epoch=%d index=%d %s", self.transform.seed,
                          self.transform.epoch if epoch is None else epoch, index, dataclasses.asdict(sample.params))
        return sample


class EncodedBatch:
    """A batch as the workers collate it: every JPEG's bytes in one uint8 tensor (one shared-memory
    block per batch, not one per image), the other samples' pixels, indices and parameters."""

    def __init__(self, samples: list[Encoded]):
        jpegs = [s.data for s in samples if isinstance(s.data, bytes)]
        self.data = torch.frombuffer(bytearray(b"".join(jpegs)), dtype=torch.uint8) if jpegs else None
        self.spans, self.pixels, start = [], [], 0
        for s in samples:
            if isinstance(s.data, bytes):
                self.spans.append((start, start + len(s.data)))
                self.pixels.append(None)
                start += len(s.data)
            else:
                self.spans.append(None)
                self.pixels.append(s.data)
        self.indices = [s.index for s in samples]
        self.params = [s.params for s in samples]

    def pin_memory(self) -> EncodedBatch:
        """The DataLoader's pinning thread: the pixels cross to the GPU without a wait."""
        self.pixels = [p if p is None else p.pin_memory() for p in self.pixels]
        return self

    def __len__(self) -> int:
        return len(self.spans)


def collate(samples) -> tuple[EncodedBatch, torch.Tensor]:
    return EncodedBatch([image for image, _ in samples]), torch.tensor([label for _, label in samples])


def pillow_grey(image: torch.Tensor) -> torch.Tensor:
    """uint8 [1 or 3, H, W] -> [1, H, W] as Pillow's convert("L") makes it from RGB (Convert.c's L24:
    (R * 19595 + G * 38470 + B * 7471 + 0x8000) >> 16), on the image's device."""
    if image.shape[0] == 1:
        return image
    r, g, b = image.to(torch.int32)
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).to(torch.uint8).unsqueeze(0)


class DeviceDecoder:
    """Training-process side: (EncodedBatch, labels) -> (images on the device, labels). Images are
    float32 normalised when augmenting, else uint8 [N, C, size, size] (step.Normalise finishes them)."""

    def __init__(self, device: torch.device, image_size: int, channels: int, transform: TrainTransform | None,
                 locate):
        self.device, self.size, self.transform, self.locate = device, [image_size, image_size], transform, locate
        # One channel: decoded as stored, then a colour JPEG made grey with Pillow's own arithmetic
        # (libjpeg's GRAY output is the luma plane before the colour conversion: up to 9 levels apart).
        self.mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.UNCHANGED
        self.stats = None if transform is None or transform.mean is None else normalisation(transform, channels, device)

    def __call__(self, batch):
        encoded, labels = batch
        images = self.decode(encoded)
        if self.transform is not None:
            return augment_batch(self.transform, images, encoded.params, stats=self.stats), labels
        if len({tuple(image.shape) for image in images}) == 1:  # one size (a resized data set): one resize call
            batch = torch.stack(images)
            return (batch if list(batch.shape[-2:]) == self.size else F.resize(batch, self.size, antialias=True)), labels
        resized = [image if list(image.shape[-2:]) == self.size else F.resize(image, self.size, antialias=True)
                   for image in images]
        return torch.stack(resized), labels

    def decode(self, batch: EncodedBatch) -> list[torch.Tensor]:
        """Each sample's uint8 [C, H, W] pixels on the device: the JPEGs decoded in one call."""
        jpegs = [batch.data[a:b] for a, b in filter(None, batch.spans)]
        try:
            decoded = decode_jpeg(jpegs, mode=self.mode, device=self.device) if jpegs else []
        except RuntimeError:
            decoded = self._one_by_one(batch)
        decoded = iter(decoded if self.mode == ImageReadMode.RGB else [pillow_grey(image) for image in decoded])
        return [next(decoded) if pixels is None else pixels.to(self.device, non_blocking=True)
                for pixels in batch.pixels]

    def _one_by_one(self, batch: EncodedBatch) -> list[torch.Tensor]:
        """A batch the device refused, one JPEG at a time: one the device cannot decode (a variant its
        decoder lacks) is decoded on the CPU instead; one the CPU cannot decode either stops the run with
        one line naming its file and record."""
        images = []
        for span, index in zip(batch.spans, batch.indices):
            if span is None:
                continue
            data = batch.data[span[0]:span[1]]
            try:
                images.append(decode_jpeg(data, mode=self.mode, device=self.device))
                continue
            except RuntimeError:
                pass
            try:
                images.append(decode_jpeg(data, mode=self.mode, device="cpu").to(self.device))
            except RuntimeError as err:
                file, number = self.locate(index)
                # torchvision's message is "decode_jpeg, <source file:line>, <what is wrong>"
                what = (str(err).strip().splitlines() or [type(err).__name__])[0].split(", ")[-1]
                raise DataError(f"{file}: record {number}: undecodable JPEG ({what})") from None
        return images
