"""Segmentation samples: an image and its class mask, augmented together, seeded per (seed, epoch, index).

The geometry (crop, flip, rotation) is drawn once per sample by TrainTransform.sample_params and
applied to both: bilinear on the image, nearest on the mask, so a class id is never blended
into a neighbour's. Pixels that rotation brings in from outside the image are the ignore label in
the mask (nothing is known about them). Colour (HSV) changes the image only.

Evaluation (and every later stage) sees the image as data_tools.preprocessing prepares it for
the edge device (bilinear to image_size x image_size), and the mask resized by nearest neighbour
to the same grid.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from appliance.core.errors import DataError
from data_tools.augment import AugmentParams, TrainTransform, _as_uint8_tensor
from data_tools.preprocessing import preprocess_image
from data_tools.image_decode import DEFAULT_MAX_PIXELS, ImageProblem, decode_image, record_problem
from data_tools.segmentation import IGNORE_LABEL, IMAGE_KEY, MASK_KEY, MaskProblem, decode_mask, judge_mask

log = logging.getLogger("data_tools.augment")


class JointTrainTransform(TrainTransform):
    """TrainTransform's seeded parameters applied to (image, mask): `t(image, mask, index)`."""

    def __init__(self, size=224, *, ignore_label: int = IGNORE_LABEL, **kw):
        super().__init__(size, **kw)
        self.ignore_label = int(ignore_label)

    def apply_mask(self, mask, params: AugmentParams) -> torch.Tensor:
        """The geometry of params on a (H, W) class mask: (size, size) int64, nearest, outside = ignore."""
        m = torch.as_tensor(np.asarray(mask)).unsqueeze(0)
        m = F.resized_crop(m, params.top, params.left, params.height, params.width, self.size,
                           interpolation=v2.InterpolationMode.NEAREST)
        if params.flip:
            m = F.horizontal_flip(m)
        m = F.rotate(m, params.angle, interpolation=v2.InterpolationMode.NEAREST, fill=[self.ignore_label])
        return m[0].long()

    def __call__(self, image, mask, index: int, epoch: int | None = None):
        x = _as_uint8_tensor(image)
        if tuple(x.shape[-2:]) != tuple(np.shape(mask)):
            raise ValueError(f"mask is {np.shape(mask)[1]}x{np.shape(mask)[0]}, the image {x.shape[-1]}x{x.shape[-2]}")
        params = self.sample_params(x.shape[-2], x.shape[-1], index, epoch)
        if self.debug:
            log.debug("augment seed=%d epoch=%d index=%d %s", self.seed,
                      self.epoch if epoch is None else epoch, index, dataclasses.asdict(params))
        return self.apply(x, params), self.apply_mask(mask, params)


def eval_mask(mask: np.ndarray, size: int) -> torch.Tensor:
    """A (H, W) class mask on the evaluation grid: size x size, nearest neighbour, int64."""
    if mask.shape != (size, size):
        mask = np.asarray(Image.fromarray(mask).resize((size, size), Image.NEAREST))
    return torch.from_numpy(mask.astype(np.int64))


class SegmentationSamples(torch.utils.data.Dataset):
    """(image float CHW, mask int64 HW) samples from DeepLab-convention records.

    records: a TFRecordDataset giving dicts {image key: bytes, mask key: bytes}. With a
    JointTrainTransform the sample is augmented (seeded by its index; call set_epoch each
    epoch); without, it is the evaluation view. A mask that does not decode, does not fit its
    image or holds a class id outside 0..num_classes-1 (other than the ignore label) is a
    DataError naming the file and record (`appliance data check` quarantines such records).
    """

    def __init__(self, records, *, num_classes: int, preprocessing: dict, transform: JointTrainTransform | None = None,
                 ignore_label: int = IGNORE_LABEL, image_key: str = IMAGE_KEY, mask_key: str = MASK_KEY,
                 max_pixels: int = DEFAULT_MAX_PIXELS):
        self.records, self.num_classes, self.preprocessing = records, int(num_classes), dict(preprocessing)
        self.max_pixels = int(max_pixels)
        self.transform, self.ignore_label = transform, int(ignore_label)
        self.image_key, self.mask_key = image_key, mask_key

    def __len__(self) -> int:
        return len(self.records)

    def set_epoch(self, epoch: int) -> None:
        if self.transform is not None:
            self.transform.set_epoch(epoch)

    def _fail(self, index: int, what: str):
        file, number = self.records.locate(int(index))
        return DataError(f"{file}: record {number}: {what}")

    def __getitem__(self, index: int):
        return self.item_at(index)

    def item_at(self, index: int, epoch: int | None = None):
        """The sample, augmented for `epoch` (None: the one set_epoch set); persistent loader
        workers keep their copy of the dataset, so the training loader passes the epoch here."""
        sample = self.records[index]
        # Both through the bounded decoder (data_tools.image_decode) and the mask judged by
        # judge_mask: what the data check quarantines is refused here in its words.
        try:
            image = decode_image(bytes(sample[self.image_key]), self.preprocessing["channel_order"], self.max_pixels)
        except ImageProblem as err:
            raise self._fail(index, record_problem(err)) from None
        try:
            mask = decode_mask(bytes(sample[self.mask_key]), self.max_pixels)
            judge_mask(mask, image.width, image.height, self.num_classes, self.ignore_label)
        except MaskProblem as err:
            config = f" (the config has {self.num_classes} classes)" if err.check == "mask_label_range" else ""
            raise self._fail(index, f"{err.check}: {err.detail}{config}") from None
        if self.transform is not None:
            return self.transform(image, mask, int(index), epoch)
        x = torch.from_numpy(preprocess_image(image, self.preprocessing))
        return x, eval_mask(mask, int(self.preprocessing["image_size"]))
