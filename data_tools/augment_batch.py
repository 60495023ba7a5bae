"""The seeded training augmentation of a whole batch, as tensor ops where the images lie.

`TrainTransform.apply` augments one image; `augment_batch` applies the same `AugmentParams`
(drawn by `TrainTransform.sample_params` from the same (seed, epoch, index)) to a batch of decoded
uint8 images on any device: a GPU after nvJPEG (appliance/train/device_decode.py), or CPU tensors in
tests. The crop and resize run per image (each has its own box and source size, with torchvision's
`resized_crop`, as `apply` does); flip, rotation, HSV jitter and normalisation then run once for the
batch: the rotation builds the affine grid of torchvision's `rotate` for each image's angle and
samples all images in one `grid_sample`, rounding to whole pixel values as `rotate` does on uint8.

Every per-image number travels to the device in one small tensor (pinned, non-blocking on a GPU) and
no constant is copied from the host per batch, so augmenting a batch does not wait for the device.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.nn.functional import grid_sample
from torchvision.transforms.functional import _get_inverse_affine_matrix
from torchvision.transforms.v2 import functional as F

from data_tools.augment import AugmentParams, TrainTransform, _per_channel, jitter_hsv

# Columns of the per-image parameter table: flip, the rotation's grid matrix (3x2), hue, saturation, value.
FLIP, THETA, HUE, SATURATION, VALUE = 0, slice(1, 7), 7, 8, 9


def parameter_table(params: Sequence[AugmentParams], size: Sequence[int], device: torch.device) -> torch.Tensor:
    """[N, 10] float32 on the device: what each image's augmentation needs after its crop. The rotation's
    matrix is torchvision's (rotate: the inverse of a rotation by -angle about the centre), transposed and
    scaled by the output size as its _affine_grid does, in float32 here on the host: the same numbers."""
    h, w = size
    matrices = [_get_inverse_affine_matrix([0.0, 0.0], -(p.angle % 360), [0.0, 0.0], 1.0, [0.0, 0.0]) for p in params]
    theta = torch.tensor(matrices, dtype=torch.float32).reshape(-1, 2, 3)
    grid_matrix = theta.transpose(1, 2).div_(torch.tensor([0.5 * w, 0.5 * h], dtype=torch.float32))  # [N, 3, 2]
    others = torch.tensor([[float(p.flip), p.hue_shift, p.saturation_factor, p.value_factor] for p in params],
                          dtype=torch.float32).reshape(-1, 4)
    table = torch.cat((others[:, :1], grid_matrix.reshape(-1, 6), others[:, 1:]), dim=1)
    if device.type == "cuda":  # pinned and non-blocking: the host does not wait for the device
        return table.pin_memory().to(device, non_blocking=True)
    return table


def rotate_batch(images: torch.Tensor, grid_matrix: torch.Tensor) -> torch.Tensor:
    """uint8-valued float [N, C, H, W], each rotated by its grid matrix [N, 3, 2] (parameter_table): the
    grid of torchvision's _affine_grid (output pixel centres), bilinear, zeros outside, rounded as
    rotate rounds uint8 images."""
    n, _, h, w = images.shape
    device = images.device
    base = torch.empty(1, h, w, 3, dtype=torch.float32, device=device)
    base[..., 0].copy_(torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=device))
    base[..., 1].copy_(torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=device).unsqueeze_(-1))
    base[..., 2].fill_(1)
    grid = base.view(1, h * w, 3).expand(n, -1, -1).bmm(grid_matrix).view(n, h, w, 2)
    return grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False).round_()


def normalisation(transform: TrainTransform, channels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The transform's mean and std as [1, C, 1, 1] tensors on the device (make them once: each copy to a
    GPU from a Python list waits for the device)."""
    mean = torch.tensor(_per_channel(transform.mean, channels), dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(_per_channel(transform.std, channels), dtype=torch.float32).view(1, -1, 1, 1)
    return mean.to(device), std.to(device)


def augment_batch(transform: TrainTransform, images: Sequence[torch.Tensor], params: Sequence[AugmentParams],
                  normalize: bool = True, stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """uint8 [C, H, W] images (sizes may differ) and their parameters -> float32 [N, C, size, size]
    on the images' device, normalised with the transform's mean/std (`stats`: normalisation()'s tensors,
    made once by the caller) unless normalize=False."""
    crops = [F.resized_crop(image, p.top, p.left, p.height, p.width, transform.size, antialias=True)
             for image, p in zip(images, params)]
    x = torch.stack(crops)
    table = parameter_table(params, transform.size, x.device)
    flip = table[:, FLIP].view(-1, 1, 1, 1) > 0.5
    x = torch.where(flip, x.flip(-1), x).float()
    if transform.degrees > 0:  # at 0 rotate returns the image itself (its fast path); so do we
        x = rotate_batch(x, table[:, THETA].reshape(-1, 3, 2))
    x = x.div_(255.0)
    column = (-1, 1, 1) if x.shape[1] == 3 else (-1, 1, 1, 1)  # jitter_hsv's per-channel planes, or the one plane
    x = jitter_hsv(x, table[:, HUE].view(column), table[:, SATURATION].view(column), table[:, VALUE].view(column))
    if normalize and transform.mean is not None:
        mean, std = stats if stats is not None else normalisation(transform, x.shape[1], x.device)
        x = x.sub_(mean).div_(std)  # torchvision's normalize: (x - mean) / std in place
    return x
