"""Outlier rules for one statistic: the 3-sigma rule and the robust median/MAD rule.

3-sigma alone is fooled by the outliers it hunts: one 8000x8000 image among thousands of
256x256 ones inflates the standard deviation until the bound swallows it (with n values the
largest possible z-score is (n-1)/sqrt(n)). The median/MAD rule (modified z-score, Iglewicz &
Hoaglin: |x - median| / (1.4826 * MAD) > 3.5) is not moved by a few extreme values. We report
both, and a value is an outlier when either rule flags it.
"""

from __future__ import annotations

import numpy as np

SIGMA = 3.0
MAD_Z = 3.5
MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its sigma
MEAN_AD_TO_SIGMA = 1.2533  # fallback when more than half the values are equal (MAD = 0)


def outlier_bounds(values: np.ndarray) -> dict:
    """Bounds of both rules for these values (JSON-ready floats)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return {"count": 0}
    mean, std = float(values.mean()), float(values.std())
    median = float(np.median(values))
    mad = float(np.median(np.abs(values - median)))
    spread = MAD_TO_SIGMA * mad
    if spread == 0.0:
        spread = MEAN_AD_TO_SIGMA * float(np.mean(np.abs(values - median)))
    return {
        "count": int(values.size),
        "mean": mean, "std": std,
        "sigma_low": mean - SIGMA * std, "sigma_high": mean + SIGMA * std,
        "median": median, "mad": mad,
        "mad_low": median - MAD_Z * spread, "mad_high": median + MAD_Z * spread,
        "min": float(values.min()), "max": float(values.max()),
    }


def flag_outliers(values: np.ndarray, bounds: dict) -> list[tuple[int, list[str]]]:
    """(position, rules that flag it) for every value outside either rule's bounds."""
    values = np.asarray(values, dtype=np.float64)
    if values.size < 3 or bounds.get("std", 0.0) == 0.0:
        return []  # with fewer than 3 values or no spread there is nothing to stand out from
    sigma = (values < bounds["sigma_low"]) | (values > bounds["sigma_high"])
    mad = (values < bounds["mad_low"]) | (values > bounds["mad_high"])
    flagged = []
    for pos in np.flatnonzero(sigma | mad):
        rules = (["3-sigma"] if sigma[pos] else []) + (["median/MAD"] if mad[pos] else [])
        flagged.append((int(pos), rules))
    return flagged
