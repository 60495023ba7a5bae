"""Image classification: one label per image, top-1 and per-class precision/recall, the majority-class gate.

Its samples are made where they always were (appliance/train/data.py: decode, resize or the
seeded augmentation); this object only answers the questions the training loop and the gate ask,
with exactly the arithmetic they used before tasks existed, so its outputs are unchanged.
"""

from __future__ import annotations

from appliance.models import ARCHITECTURES, build_model, classifier_head
from appliance.tasks.classification_figures import per_class, quality_figures
from appliance.tasks.deploy_metrics import argmax_agreement, top1


class Classification:
    kind = "classification"
    architectures = ARCHITECTURES
    val_metric = "val_acc"  # the validation figure metrics.jsonl records that `appliance tune` maximizes by default

    def build_model(self, architecture: str, num_classes: int, in_channels: int = 3, onnx_graph=None):
        return build_model(architecture, num_classes, in_channels, onnx_graph=onnx_graph)

    def dataset(self, cfg, files, augment: bool = False):
        return None  # the training data module's own (image, label) dataset

    def init_state(self, state: dict, own_keys, architecture: str) -> tuple[dict, dict | None]:
        return state, None  # [model] init's keys are matched by name as they are

    def head_prefix(self, model, architecture: str) -> str:
        return classifier_head(model)

    def check_options(self, num_classes: int, names=()) -> dict:
        """The data check's label range: the config's classes (a stray label is out of range, as training
        refuses it, not inferred into a class of its own)."""
        return {"num_classes": num_classes} if num_classes else {}

    def criterion(self):
        from torch import nn

        return nn.CrossEntropyLoss()

    def eval_counts(self, logits, labels, num_classes: int):
        """(loss sum, correct, counted, flat true*K + predicted pairs) of one validation batch."""
        from torch import nn

        predicted = logits.argmax(1)
        return (nn.functional.cross_entropy(logits.float(), labels, reduction="sum"),
                (predicted == labels).sum(), labels.numel(), labels * num_classes + predicted)

    def val_figures(self, confusion, names=()) -> dict:
        classes = per_class(confusion, names)
        return {"val_precision": classes["precision"], "val_recall": classes["recall"]}

    def quality(self, confusion, names, thresholds) -> dict:
        return quality_figures(confusion, names, thresholds)

    def card_extra(self) -> dict:
        return {}

    # ---- deploy: the metric the quantize gate, sensitivity and verify count ----
    metric, metric_label = "top1", "top-1"
    compare_schemes = False  # quantize measures the asked --scheme only
    agreement = staticmethod(argmax_agreement)
    agreement_label = "top-1 agreement"
    min_agreement = 1.0  # `edge verify`'s default: every sample's top-1 as on the host

    def score(self, logits, labels) -> float:
        """Top-1 of (N, K) logits against (N,) labels."""
        return top1(logits, labels)

    # ---- the pipeline summary: each stage's figures under this task's names ----
    agreement_key = "top1_agreement"  # what verify and the compile check call host-vs-build agreement

    # Each takes the stage's figures (its result's figures()) and returns what the summary shows.

    def train_figures(self, val_acc, confusion, names=()) -> dict:
        """The train stage's validation figures under this task's names (val_acc: top-1)."""
        return {"val_acc": val_acc}

    def train_summary(self, figures: dict) -> dict:
        return {} if figures.get("val_acc") is None else {"train_val_top1": figures["val_acc"]}

    def gate_summary(self, figures: dict) -> dict:
        if "val_acc" not in figures:
            return {}
        return {"val_majority_baseline_top1": figures["majority_baseline"],
                "quality_gate_required_top1": figures["required_val_acc"]}

    def export_summary(self, figures: dict) -> dict:
        return {}  # the exported model's top-1 is the quantize stage's fp32_top1
