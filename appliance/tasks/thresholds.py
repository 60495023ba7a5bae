"""The quality gate's thresholds, from a [train] section; each task judges its model against them."""

from __future__ import annotations

from dataclasses import dataclass

# [train] keys that judge the model and do not decide its weights (kept out of the training hash).
GATE_KEYS = ("min_val_acc", "min_class_recall", "baseline_margin", "max_predicted_share")


@dataclass(frozen=True)
class Thresholds:
    min_val_acc: float = 0.0
    min_class_recall: float = 0.0
    baseline_margin: float = 0.1
    max_predicted_share: float = 0.95

    @classmethod
    def of(cls, train_section) -> "Thresholds":
        """The thresholds of a [train] section (a TrainSection, or a dict as read from TOML)."""
        get = train_section.get if isinstance(train_section, dict) else lambda k, d: getattr(train_section, k, d)
        return cls(**{k: float(get(k, getattr(cls, k))) for k in GATE_KEYS})
