"""tune/report.html and its JSON twin: every trial, the optimisation history, parameter importances,
one slice plot per parameter and each trial's validation curve (pruned trials stop early on it).

The plots are inline SVG drawn from the study's own records (no script, no CDN): Optuna's
matplotlib plots need matplotlib, which the appliance does not ship, and its plotly plots need a
JavaScript bundle. Importances are Optuna's (fANOVA, seeded), computed over the complete trials.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

import optuna
from optuna.trial import TrialState

from appliance.core.html_report import PALETTE, bars_svg, page
from appliance.core.manifest import atomic_write_text

REPORT_JSON = "report.json"
REPORT_HTML = "report.html"
STATE_COLOURS = {"complete": PALETTE[0], "pruned": PALETTE[1], "fail": PALETTE[3], "running": "#888888"}
W, H, LEFT, TOP = 560, 220, 60, 30  # plot area: LEFT..W-20 x TOP..TOP+H


def trial_record(t: optuna.trial.FrozenTrial) -> dict:
    attrs = t.user_attrs
    launched, exited = attrs.get("launched_at"), attrs.get("exited_at")
    return {"number": t.number, "state": t.state.name.lower(), "value": t.value, "params": t.params,
            "seed": attrs.get("seed"), "intermediate": {str(k): v for k, v in sorted(t.intermediate_values.items())},
            "fail_reason": attrs.get("fail_reason", ""), "resumed": attrs.get("resumed", 0),
            "training_seconds": attrs.get("seconds"), "launched_at": launched, "exited_at": exited,
            "run_dir": attrs.get("run_dir", "")}


def overhead(trials: list[dict]) -> dict:
    """Seconds from one trial's run exiting to the next one's launch (the tuner's own time between
    trials, sequential studies), against the trials' training time."""
    ordered = sorted((t for t in trials if t["launched_at"] and t["exited_at"]), key=lambda t: t["launched_at"])
    gaps = [b["launched_at"] - a["exited_at"] for a, b in zip(ordered, ordered[1:]) if b["launched_at"] >= a["exited_at"]]
    training = [t["training_seconds"] for t in ordered if t["training_seconds"]]
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    return {"between_trials_s": gaps, "median_between_trials_s": median(gaps),
            "median_training_s": median(training)}


def importances(study: optuna.Study) -> dict:
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) < 2 or not complete[0].params:
        return {}
    try:
        evaluator = optuna.importance.FanovaImportanceEvaluator(seed=0)
        return {k: float(v) for k, v in optuna.importance.get_param_importances(study, evaluator=evaluator).items()}
    except (RuntimeError, ValueError, ZeroDivisionError):  # every complete trial has the same values or objective
        return {}


def _scale(lo: float, hi: float, log: bool):
    if log:
        lo, hi = math.log10(lo), math.log10(hi)
    span = (hi - lo) or 1.0
    return lambda v: ((math.log10(v) if log else v) - lo) / span


def scatter_svg(title: str, xlabel: str, points: list[tuple[float, float, str, str]], *, log_x: bool = False,
                lines: list[list[tuple[float, float]]] = (), line_colours=(), ticks_x=None) -> str:
    """Points (x, y, state, tooltip) and polylines on linear axes (x log when log_x), in plot units."""
    xs = [p[0] for p in points] + [x for line in lines for x, _ in line]
    ys = [p[1] for p in points] + [y for line in lines for _, y in line]
    if not xs:
        return f"<p><b>{html.escape(title)}</b>: no finished trial with a value yet.</p>"
    fx, fy = _scale(min(xs), max(xs), log_x), _scale(min(ys), max(ys), False)
    px = lambda x: LEFT + 10 + fx(x) * (W - LEFT - 40)  # noqa: E731
    py = lambda y: TOP + H - 10 - fy(y) * (H - 20)  # noqa: E731
    out = [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{TOP + H + 60}" role="img">',
           f'<text x="0" y="16" font-size="14" font-weight="bold">{html.escape(title)}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - 20}" height="{H}" fill="none" stroke="#ccc"/>',
           f'<text x="{LEFT - 4}" y="{TOP + 10}" font-size="11" text-anchor="end">{max(ys):.3g}</text>',
           f'<text x="{LEFT - 4}" y="{TOP + H - 4}" font-size="11" text-anchor="end">{min(ys):.3g}</text>',
           f'<text x="{LEFT}" y="{TOP + H + 16}" font-size="11">{min(xs):.3g}</text>',
           f'<text x="{W - 20}" y="{TOP + H + 16}" font-size="11" text-anchor="end">{max(xs):.3g}</text>',
           f'<text x="{(LEFT + W) / 2}" y="{TOP + H + 34}" font-size="12" text-anchor="middle">'
           f'{html.escape(xlabel)}{" (log scale)" if log_x else ""}</text>']
    for line, colour in zip(lines, line_colours):
        if len(line) > 1:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in line)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
    for x, y, state, tip in points:
        out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="4" fill="{STATE_COLOURS.get(state, "#000")}">'
                   f'<title>{html.escape(tip)}</title></circle>')
    legend = " ".join(f'<tspan fill="{c}">● {s}</tspan>' for s, c in STATE_COLOURS.items())
    out.append(f'<text x="{LEFT}" y="{TOP + H + 52}" font-size="11">{legend}</text></svg>')
    return "".join(out)


