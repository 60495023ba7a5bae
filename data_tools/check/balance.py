"""Label balance: how many records each class has, and the ratio of the largest to the smallest."""

from __future__ import annotations

from collections import Counter


def label_balance(labels: Counter, num_classes: int | None = None) -> dict:
    """Histogram (label -> count, as strings for JSON) and imbalance = max count / min count.

    With num_classes known, a class with no records at all makes the imbalance infinite
    (reported as null with "empty_classes" listing them): training cannot learn it.
    """
    histogram = {str(k): int(v) for k, v in sorted(labels.items())}
    counts = list(labels.values())
    empty = [c for c in range(num_classes) if labels.get(c, 0) == 0] if num_classes else []
    if not counts:
        imbalance = None
    elif empty:
        imbalance = None
    else:
        imbalance = max(counts) / min(counts)
    return {
        "histogram": histogram,
        "classes_seen": len(counts),
        "empty_classes": empty,
        "imbalance": imbalance,
        "largest": max(labels, key=labels.get) if counts else None,
        "smallest": min(labels, key=labels.get) if counts else None,
    }
