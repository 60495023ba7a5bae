"""`--fallback auto`: an INT8 model within the allowed top-1 drop, found the cheap way first.

1. the cheaper knobs: per-channel weight scales, then the other calibration methods (each a
   re-calibration at most, the model stays all INT8);
2. then the most sensitive layers kept in float, in the order sensitivity ranks them: 1, 2, 4, ...
   of them until the drop is within bound, then bisection down to the fewest that pass, never
   more than max_float_layers.
Every candidate is a real QDQ model evaluated on the whole validation set; the one chosen passed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from appliance.deploy.int8_builder import METHODS, Recipe
from appliance.deploy.sensitivity import float_order


@dataclass
class Attempt:
    recipe: Recipe
    step: str            # "ptq" (as asked), "calibration" (another method / per-channel), "float layers"
    top1: float
    drop_points: float
    passed: bool
    bytes: int
    latency_ms_median: float
    result: dict         # accuracy_report.evaluate's figures (predictions, logits, top-1, latency)

    def row(self) -> dict:
        return {"step": self.step, "recipe": self.recipe.label(), "method": self.recipe.method,
                "per_channel": self.recipe.per_channel, "float_layers": list(self.recipe.float_layers),
                "top1": self.top1, "top1_drop_points": self.drop_points, "passed": self.passed,
                "bytes": self.bytes, "latency_ms_median": self.latency_ms_median}


def knob_recipes(first: Recipe) -> list[Recipe]:
    """Cheaper than float layers, cheapest first: per-channel weights, then the other calibrations."""
    out = [] if first.per_channel else [replace(first, per_channel=True)]
    out += [replace(first, method=m, per_channel=True) for m in METHODS if m != first.method]
    return out


def find_passing(first: Attempt, attempt: Callable[[Recipe, str], Attempt], sensitivity: Callable[[Recipe], dict],
                 max_float_layers: int) -> tuple[Attempt, list[Attempt], dict]:
    """(the attempt to ship, every attempt in order, the sensitivity the float layers came from).

    The attempt to ship passed when any did; otherwise it is the best all-INT8 one."""
    attempts = [first]
    for recipe in knob_recipes(first.recipe):
        attempts.append(attempt(recipe, "calibration"))
        if attempts[-1].passed:
            return attempts[-1], attempts, sensitivity(attempts[-1].recipe)
    base = max(attempts, key=lambda a: (a.top1, a is first))
    sens = sensitivity(base.recipe)
    order = float_order(sens)[:max_float_layers]

    def floated(k: int) -> Attempt:
        attempts.append(attempt(replace(base.recipe, float_layers=tuple(order[:k])), "float layers"))
        return attempts[-1]

    failing, passing, k = 0, None, 1
    while k <= len(order):  # 1, 2, 4, ... layers until one count passes
        tried = floated(k)
        if tried.passed:
            passing = tried
            break
        failing = k
        if k == len(order):
            break
        k = min(2 * k, len(order))
    if passing is None:
        return base, attempts, sens
    high = len(passing.recipe.float_layers)
    while high - failing > 1:  # bisection: the fewest float layers that still pass
        mid = (failing + high) // 2
        tried = floated(mid)
        if tried.passed:
            passing, high = tried, mid
        else:
            failing = mid
    return passing, attempts, sens
