"""Tasks: per task, the one place that says how a record becomes a sample, which models and loss
train it, what the validation pass counts and reports, and what the quality gate compares with.

`task_for(section)` gives the task of a config's [task] section (kind = "classification",
"segmentation" or "detection"); training, the gate and the reports ask the task instead of testing its kind.
Light on imports: torch is imported by the methods that need it.
"""

from __future__ import annotations

from appliance.core.errors import ConfigError
from appliance.tasks.classification import Classification
from appliance.tasks.detection import Detection
from appliance.tasks.segmentation import Segmentation

TASK_KINDS = ("classification", "segmentation", "detection")


def task_for(section=None):
    """The task of a [task] section (a dataclass or a dict; None: classification)."""
    get = (section.get if isinstance(section, dict) else lambda k, d: getattr(section, k, d)) if section else None
    kind = get("kind", "classification") if get else "classification"
    if kind == "classification":
        return Classification()
    if kind == "segmentation":
        return Segmentation(ignore_label=int(get("ignore_label", 255)),
                            class_weights=tuple(float(w) for w in get("class_weights", ()) or ()))
    if kind == "detection":
        return Detection(score_threshold=float(get("score_threshold", 0.05)),
                         iou_threshold=float(get("iou_threshold", 0.5)), max_detections=int(get("max_detections", 100)))
    raise ConfigError(f"[task] kind {kind!r} is not one of {', '.join(TASK_KINDS)}")


def task_of_card(card) -> object:
    """The task a trained model's card records (cards without one are classification's)."""
    return task_for(card.extra.get("task") if isinstance(card.extra.get("task"), dict) else None)


def task_of_metadata(meta: dict) -> object:
    """The task of an exported model: its ONNX metadata's model card (appliance.model_card)."""
    card = meta.get("model_card") if isinstance(meta, dict) else None
    extra = card.get("extra") if isinstance(card, dict) else None
    task = extra.get("task") if isinstance(extra, dict) else None
    return task_for(task if isinstance(task, dict) else None)
