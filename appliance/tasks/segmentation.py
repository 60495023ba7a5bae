"""Semantic segmentation: a class per pixel, DeepLab-convention records, per-pixel cross-entropy
with the ignore label, mIoU / per-class IoU / pixel accuracy, and the most-common-class gate.

A record becomes a sample in data_tools.augment_masks.SegmentationSamples: the image and its
mask, augmented together (same geometry, nearest for the mask) when training, and on the
preprocessing grid of the edge device when evaluating.
"""

from __future__ import annotations

from appliance.tasks.backbone_keys import backbone_state
from appliance.tasks.deploy_metrics import argmax_agreement, miou_of_maps
from appliance.tasks.segmentation_figures import iou_figures, segmentation_quality
from data_tools.segmentation import IGNORE_LABEL, IMAGE_KEY, MASK_KEY

# The names segmentation_models builds; listed here so reading a config does not import torch.
SEGMENTATION_ARCHITECTURES = ("unet_small", "lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large",
                              "deeplabv3_resnet50", "fcn_resnet50")


class Segmentation:
    kind = "segmentation"
    architectures = SEGMENTATION_ARCHITECTURES
    val_metric = "val_miou"  # the validation figure metrics.jsonl records that `appliance tune` maximizes by default

    def __init__(self, ignore_label: int = IGNORE_LABEL, class_weights: tuple[float, ...] = ()):
        self.ignore_label, self.class_weights = int(ignore_label), tuple(class_weights)

    def build_model(self, architecture: str, num_classes: int, in_channels: int = 3, onnx_graph=None):
        # late: the module defines torch modules, and configs are read where torch is not wanted.
        from appliance.tasks.segmentation_models import build_segmentation_model

        return build_segmentation_model(architecture, num_classes, in_channels)

    def dataset(self, cfg, files, augment: bool = False):
        """(image, mask) samples of files; augmented by [augment] when augment is set."""
        # late: torch (the joint augmentation); configs are read without it
        from data_tools.augment_masks import JointTrainTransform, SegmentationSamples
        from data_tools.dataset import TFRecordDataset  # late: torch; configs are read without it
        from data_tools.preprocessing import preprocessing_of  # late: numpy; configs are read without it

        d = cfg.data
        image_key = d.image_key if d.image_key else IMAGE_KEY
        records = TFRecordDataset(files, features={image_key: "bytes", MASK_KEY: "bytes"})
        preprocessing = preprocessing_of({"image_size": d.image_size, "mean": d.mean, "std": d.std,
                                          "channel_order": "RGB" if d.channels == 3 else "L"})
        transform = None
        if augment:
            a = cfg.augment
            transform = JointTrainTransform(d.image_size, seed=cfg.run.seed, degrees=a.degrees, hue=a.hue,
                                            saturation=a.saturation, value=a.value, scale=tuple(a.crop_scale),
                                            flip_probability=a.flip_probability, mean=d.mean, std=d.std,
                                            debug=a.debug, ignore_label=self.ignore_label)
        return SegmentationSamples(records, num_classes=cfg.num_classes, preprocessing=preprocessing,
                                   transform=transform, ignore_label=self.ignore_label, image_key=image_key,
                                   max_pixels=d.max_pixels)

    def init_state(self, state: dict, own_keys, architecture: str) -> tuple[dict, dict | None]:
        """[model] init's tensors for this model: a classification backbone's keys renamed onto it."""
        return backbone_state(state, own_keys, architecture)

    def head_prefix(self, model, architecture: str) -> str:
        """The part fine-tuning starts fresh when the weights' classes differ (or have no head)."""
        return "head" if architecture == "unet_small" else "net.classifier"

    def check_options(self, num_classes: int, names=()) -> dict:
        """The data check's mask range: the config's classes (a stray id is out of range, not inferred in),
        and their names for the report."""
        if not num_classes:
            return {}
        return {"num_classes": num_classes, "ignore_label": self.ignore_label,
                **({"class_names": list(names)} if names else {})}

    def criterion(self):
        import torch
        from torch import nn

        weight = torch.tensor(self.class_weights, dtype=torch.float32) if self.class_weights else None
        return nn.CrossEntropyLoss(weight=weight, ignore_index=self.ignore_label)

    def eval_counts(self, logits, labels, num_classes: int):
        """(loss sum, correct pixels, labelled pixels, true*K + predicted per labelled pixel) of a batch."""
        from torch import nn

        valid = labels != self.ignore_label
        predicted = logits.argmax(1)
        loss = nn.functional.cross_entropy(logits.float(), labels, ignore_index=self.ignore_label, reduction="sum")
        return loss, ((predicted == labels) & valid).sum(), valid.sum(), (labels * num_classes + predicted)[valid]

    def val_figures(self, confusion, names=()) -> dict:
        f = iou_figures(confusion, names)
        return {"val_miou": f["miou"], "val_pixel_acc": f["pixel_acc"], "val_iou": f["iou"],
                "val_recall": f["recall"]}

    def quality(self, confusion, names, thresholds) -> dict:
        return segmentation_quality(confusion, names, thresholds)

    def card_extra(self) -> dict:
        return {"task": {"kind": self.kind, "ignore_label": self.ignore_label}}

    # ---- deploy: the metric the quantize gate, sensitivity and verify count ----
    metric, metric_label = "miou", "mIoU"
    compare_schemes = True  # quantize measures symmetric and asymmetric activations side by side
    agreement = staticmethod(argmax_agreement)  # per pixel on (N, K, H, W)
    agreement_label = "pixel agreement"
    # Host vs build/device: a pixel on a near tie may flip within the logit tolerance; 0.5 % may.
    min_agreement = 0.995
    postprocess = "argmax over the K logits of each pixel: one class map per image, written as an 8-bit PNG"

    def score(self, logits, masks) -> float:
        """mIoU of (N, K, H, W) logits against (N, H, W) masks."""
        return self.figures(logits.argmax(1), masks, logits.shape[1])["miou"]

    def figures(self, class_maps, masks, num_classes: int) -> dict:
        return miou_of_maps(class_maps, masks, num_classes, self.ignore_label)

    # ---- the pipeline summary: each stage's figures under this task's names ----
    agreement_key = "pixel_agreement"  # what verify and the compile check call host-vs-build agreement

    # Each takes the stage's figures (its result's figures()) and returns what the summary shows.

    def train_figures(self, val_acc, confusion, names=()) -> dict:
        """The train stage's validation figures: mIoU and pixel accuracy (the loop's val_acc counts pixels)."""
        if confusion is None:
            return {"val_pixel_acc": val_acc}
        f = iou_figures(confusion, names)
        return {"val_miou": f["miou"], "val_pixel_acc": f["pixel_acc"]}

    def train_summary(self, figures: dict) -> dict:
        if "val_miou" not in figures:
            return {}
        return {"train_val_miou": figures["val_miou"], "train_val_pixel_acc": figures["val_pixel_acc"]}

    def gate_summary(self, figures: dict) -> dict:
        if "val_miou" not in figures:
            return {}
        return {"val_most_common_class_baseline_miou": figures["baseline_miou"],
                "quality_gate_required_miou": figures["required_miou"]}

    def export_summary(self, figures: dict) -> dict:
        """The ONNX model's class maps against PyTorch's, per pixel (its mIoU: the quantize stage's fp32_miou)."""
        if "parity.top1_agreement" not in figures:
            return {}
        return {"export_pixel_agreement_with_pytorch": figures["parity.top1_agreement"]}
