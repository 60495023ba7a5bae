"""The quality gate on a trained model: did it learn more than the validation set's majority class?

Every other gate compares a stage with the one before it (INT8 with FP32, the edge with the
host), so a model that predicts one class for every image passes them all. This gate compares
the model with the cheapest possible one, "always answer the most frequent class", from the
per-class confusion counts of the last validation pass (metrics.jsonl's eval record).

It fails when any of these holds:
- top-1 does not close `baseline_margin` of the gap between the majority baseline and 100 %
  (0.1 on three balanced classes: 33.3 % -> at least 40.0 %);
- one class takes at least `max_predicted_share` of the predictions while it is rarer than that
  in the validation set (the model collapsed onto it);
- top-1 is below `min_val_acc`, or a class's recall is below `min_class_recall` (both off at 0).

Light on imports (no torch): `appliance train`, the pipeline and the tests use it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from appliance.core.errors import ConfigError, GateFailed
from appliance.tasks.classification_figures import pct as _pct, quality_figures  # noqa: F401 (re-exported)
from appliance.tasks.thresholds import GATE_KEYS, Thresholds  # noqa: F401 (re-exported)
from appliance.core.manifest import atomic_write_text, write_manifest
from appliance.core.stage import Figures, flat_figures, read_result_json

QUALITY_JSON = "quality.json"


def check_thresholds(train_section, source: str) -> None:
    """ConfigError naming the key when a threshold is outside its range."""
    t = Thresholds.of(train_section)
    for key in ("min_val_acc", "min_class_recall", "baseline_margin"):
        if not 0 <= getattr(t, key) <= 1:
            raise ConfigError(f"{source}: [train] {key} is a fraction in [0, 1], got {getattr(t, key)}")
    if not 0 < t.max_predicted_share <= 1:
        raise ConfigError(f"{source}: [train] max_predicted_share is a fraction in (0, 1], got {t.max_predicted_share}")


def summary_line(run: str, figures: dict) -> str:
    """One line: the run, val top-1, the baseline, and the verdict (with the first reason).
    A task whose figures carry their own "verdict" line (segmentation's mIoU) is given that."""
    if "verdict" in figures:
        return f"run {run}: {figures['verdict']}"
    if "val_acc" not in figures:
        return f"run {run}: quality gate failed: {figures['failures'][0]}"
    head = (f"run {run}: val top-1 {_pct(figures['val_acc'])} vs majority-class baseline "
            f"{_pct(figures['majority_baseline'])} (needs {_pct(figures['required_val_acc'])})")
    if figures["passed"]:
        return f"{head}: quality gate passed"
    return f"{head}: quality gate failed: {'; '.join(figures['failures'])}"


def write_quality(path: Path, run: str, figures: dict) -> None:
    atomic_write_text(path, json.dumps({"run": run, "line": summary_line(run, figures), **figures}, indent=2) + "\n")


def require_quality(run: str, figures: dict) -> None:
    """GateFailed (exit 3) with the summary line when the model fails the gate."""
    if not figures["passed"]:
        raise GateFailed(summary_line(run, figures))


@dataclass(frozen=True)
class GateResult:
    """The pipeline's gate stage: OUT/gate/quality.json and its manifest."""

    out_dir: Path
    quality: dict

    def figures(self) -> Figures:
        """quality.json flat, its verdict line included, without the confusion counts and the run's path."""
        return flat_figures({k: v for k, v in self.quality.items() if k not in ("run", "confusion")})

    @classmethod
    def load(cls, out_dir: Path) -> "GateResult":
        return cls(Path(out_dir), read_result_json(Path(out_dir) / QUALITY_JSON))


def gate_stage(train, thresholds: Thresholds, out_dir: Path) -> GateResult:
    """Judge a TrainResult into out_dir (quality.json + manifest); GateFailed when the model fails."""
    out_dir = Path(out_dir)
    judged = train.judged(thresholds)
    figures = judged.quality
    if figures is None:
        figures = {"samples": 0, "passed": False, "thresholds": asdict(thresholds), "failures": [
            f"{train.metrics_path} holds no validation confusion counts (made by an older appliance?); "
            "train again to judge the model"]}
    run = str(train.run_dir)
    write_quality(out_dir / QUALITY_JSON, run, figures)
    write_manifest(out_dir, "gate", [train.metrics_path], {"run": run, "thresholds": asdict(thresholds)})
    require_quality(run, figures)
    return GateResult.load(out_dir)
