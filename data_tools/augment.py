"""Training and evaluation image transforms with explicit units, seeded per (seed, epoch, index).

Units (what the numbers mean):
- rotation: degrees, uniform in [-degrees, +degrees] (default 15).
- hue: a fraction of the colour circle, shift uniform in [-hue, +hue]; 0.1 = +/-36 degrees.
- saturation, value: multiplicative factors on HSV S and V, uniform in [1-s, 1+s] (default 0.1).
- crop: torchvision's RandomResizedCrop definition (area fraction `scale`, aspect `ratio`).

Why not torchvision's RandomRotation/ColorJitter as they are: their parameters come from the
global torch RNG, so a resumed run (or a different DataLoader worker) applies different
augmentation to the same sample, and ColorJitter's "saturation" blends with grey instead of
scaling HSV S. Here every sample's parameters come from its own generator seeded by
(seed, epoch, index), are returned as `AugmentParams` (so tests and the debug log can measure
them), and the geometric work is done by torchvision.transforms.v2.functional.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

import numpy as np
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

log = logging.getLogger("data_tools.augment")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclasses.dataclass(frozen=True)
class AugmentParams:
    """The random choices applied to one sample (pixels of the decoded input image)."""

    top: int
    left: int
    height: int
    width: int
    flip: bool
    angle: float  # degrees, counter-clockwise
    hue_shift: float  # fraction of the colour circle
    saturation_factor: float
    value_factor: float


def _as_uint8_tensor(image) -> torch.Tensor:
    """PIL image, HWC numpy array or CHW tensor -> CHW uint8 tensor."""
    if isinstance(image, torch.Tensor):
        return image if image.ndim == 3 else image.unsqueeze(0)
    if isinstance(image, np.ndarray):
        arr = image if image.ndim == 3 else image[:, :, None]
        return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))
    return F.pil_to_tensor(image)


def rgb_to_hsv(rgb: torch.Tensor) -> torch.Tensor:
    """[..., 3, H, W] float RGB in [0, 1] -> HSV with H in [0, 1) (fraction of the circle); one image or a batch."""
    r, g, b = rgb.unbind(-3)
    minc, maxc = torch.aminmax(rgb, dim=-3)
    delta = maxc - minc
    s = delta / maxc.clamp_min(1e-12)
    safe = delta.clamp_min(1e-12)
    h = torch.where(maxc == r, (g - b) / safe,
                    torch.where(maxc == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe))
    h = torch.where(delta > 0, (h / 6.0).remainder_(1.0), torch.zeros_like(h))
    return torch.stack((h, s, maxc), dim=-3)


def hsv_to_rgb(hsv: torch.Tensor) -> torch.Tensor:
    # The closed form f(n) = v - v*s*clamp(min(k, 4-k), 0, 1), k = (n + 6h) mod 6, for n = 5, 3, 1
    # gives R, G, B in one broadcast instead of a six-way case split per pixel. The offsets are
    # numbers, not a tensor: on a GPU a constant copied from the host would wait for the device.
    h, s, v = hsv[..., 0:1, :, :], hsv[..., 1:2, :, :], hsv[..., 2:3, :, :]
    h6 = h * 6.0
    k = torch.cat((h6 + 5.0, h6 + 3.0, h6 + 1.0), dim=-3).remainder_(6.0)
    return v - v * s * torch.minimum(k, 4.0 - k).clamp_(0.0, 1.0)


def jitter_hsv(image: torch.Tensor, hue_shift, saturation_factor, value_factor) -> torch.Tensor:
    """Exact HSV jitter on a [..., C, H, W] float image in [0, 1]; one channel images get V scaling only.
    The factors are numbers, or for a batch [N, 1, 1] tensors (one per image)."""
    if image.shape[-3] == 1:
        return (image * value_factor).clamp_(0.0, 1.0)
    hsv = rgb_to_hsv(image)
    hsv[..., 0, :, :] = (hsv[..., 0, :, :] + hue_shift) % 1.0
    hsv[..., 1, :, :] = (hsv[..., 1, :, :] * saturation_factor).clamp_(0.0, 1.0)
    hsv[..., 2, :, :] = (hsv[..., 2, :, :] * value_factor).clamp_(0.0, 1.0)
    return hsv_to_rgb(hsv)


class TrainTransform:
    """Seeded training augmentation: crop, flip, rotate, HSV jitter, normalise.

    Call as `t(image, index)`; the epoch comes from `set_epoch` (the training loop calls it
    each epoch, like a DistributedSampler). Same (seed, epoch, index) -> identical output.
    """

    def __init__(
        self,
        size: int | Sequence[int] = 224,
        *,
        seed: int = 0,
        degrees: float = 15.0,
        hue: float = 0.1,
        saturation: float = 0.1,
        value: float = 0.1,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip_probability: float = 0.5,
        mean: Sequence[float] | None = IMAGENET_MEAN,
        std: Sequence[float] | None = IMAGENET_STD,
        debug: bool = False,
    ):
        if not 0 <= hue <= 0.5:
            raise ValueError(f"hue must be a fraction of the colour circle in [0, 0.5], got {hue}")
        if not 0 <= saturation < 1 or not 0 <= value < 1:
            raise ValueError("saturation and value are +/- fractions of a multiplicative factor, in [0, 1)")
        self.size = [size, size] if isinstance(size, int) else list(size)
        self.seed, self.epoch = int(seed), 0
        self.degrees, self.hue, self.saturation, self.value = float(degrees), float(hue), float(saturation), float(value)
        self.scale, self.ratio, self.flip_probability = scale, ratio, flip_probability
        self.mean, self.std = mean, std
        self.debug = debug

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def sample_params(self, height: int, width: int, index: int, epoch: int | None = None) -> AugmentParams:
        """The parameters for sample `index` of an image of height x width, from its own generator."""
        epoch = self.epoch if epoch is None else epoch
        rng = np.random.default_rng([self.seed, epoch, index])
        top, left, h, w = self._crop_box(rng, height, width)
        return AugmentParams(
            top=top, left=left, height=h, width=w,
            flip=bool(rng.random() < self.flip_probability),
            angle=float(rng.uniform(-self.degrees, self.degrees)),
            hue_shift=float(rng.uniform(-self.hue, self.hue)),
            saturation_factor=float(rng.uniform(1 - self.saturation, 1 + self.saturation)),
            value_factor=float(rng.uniform(1 - self.value, 1 + self.value)),
        )

    def _crop_box(self, rng: np.random.Generator, height: int, width: int) -> tuple[int, int, int, int]:
        # The same rule as torchvision's RandomResizedCrop.make_params, drawn from our generator.
        area = height * width
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
        in_ratio = width / height
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h, w = height, int(round(height * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def apply(self, image, params: AugmentParams, normalize: bool = True) -> torch.Tensor:
        """Apply given parameters: CHW float32 tensor out (normalised unless normalize=False)."""
        x = _as_uint8_tensor(image)
        x = F.resized_crop(x, params.top, params.left, params.height, params.width, self.size, antialias=True)
        if params.flip:
            x = F.horizontal_flip(x)
        x = F.rotate(x, params.angle, interpolation=v2.InterpolationMode.BILINEAR)
        x = jitter_hsv(x.float().div_(255.0), params.hue_shift, params.saturation_factor, params.value_factor)
        if normalize and self.mean is not None:
            x = F.normalize(x, _per_channel(self.mean, x.shape[0]), _per_channel(self.std, x.shape[0]))
        return x

    def __call__(self, image, index: int, epoch: int | None = None) -> torch.Tensor:
        x = _as_uint8_tensor(image)
        params = self.sample_params(x.shape[-2], x.shape[-1], index, epoch)
        if self.debug:
            log.debug("augment seed=%d epoch=%d index=%d %s", self.seed,
                      self.epoch if epoch is None else epoch, index, dataclasses.asdict(params))
        return self.apply(x, params)


class EvalTransform:
    """Deterministic evaluation transform: resize the short side, centre crop, normalise."""

    def __init__(self, size: int | Sequence[int] = 224, *, resize: int | None = None,
                 mean: Sequence[float] | None = IMAGENET_MEAN, std: Sequence[float] | None = IMAGENET_STD):
        self.size = [size, size] if isinstance(size, int) else list(size)
        self.resize = resize if resize is not None else int(round(max(self.size) / 0.875))
        self.mean, self.std = mean, std

    def __call__(self, image, index: int | None = None, epoch: int | None = None) -> torch.Tensor:
        x = _as_uint8_tensor(image)
        x = F.resize(x, [self.resize], antialias=True)
        x = F.center_crop(x, self.size).float().div_(255.0)
        if self.mean is not None:
            x = F.normalize(x, _per_channel(self.mean, x.shape[0]), _per_channel(self.std, x.shape[0]))
        return x


def _per_channel(values: Sequence[float], channels: int) -> list[float]:
    values = list(values)
    if channels == len(values):
        return values
    return [float(np.mean(values))] * channels  # a grey image gets the mean of the RGB statistics


class SeededAugmentation(torch.utils.data.Dataset):
    """Wrap an (image, label) dataset so sample `index` gets transform(image, index).

    TFRecordDataset hands its transform the image only; the index is what seeds a sample's
    augmentation, so it is applied here. Call set_epoch each epoch before iterating; with
    persistent DataLoader workers the workers keep the epoch they started with, so keep
    persistent_workers=False (the default) or recreate the loader per epoch.
    """

    def __init__(self, dataset, transform):
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.transform, "set_epoch"):
            self.transform.set_epoch(epoch)

    def __getitem__(self, index: int):
        image, label = self.dataset[index]
        return self.transform(image, index), label
