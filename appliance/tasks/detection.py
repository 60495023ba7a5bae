"""Object detection: boxes and their classes per image, Object Detection API records, FCOS's loss,
COCO mAP@[.5:.95] / mAP@.5 / per-class AP, and the box-prior gate.

The network ends at raw head outputs (appliance.tasks.detection_models); decoding, score
threshold, per-class NMS and top-k are appliance.tasks.detection_decode, their constants in the
model card. A record becomes a sample in data_tools.augment_boxes.DetectionSamples (the image
and its boxes augmented together when training). Light on imports: the torch side
(detection_training) and the numpy side (detection_metrics) are imported when training or
judging runs.
"""

from __future__ import annotations

import importlib

TRAINING = "appliance.tasks.detection_training"  # torch: samples, model, loss, the validation's boxes
FIGURES = "appliance.tasks.detection_metrics"  # numpy + faster-coco-eval: mAP and the gate
DECODING = "appliance.tasks.detection_decode"  # numpy: raw outputs -> boxes, the host's implementation
DETECTION_ARCHITECTURES = ("fcos_tiny",)


def _side(name: str):
    return importlib.import_module(name)


class Detection:
    kind = "detection"
    architectures = DETECTION_ARCHITECTURES
    stride = 8  # fcos_tiny's one level
    val_metric = "val_map50"  # the validation figure metrics.jsonl records that `appliance tune` maximizes by default

    def __init__(self, score_threshold: float = 0.05, iou_threshold: float = 0.5, max_detections: int = 100):
        self.score_threshold, self.iou_threshold = float(score_threshold), float(iou_threshold)
        self.max_detections = int(max_detections)

    def build_model(self, architecture: str, num_classes: int, in_channels: int = 3, onnx_graph=None):
        return _side(TRAINING).model(architecture, num_classes, in_channels)

    def dataset(self, cfg, files, augment: bool = False):
        """(image, target rows [label, xmin, ymin, xmax, ymax]) samples; augmented by [augment] when augment is set."""
        return _side(TRAINING).dataset(cfg, files, augment, self)

    def init_state(self, state: dict, own_keys, architecture: str) -> tuple[dict, dict | None]:
        return state, None  # [model] init's keys (a detection checkpoint's) are matched by name

    def head_prefix(self, model, architecture: str) -> str:
        return "cls_logits"  # fine-tuning onto other classes starts the class logits fresh

    def check_options(self, num_classes: int, names=()) -> dict:
        """The data check's label map: the config's classes (labels 1..K)."""
        return {"num_classes": num_classes} if num_classes else {}

    def criterion(self):
        return _side(TRAINING).criterion()

    def eval_counts(self, raw, targets, num_classes: int):
        """(loss sum, 0, images, no pairs): the boxes themselves go to val_collector()."""
        import torch  # late: the task is read where torch is not wanted

        loss = self.criterion()(raw, targets) * targets.shape[0]
        return loss, 0, targets.shape[0], torch.zeros(0, dtype=torch.int64)

    def val_collector(self):
        return _side(TRAINING).BoxCollector(self)

    def spec(self, image_size: int, stride: int, num_classes: int) -> dict:
        """The decoding constants (the model card's "detection" block)."""
        return _side(TRAINING).spec_for(self, image_size, stride, num_classes)

    def val_figures(self, rows, names=()) -> dict:
        f = _side(FIGURES).map_figures(rows, names)
        return {"val_map": f["map"], "val_map50": f["map50"], "val_ap": f["ap"], "val_ap50": f["ap50"]}

    def quality(self, rows, names, thresholds) -> dict:
        return _side(FIGURES).detection_quality(rows, names, thresholds)

    def card_extra(self) -> dict:
        return {"task": {"kind": self.kind, "score_threshold": self.score_threshold,
                         "iou_threshold": self.iou_threshold, "max_detections": self.max_detections,
                         "stride": self.stride}}

    # ---- deploy: the metric the quantize gate and verify count ----
    metric, metric_label = "map50", "mAP@.5"
    compare_schemes = False  # quantize measures the asked --scheme only

    def constants(self) -> dict:
        return {"score_threshold": self.score_threshold, "iou_threshold": self.iou_threshold,
                "max_detections": self.max_detections}

    def agreement(self, a, b) -> float:
        """Share of boxes two runtimes agree on (decoded; same class, IoU >= 0.9)."""
        return _side(DECODING).box_agreement(a, b, self.stride, self.constants())

    def score(self, raw, targets) -> float:
        """mAP@.5 of raw [N, P, 5 + K] outputs against padded targets [N, M, 5] (label 0: padding)."""
        return self.figures(raw, targets)["map50"]

    def figures(self, raw, targets) -> dict:
        decoding, figures = _side(DECODING), _side(FIGURES)
        spec = decoding.spec_of_raw(raw, self.stride, self.constants())
        size, k = spec["image_size"], spec["num_classes"]
        truths = [(t[t[:, 0] > 0][:, 1:] * size, t[t[:, 0] > 0][:, 0].astype("int64")) for t in targets]
        f = figures.map_figures(figures.detection_rows(truths, decoding.decode(raw, spec), k, size))
        return {"map50": f["map50"], "map": f["map"], "ap50": list(f["ap50"].values())}
    agreement_label = "boxes matched (same class, IoU >= 0.9)"
    agreement_key = "box_agreement"
    min_agreement = 0.99
    postprocess = "decode + score threshold + per-class NMS + top-k, as the model card's detection block says"

    # ---- the pipeline summary: each stage's figures under this task's names ----
    # Each takes the stage's figures (its result's figures()) and returns what the summary shows.

    def train_figures(self, val_acc, confusion, names=()) -> dict:
        """The train stage's validation figures: mAP@.5 and mAP@[.5:.95] of the last evaluation's box rows."""
        if not confusion:
            return {}
        f = _side(FIGURES).map_figures(confusion, names)
        return {"val_map50": f["map50"], "val_map": f["map"]}

    def train_summary(self, figures: dict) -> dict:
        if "val_map50" not in figures:
            return {}
        return {"train_val_map50": figures["val_map50"], "train_val_map": figures["val_map"]}

    def gate_summary(self, figures: dict) -> dict:
        if "val_map50" not in figures:
            return {}
        return {"val_box_prior_baseline_map50": figures["baseline_map50"],
                "quality_gate_required_map50": figures["required_map50"]}

    def export_summary(self, figures: dict) -> dict:
        return {}  # the exported model's mAP is the quantize stage's fp32_map50
