"""Detection samples: an image and its boxes, augmented together, seeded per (seed, epoch, index).

The geometry (crop, flip, rotation) is TrainTransform.sample_params, drawn once per sample and
applied to the image (as for classification) and to the boxes:
- crop and scale: boxes move with the crop; a box is clipped to it and kept only while at least
  MIN_VISIBLE of its area stays inside (less of a defect is not that defect any more);
- flip: x -> size - x;
- rotation (+/- degrees about the centre, as torchvision's rotate turns the image): the four
  corners are rotated and the box re-fitted to them (their axis-aligned hull). The hull is larger
  than the object for a rotated rectangle, by at most 1 - cos + sin of the angle (about 23 % of
  a side at 15 degrees), so the box still covers the whole object; then clipped to the image and
  kept while MIN_VISIBLE of the re-fitted box is inside.
Colour (HSV) changes the image only. Boxes are normalised to [0, 1] on the output grid, as in
the records, so the evaluation view (the image resized to image_size x image_size, as the edge
device's preprocessing does) leaves them as they are.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import torch

from appliance.core.errors import DataError
from data_tools.augment import AugmentParams, TrainTransform, _as_uint8_tensor
from data_tools.detection import BoxProblem, IMAGE_KEY, read_boxes
from data_tools.image_decode import DEFAULT_MAX_PIXELS, ImageProblem, decode_image
from data_tools.preprocessing import preprocess_image

log = logging.getLogger("data_tools.augment")
MIN_VISIBLE = 0.4  # share of a box's area that must stay inside the crop / image to keep the box


def transform_boxes(boxes: np.ndarray, labels: np.ndarray, params: AugmentParams, size: int,
                    min_visible: float = MIN_VISIBLE) -> tuple[np.ndarray, np.ndarray]:
    """Pixel boxes (N, 4) of the input image through params' geometry: normalised boxes on the
    size x size output, and their labels (boxes mostly cut away are dropped)."""
    b = np.asarray(boxes, np.float64).reshape(-1, 4).copy()
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    b[:, [0, 2]] = (b[:, [0, 2]] - params.left) * size / params.width
    b[:, [1, 3]] = (b[:, [1, 3]] - params.top) * size / params.height
    clipped = b.clip(0, size)
    scaled_area = area * (size / params.width) * (size / params.height)
    keep = _area(clipped) >= min_visible * np.maximum(scaled_area, 1e-12)
    b, labels = clipped[keep], np.asarray(labels)[keep]
    if params.flip:
        b[:, [0, 2]] = size - b[:, [2, 0]]
    if params.angle:
        b = _rotate(b, params.angle, size)
        hull = b.copy()
        b = b.clip(0, size)
        keep = _area(b) >= min_visible * np.maximum(_area(hull), 1e-12)
        b, labels = b[keep], labels[keep]
    return (b / size).astype(np.float32), labels.astype(np.int64)


def _area(b: np.ndarray) -> np.ndarray:
    return np.maximum(b[:, 2] - b[:, 0], 0) * np.maximum(b[:, 3] - b[:, 1], 0)


def _rotate(b: np.ndarray, degrees: float, size: int) -> np.ndarray:
    """The axis-aligned hull of each box's corners turned as torchvision's rotate turns the image
    (counter-clockwise on screen, about the centre)."""
    a = math.radians(degrees)
    cos, sin = math.cos(a), math.sin(a)
    c = size / 2
    xs = b[:, [0, 2, 2, 0]] - c
    ys = b[:, [1, 1, 3, 3]] - c
    rx = xs * cos + ys * sin + c
    ry = -xs * sin + ys * cos + c
    return np.stack([rx.min(1), ry.min(1), rx.max(1), ry.max(1)], 1)


class BoxTrainTransform(TrainTransform):
    """TrainTransform's seeded parameters applied to (image, pixel boxes, labels)."""

    def __init__(self, size=224, *, min_visible: float = MIN_VISIBLE, **kw):
        super().__init__(size, **kw)
        self.min_visible = float(min_visible)

    def __call__(self, image, boxes, labels, index: int, epoch: int | None = None):
        x = _as_uint8_tensor(image)
        params = self.sample_params(x.shape[-2], x.shape[-1], index, epoch)
        if self.debug:
            log.debug("augment seed=%d epoch=%d index=%d %s", self.seed,
                      self.epoch if epoch is None else epoch, index, dataclasses.asdict(params))
        out_boxes, out_labels = transform_boxes(boxes, labels, params, self.size[0], self.min_visible)
        return self.apply(x, params), out_boxes, out_labels


def targets(boxes: np.ndarray, labels: np.ndarray) -> torch.Tensor:
    """(N, 5) float32 rows [label, xmin, ymin, xmax, ymax] (normalised): one sample's target."""
    return torch.from_numpy(np.concatenate([np.asarray(labels, np.float32)[:, None],
                                            np.asarray(boxes, np.float32).reshape(-1, 4)], 1))


def collate(batch):
    """Images stacked; targets padded to the batch's most boxes with label-0 rows: (N, M, 5), M >= 1."""
    images = torch.stack([image for image, _ in batch])
    most = max([1] + [len(t) for _, t in batch])
    padded = torch.zeros(len(batch), most, 5)
    for i, (_, t) in enumerate(batch):
        padded[i, : len(t)] = t
    return images, padded


class DetectionSamples(torch.utils.data.Dataset):
    """(image float CHW, target (n, 5)) samples of Object Detection API records.

    records: a TFRecordDataset giving whole records' features. With a BoxTrainTransform the sample
    is augmented (seeded by its index and epoch); without, it is the evaluation view. Bad boxes
    or an undecodable image are a DataError naming the file and record (the data check
    quarantines such records)."""

    collate = staticmethod(collate)

    def __init__(self, records, *, num_classes: int, preprocessing: dict, transform: BoxTrainTransform | None = None,
                 image_key: str = IMAGE_KEY, max_pixels: int = DEFAULT_MAX_PIXELS):
        self.records, self.num_classes, self.preprocessing = records, int(num_classes), dict(preprocessing)
        self.transform, self.image_key, self.max_pixels = transform, image_key, int(max_pixels)

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
        example = self.records[index]
        try:  # the bounded decoder: a bomb or a lying header is refused as the data check quarantines it
            image = decode_image(bytes(example[self.image_key][0]), self.preprocessing["channel_order"],
                                 self.max_pixels)
        except ImageProblem as err:
            raise self._fail(index, f"{err.check}: {err.detail}") from None
        try:
            boxes, labels = read_boxes(example, self.num_classes)
        except BoxProblem as err:
            raise self._fail(index, err.detail) from None
        if self.transform is not None:
            pixels = boxes * np.array([image.width, image.height, image.width, image.height], np.float32)
            x, boxes, labels = self.transform(image, pixels, labels, int(index), epoch)
            return x, targets(boxes, labels)
        return torch.from_numpy(preprocess_image(image, self.preprocessing)), targets(boxes, labels)
