"""Figures a reviewer asks of a training run, from counts the loop already has (no torch here).

Per-class precision and recall come from the validation confusion counts confusion[true][predicted]
that `evaluate` gathers across ranks; the same counts feed the quality gate (quality.py).
"""

from __future__ import annotations


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