def _history(trials: list[dict], direction: str, objective: str) -> str:
    complete = sorted((t for t in trials if t["state"] == "complete"), key=lambda t: t["number"])
    best, best_line = None, []
    for t in complete:
        if best is None or (t["value"] > best if direction == "maximize" else t["value"] < best):
            best = t["value"]
        best_line.append((t["number"], best))
    points = [(t["number"], t["value"], t["state"], f"trial {t['number']}: {t['value']:.4g}") for t in complete]
    # pruned trials: their last reported value, where the pruner stopped them
    points += [(t["number"], list(t["intermediate"].values())[-1], t["state"], f"trial {t['number']}: pruned")
               for t in trials if t["state"] == "pruned" and t["intermediate"]]
    return scatter_svg(f"Optimisation history: {objective} per trial, best so far", "trial", points,
                       lines=[best_line], line_colours=["#1a7f37"])


def _curves(trials: list[dict], objective: str) -> str:
    lines = [[(int(k), v) for k, v in t["intermediate"].items()] for t in trials if t["intermediate"]]
    colours = [STATE_COLOURS.get(t["state"], "#000") for t in trials if t["intermediate"]]
    points = [(int(k), v, t["state"], f"trial {t['number']} epoch {k}: {v:.4g}")
              for t in trials for k, v in t["intermediate"].items()]
    return scatter_svg(f"{objective} at each epoch's validation pass, per trial (the pruner's view)", "epoch", points,
                       lines=lines, line_colours=colours)


def _slices(trials: list[dict], spec, objective: str) -> str:
    out = []
    for p in spec.params:
        done = [t for t in trials if t["value"] is not None and p.key in t["params"]]
        if p.kind == "choice":
            index = {json.dumps(c): i for i, c in enumerate(p.choices)}
            points = [(index[json.dumps(t["params"][p.key])], t["value"], t["state"],
                       f"trial {t['number']}: {p.key} = {t['params'][p.key]}") for t in done]
            label = f"{p.key}: " + ", ".join(f"{i} = {c}" for i, c in enumerate(p.choices))
            out.append(scatter_svg(f"Slice: {objective} against {p.key}", label, points))
        else:
            points = [(t["params"][p.key], t["value"], t["state"], f"trial {t['number']}: {p.key} = {t['params'][p.key]:.4g}")
                      for t in done]
            out.append(scatter_svg(f"Slice: {objective} against {p.key}", p.key, points, log_x=p.log))
    return "".join(out)


def _table(trials: list[dict], spec) -> str:
    keys = [p.key for p in spec.params]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ["trial", "state", spec.objective, *keys, "seed", "s", "why"])
    rows = []
    for t in trials:
        cells = [t["number"], t["state"], "" if t["value"] is None else f"{t['value']:.4g}",
                 *(f"{t['params'][k]:.4g}" if isinstance(t["params"].get(k), float) else t["params"].get(k, "") for k in keys),
                 t["seed"], "" if t["training_seconds"] is None else f"{t['training_seconds']:.1f}",
                 t["fail_reason"] or ("stopped early by the pruner" if t["state"] == "pruned" else "")]
        rows.append(f'<tr class="{t["state"]}">' + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def write_report(study: optuna.Study, spec, out_dir: Path, source: Path, nproc: str, parallel: int) -> dict:
    trials = [trial_record(t) for t in study.get_trials(deepcopy=False)]
    counts = {s: sum(t["state"] == s for t in trials) for s in ("complete", "pruned", "fail", "running")}
    best = None
    complete = [t for t in trials if t["state"] == "complete"]
    if complete:
        pick = max if spec.direction == "maximize" else min
        b = pick(complete, key=lambda t: (t["value"], -t["number"]) if spec.direction == "maximize" else (t["value"], t["number"]))
        best = {"number": b["number"], "value": b["value"], "params": b["params"], "seed": b["seed"]}
    report = {"made_by": "appliance tune", "config": str(source), "objective": spec.objective,
              "direction": spec.direction, "spec": spec.to_dict(), "nproc_per_node": nproc, "parallel": parallel,
              "counts": counts, "best": best, "importances": importances(study), "overhead": overhead(trials),
              "trials": trials}
    atomic_write_text(out_dir / REPORT_JSON, json.dumps(report, indent=2, default=str) + "\n")
    summary = (f"<p>{len(trials)} trials of a budget of {spec.trials}: {counts['complete']} complete, "
               f"{counts['pruned']} pruned, {counts['fail']} failed, {counts['running']} running (resumed by the next "
               f"<code>appliance tune</code>). Objective: {html.escape(spec.objective)} ({spec.direction}).</p>")
    if best:
        summary += (f"<p>Best: trial {best['number']}, {html.escape(spec.objective)} {best['value']:.4g}, seed {best['seed']}, "
                    + ", ".join(f"{html.escape(k)} = {v:.4g}" if isinstance(v, float) else f"{html.escape(k)} = {html.escape(str(v))}"
                                for k, v in best["params"].items())
                    + ". Its config: <code>best.toml</code>.</p>")
    imp = report["importances"]
    body = (summary + _table(trials, spec) + _history(trials, spec.direction, spec.objective)
            + (bars_svg("Parameter importance (fANOVA over complete trials)", "", sorted(imp.items(), key=lambda kv: -kv[1]),
                        "{:.2f}") if imp else "<p>Parameter importance: needs two complete trials with different values.</p>")
            + _slices(trials, spec, spec.objective) + _curves(trials, spec.objective))
    atomic_write_text(out_dir / REPORT_HTML, page(f"Hyperparameter search: {Path(source).name}", "appliance tune",
                                                  REPORT_JSON, None, body, style="tr.fail td{color:#cf222e}"))
    return report
