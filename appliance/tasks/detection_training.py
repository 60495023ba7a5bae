"""Detection's torch side for training: its samples, model, loss and the validation pass's boxes.

The task object (appliance.tasks.detection, light) reaches this module when training runs.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from appliance.tasks.detection_decode import decode, decoding_spec
from appliance.tasks.detection_metrics import detection_rows
from appliance.tasks.detection_models import DETECTION_STRIDES, FCOSLoss, build_detector
from data_tools.augment_boxes import BoxTrainTransform, DetectionSamples
from data_tools.dataset import TFRecordDataset
from data_tools.detection import IMAGE_KEY, PER_BOX_KEYS
from data_tools.preprocessing import preprocessing_of


def dataset(cfg, files, augment: bool, task) -> DetectionSamples:
    d = cfg.data
    image_key = d.image_key if d.image_key else IMAGE_KEY
    records = TFRecordDataset(files, features={image_key: "raw", **{k: "raw" for k in PER_BOX_KEYS}})
    preprocessing = preprocessing_of({"image_size": d.image_size, "mean": d.mean, "std": d.std,
                                      "channel_order": "RGB" if d.channels == 3 else "L"})
    transform = None
    if augment:
        a = cfg.augment
        transform = BoxTrainTransform(d.image_size, seed=cfg.run.seed, degrees=a.degrees, hue=a.hue,
                                      saturation=a.saturation, value=a.value, scale=tuple(a.crop_scale),
                                      flip_probability=a.flip_probability, mean=d.mean, std=d.std, debug=a.debug)
    return DetectionSamples(records, num_classes=cfg.num_classes, preprocessing=preprocessing, transform=transform,
                            image_key=image_key, max_pixels=d.max_pixels)


def model(architecture: str, num_classes: int, in_channels: int):
    return build_detector(architecture, num_classes, in_channels)


def criterion(architecture: str = "fcos_tiny"):
    return FCOSLoss(DETECTION_STRIDES.get(architecture, 8))


class BoxCollector:
    """The validation pass's decoded boxes and ground truth; rows() gathers every rank's and scores them."""

    def __init__(self, task, architecture: str = "fcos_tiny"):
        self.task, self.stride = task, DETECTION_STRIDES.get(architecture, 8)
        self.truths, self.detections = [], []

    def add(self, raw: torch.Tensor, targets: torch.Tensor) -> None:
        raw = raw.detach().float().cpu().numpy()
        size = int(round(np.sqrt(raw.shape[1]))) * self.stride
        spec = self.task.spec(size, self.stride, raw.shape[2] - 5)
        self.detections += decode(raw, spec)
        for t in targets.cpu().numpy():
            t = t[t[:, 0] > 0]
            self.truths.append((t[:, 1:] * size, t[:, 0].astype(np.int64)))
        self.size, self.num_classes = size, raw.shape[2] - 5

    def rows(self) -> list:
        """COCO rows over every rank's images (a collective)."""
        mine = (self.truths, self.detections)
        every = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        truths = [t for part in every for t in part[0]]
        detections = [d for part in every for d in part[1]]
        if not truths:
            return []
        return detection_rows(truths, detections, self.num_classes, self.size)


def spec_for(task, image_size: int, stride: int, num_classes: int) -> dict:
    return decoding_spec(image_size, stride, num_classes, task.score_threshold, task.iou_threshold,
                         task.max_detections)
