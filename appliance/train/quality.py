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
from appliance.core.manifest import atomic_write_text, write_manifest

QUALITY_JSON = "quality.json"
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


def check_thresholds(train_section, source: str) -> None:
    """ConfigError naming the key when a threshold is outside its range."""
    t = Thresholds.of(train_section)
    for key in ("min_val_acc", "min_class_recall", "baseline_margin"):
        if not 0 <= getattr(t, key) <= 1:
            raise ConfigError(f"{source}: [train] {key} is a fraction in [0, 1], got {getattr(t, key)}")
    if not 0 < t.max_predicted_share <= 1:
        raise ConfigError(f"{source}: [train] max_predicted_share is a fraction in (0, 1], got {t.max_predicted_share}")


def quality_figures(confusion, class_names=(), thresholds: Thresholds = Thresholds()) -> dict:
    """The gate's figures from confusion[true][predicted] counts; `passed` and `failures` say the verdict."""
    rows = [[int(c) for c in row] for row in confusion]
    n_classes = len(rows)
    names = [str(c) for c in class_names] if len(class_names) == n_classes else [str(i) for i in range(n_classes)]
    true_counts = [sum(row) for row in rows]
    predicted_counts = [sum(row[j] for row in rows) for j in range(n_classes)]
    samples = sum(true_counts)
    if samples == 0:
        return {"samples": 0, "passed": False, "failures": ["the validation pass saw no sample"],
                "thresholds": asdict(thresholds)}
    correct = sum(rows[i][i] for i in range(n_classes))
    val_acc = correct / samples
    majority = max(range(n_classes), key=lambda i: true_counts[i])
    baseline = true_counts[majority] / samples
    top = max(range(n_classes), key=lambda j: predicted_counts[j])
    top_share = predicted_counts[top] / samples
    required = max(thresholds.min_val_acc, baseline + thresholds.baseline_margin * (1 - baseline))
    recall = {names[i]: rows[i][i] / true_counts[i] for i in range(n_classes) if true_counts[i]}
    failures = []
    if val_acc < required:
        failures.append(f"val top-1 {_pct(val_acc)} is below the {_pct(required)} required "
                        f"(majority-class baseline {_pct(baseline)}, class {names[majority]!r})")
    if top_share >= thresholds.max_predicted_share and true_counts[top] / samples < thresholds.max_predicted_share:
        failures.append(f"it predicts class {names[top]!r} for {_pct(top_share)} of the samples "
                        f"({_pct(true_counts[top] / samples)} are that class)")
    low = {name: r for name, r in recall.items() if r < thresholds.min_class_recall}
    if low:
        failures.append(f"class recall below min_class_recall {_pct(thresholds.min_class_recall)}: "
                        + ", ".join(f"{name!r} {_pct(r)}" for name, r in low.items()))
    return {"samples": samples, "val_acc": val_acc, "majority_baseline": baseline, "majority_class": names[majority],
            "required_val_acc": required, "top_predicted_class": names[top], "top_predicted_share": top_share,
            "class_recall": recall, "class_counts": dict(zip(names, true_counts)), "confusion": rows,
            "passed": not failures, "failures": failures, "thresholds": asdict(thresholds)}


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def summary_line(run: str, figures: dict) -> str:
    """One line: the run, val top-1, the baseline, and the verdict (with the first reason)."""
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

    def figures(self) -> dict:
        keys = ("samples", "val_acc", "majority_baseline", "majority_class", "required_val_acc",
                "top_predicted_class", "top_predicted_share", "class_recall", "passed", "failures")
        return {k: self.quality[k] for k in keys if k in self.quality}

    @classmethod
    def load(cls, out_dir: Path) -> "GateResult":
        return cls(Path(out_dir), json.loads((Path(out_dir) / QUALITY_JSON).read_text()))


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
