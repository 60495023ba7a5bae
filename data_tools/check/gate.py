"""The gate: thresholds a report must meet (`--fail-on corrupt>0,quarantined_fraction>0.05`).

Each condition names a report metric, a comparison and a number; the gate fails when any
condition is true. Training configs can require a report whose gate passed.
"""

from __future__ import annotations

import math
import operator
import re

from appliance.core.errors import ConfigError
from appliance.core.errors import DataError

METRICS = {
    "corrupt": "damaged byte ranges plus records that do not parse",
    "quarantined": "records quarantined",
    "quarantined_fraction": "records quarantined / records read",
    "imbalance": "largest class count / smallest class count (infinite with an empty class)",
    "duplicates": "exact duplicate copies quarantined",
    "near_duplicates": "groups of near-duplicate images",
    "leakage": "validation records that are also in the training split",
    "outliers": "records flagged by a statistics rule",
    "unreadable_files": "input files that could not be read at all",
}
_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq}
_CONDITION = re.compile(r"^\s*([a-z_]+)\s*(>=|<=|==|>|<)\s*([0-9.eE+-]+|inf)\s*$")


def parse_fail_on(text: str | None, where: str = "--fail-on") -> list[tuple[str, str, float]]:
    """'corrupt>0,imbalance>10' -> [(metric, op, threshold)]; a mistake is a ConfigError naming `where`."""
    if not text:
        return []
    conditions = []
    for part in text.split(","):
        match = _CONDITION.match(part)
        try:
            number = float(match.group(3)) if match else math.nan
        except ValueError:  # "1.2.3" matches the character class
            number = math.nan
        if not match or math.isnan(number):
            raise ConfigError(f"{where}: {part.strip()!r} is not METRIC>NUMBER (e.g. corrupt>0)")
        metric, op, _ = match.groups()
        if metric not in METRICS:
            raise ConfigError(f"{where}: unknown metric {metric!r}; known: {', '.join(METRICS)}")
        conditions.append((metric, op, number))
    return conditions


def evaluate(conditions, metrics: dict) -> dict:
    """{"passed", "conditions", "failed": ["imbalance = 40 > 10 (largest class ...)", ...]}."""
    failed = []
    for metric, op, threshold in conditions:
        value = metrics[metric]
        value = math.inf if value is None else value  # undefined imbalance = an empty class
        if _OPS[op](value, threshold):
            failed.append(f"{metric} = {_fmt(value)} {op} {_fmt(threshold)} ({METRICS[metric]})")
    return {"passed": not failed,
            "conditions": [f"{m}{op}{_fmt(t)}" for m, op, t in conditions],
            "failed": failed}


def _fmt(x: float) -> str:
    if math.isinf(x):
        return "inf"
    return str(int(x)) if float(x).is_integer() else f"{x:.4g}"


def require_passing_report(report_path) -> dict:
    """Load a data check report.json and raise DataError unless its gate passed (for training configs)."""
    import json
    from pathlib import Path

    path = Path(report_path)
    try:
        report = json.loads(path.read_text())
    except OSError as err:
        raise DataError(f"{path}: cannot read the data check report: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: line {err.lineno}: not a data check report (invalid JSON)") from None
    gate = report.get("gate") if isinstance(report, dict) else None
    if not isinstance(gate, dict) or "passed" not in gate:
        raise DataError(f"{path}: not a data check report (no \"gate\"); run appliance data check")
    if not gate.get("conditions"):
        raise DataError(f"{path}: the data check ran without --fail-on, so nothing was required of the data")
    if not gate["passed"]:
        raise DataError(f"{path}: data check gate failed: {'; '.join(gate.get('failed', []))}")
    return report
