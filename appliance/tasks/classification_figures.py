"""Classification's figures from confusion[true][predicted] counts: per-class precision and recall,
and the quality gate's verdict against always answering the majority class (no torch here).

Moved from appliance/train/metrics.py and quality.py (which re-export them) so the task layer,
below training and deploy, can use them.
"""

from __future__ import annotations

from dataclasses import asdict

from appliance.tasks.thresholds import Thresholds


def class_names(n_classes: int, names=()) -> list[str]:
    """The configured class names, or "0".."n-1" when none (or the wrong number) are given."""
    return [str(c) for c in names] if len(names) == n_classes else [str(i) for i in range(n_classes)]


def per_class(confusion, names=()) -> dict:
    """{"precision": {class: p}, "recall": {class: r}} from confusion[true][predicted] counts.

    A class never predicted has precision 0.0, a class with no validation samples recall 0.0
    (scikit-learn's zero_division=0), so every class has a number to plot and compare."""
    rows = [[int(c) for c in row] for row in confusion]
    n = len(rows)
    if any(len(row) != n for row in rows):
        raise ValueError(f"confusion counts must be square, got rows of {[len(r) for r in rows]}")
    labels = class_names(n, names)
    predicted = [sum(rows[t][p] for t in range(n)) for p in range(n)]
    precision = {labels[c]: rows[c][c] / predicted[c] if predicted[c] else 0.0 for c in range(n)}
    recall = {labels[c]: rows[c][c] / sum(rows[c]) if sum(rows[c]) else 0.0 for c in range(n)}
    return {"precision": precision, "recall": recall}


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
        failures.append(f"val top-1 {pct(val_acc)} is below the {pct(required)} required "
                        f"(majority-class baseline {pct(baseline)}, class {names[majority]!r})")
    if top_share >= thresholds.max_predicted_share and true_counts[top] / samples < thresholds.max_predicted_share:
        failures.append(f"it predicts class {names[top]!r} for {pct(top_share)} of the samples "
                        f"({pct(true_counts[top] / samples)} are that class)")
    low = {name: r for name, r in recall.items() if r < thresholds.min_class_recall}
    if low:
        failures.append(f"class recall below min_class_recall {pct(thresholds.min_class_recall)}: "
                        + ", ".join(f"{name!r} {pct(r)}" for name, r in low.items()))
    return {"samples": samples, "val_acc": val_acc, "majority_baseline": baseline, "majority_class": names[majority],
            "required_val_acc": required, "top_predicted_class": names[top], "top_predicted_share": top_share,
            "class_recall": recall, "class_counts": dict(zip(names, true_counts)), "confusion": rows,
            "passed": not failures, "failures": failures, "thresholds": asdict(thresholds)}


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"
