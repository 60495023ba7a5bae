"""Figures a reviewer asks of a training run, from counts the loop already has (no torch here).

Per-class precision and recall come from the validation confusion counts confusion[true][predicted]
that `evaluate` gathers across ranks; the same counts feed the quality gate (quality.py).
"""

from __future__ import annotations

from appliance.tasks.classification_figures import class_names, per_class  # noqa: F401 (re-exported)
