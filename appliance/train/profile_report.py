"""RUN_DIR/profile.html and its JSON twin profile.json: where the profiled steps' time went, per rank,
with rule-based recommendations that quote the figures that triggered them. Written by rank 0 from
every rank's summary (appliance/train/profiling.py). Plain HTML with inline SVG, no script.
"""

from __future__ import annotations

import html
import json
import os
from datetime import datetime, timezone
from pathlib import Path

from appliance.train.profiling import PHASE_WORDS, PHASES, TRACE_DIR
from appliance.core.html_report import page

PROFILE_HTML, PROFILE_JSON = "profile.html", "profile.json"
MADE_BY = "appliance train --profile (appliance/train/profile_report.py); remake with another profiled run"
COLORS = {"data_wait": "#c44e52", "h2d_copy": "#8172b2", "forward": "#4c72b0", "backward": "#55a868",
          "optimizer": "#dd8452", "allreduce": "#937860", "checkpoint": "#da8bc3", "validation": "#8c8c8c",
          "other": "#cccccc"}

# The rules' thresholds, as shares of step time (the largest share over the ranks: the slowest rank sets the pace).
DATA_WAIT_MAX = 0.10
ALLREDUCE_MAX = 0.30
H2D_MAX = 0.10
CHECKPOINT_MAX = 0.10
OTHER_MAX = 0.20
GPU_MEMORY_LOW = 0.5
STEP_SPREAD = 2.0  # slowest step over the median


def profile_report(summaries: list[dict], cfg, world: int) -> dict:
    """The report's figures (profile.json) from every rank's summary, in rank order."""
    ranks = []
    for s in summaries:
        total = s["total_s"] or 1e-12
        ranks.append({**s, "share": {p: s["phase_s"][p] / total for p in PHASES}})
    share = {p: sum(r["share"][p] for r in ranks) / len(ranks) for p in PHASES}
    worst = {p: max(r["share"][p] for r in ranks) for p in PHASES}
    steps = len(ranks[0]["step_s"])
    slowest = max(r["total_s"] for r in ranks) or 1e-12
    samples = steps * cfg.train.batch_size * cfg.train.grad_accum * world
    report = {"made_by": MADE_BY, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "run": cfg.run.name, "run_dir": str(cfg.run_dir), "world_size": world, "device": ranks[0]["device"],
              "activities": ranks[0]["activities"], "steps": ranks[0]["steps"], "profiled_steps": steps,
              "samples_per_s": samples / slowest, "step_ms_median": _median(ranks[0]["step_s"]) * 1e3,
              "phases": list(PHASES), "share": share, "share_max_over_ranks": worst,
              "ranks": [{"rank": r["rank"], "device": r["device"], "total_s": r["total_s"],
                         "step_ms": [t * 1e3 for t in r["step_s"]], "phase_s": r["phase_s"], "share": r["share"],
                         "communication_s": r["communication_s"], "memory": r["memory"], "trace": r["trace"]}
                        for r in ranks],
              "top_operators": ranks[0]["top_operators"],
              "traces": [r["trace"] for r in ranks]}
    report["recommendations"] = recommendations(report, cfg)
    return report


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def recommendations(report: dict, cfg) -> list[dict]:
    """Each rule that fired: {rule, figure, threshold, advice}; figure and threshold are what the advice quotes."""
    worst, out = report["share_max_over_ranks"], []

    def fire(rule, figure, threshold, advice):
        out.append({"rule": rule, "figure": figure, "threshold": threshold, "advice": advice})

    if worst["data_wait"] > DATA_WAIT_MAX:
        workers = cfg.data.num_workers
        cores = os.cpu_count() or 1
        fire("data_wait", worst["data_wait"], DATA_WAIT_MAX,
             f"data wait is {worst['data_wait']:.0%} of step time (over {DATA_WAIT_MAX:.0%}): the model waits for "
             f"batches. Raise [data] num_workers (now {workers}; this machine has {cores} cores for "
             f"{report['world_size']} process(es)), or check the decode cost (image size and format of the records; "
             "resize them once, offline).")
    if worst["allreduce"] > ALLREDUCE_MAX:
        fire("allreduce", worst["allreduce"], ALLREDUCE_MAX,
             f"gradient all-reduce not hidden behind compute is {worst['allreduce']:.0%} of step time (over "
             f"{ALLREDUCE_MAX:.0%}): raise [train] grad_accum (now {cfg.train.grad_accum}) so gradients are "
             "exchanged once per more samples, or a larger batch_size; on several nodes check the interconnect "
             "([distributed] iface, NCCL_IB_DISABLE). Or try [distributed] bucket_cap_mb (now "
             f"{cfg.distributed.bucket_cap_mb:g} MiB): larger buckets make fewer all-reduce calls, smaller ones start "
             "them earlier in backward; it is part of the training hash (it changes the order of the gradient sums), "
             "so a new value is a new run.")
    if worst["h2d_copy"] > H2D_MAX:
        fire("h2d_copy", worst["h2d_copy"], H2D_MAX,
             f"host-to-device copies are {worst['h2d_copy']:.0%} of step time (over {H2D_MAX:.0%}): the batches "
             "are large for the link; a smaller [data] image_size, or fewer, larger steps.")
    if worst["checkpoint"] > CHECKPOINT_MAX:
        fire("checkpoint", worst["checkpoint"], CHECKPOINT_MAX,
             f"checkpointing is {worst['checkpoint']:.0%} of the profiled steps' time (over {CHECKPOINT_MAX:.0%}): "
             f"raise [checkpoint] every_steps (now {cfg.checkpoint.every_steps}).")
    if worst["other"] > OTHER_MAX:
        fire("other", worst["other"], OTHER_MAX,
             f"{worst['other']:.0%} of step time is outside the measured phases (over {OTHER_MAX:.0%}): logging, "
             "the per-step stop agreement (which also waits for slower ranks), Python overhead; open the trace "
             f"to see it, and raise [run] log_every (now {cfg.run.log_every}) if logging shows there.")
    for r in report["ranks"]:
        memory = r["memory"]
        if memory["kind"] == "cuda_allocated" and memory["device_total_mb"]:
            used = memory["peak_mb"] / memory["device_total_mb"]
            if used < GPU_MEMORY_LOW:
                fire("gpu_memory", used, GPU_MEMORY_LOW,
                     f"rank {r['rank']} used at most {memory['peak_mb']:.0f} MiB of {memory['device_total_mb']:.0f} MiB "
                     f"GPU memory ({used:.0%}, under {GPU_MEMORY_LOW:.0%}): a bigger [train] batch_size (now "
                     f"{cfg.train.batch_size}) fits, with the learning rate scaled to match.")
                break
    steps = report["ranks"][0]["step_ms"]
    median = _median(steps)
    if len(steps) >= 3 and median > 0 and max(steps) > STEP_SPREAD * median:
        fire("uneven_steps", max(steps) / median, STEP_SPREAD,
             f"the slowest profiled step took {max(steps):.1f} ms, {max(steps) / median:.1f}x the median "
             f"{median:.1f} ms: a stall (a checkpoint, a validation, a slow batch, another process on the machine); "
             "the trace shows which step.")
    compute = worst["forward"] + worst["backward"]
    if report["device"].startswith("cuda") and cfg.train.precision == "fp32" and compute > 0.5:
        fire("precision", compute, 0.5,
             f"forward and backward are {compute:.0%} of step time in fp32 on a GPU: [train] precision = \"auto\" "
             "(fp16 with loss scaling) or \"bf16\" runs them on the tensor cores.")
    return out


def write_profile_report(run_dir: Path, summaries: list[dict], cfg, world: int) -> tuple[Path, Path]:
    """run_dir/profile.json and run_dir/profile.html; trace paths relative to the run directory."""
    report = profile_report(summaries, cfg, world)
    report["traces"] = [os.path.relpath(t, run_dir) for t in report["traces"]]  # on each rank's node
    for r in report["ranks"]:
        r["trace"] = os.path.relpath(r["trace"], run_dir)
    json_path, html_path = run_dir / PROFILE_JSON, run_dir / PROFILE_HTML
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    html_path.write_text(render_html(report))
    return json_path, html_path


# ---- HTML ---------------------------------------------------------------------------------------

def shares_svg(report: dict) -> str:
    """One stacked bar per rank: the share of step time per phase, with a legend."""
    width, left, bar_w, row = 680, 70, 560, 34
    parts = ['<text x="0" y="16" font-size="14" font-weight="bold">Share of step time by phase</text>']
    for i, r in enumerate(report["ranks"]):
        y, x = 30 + i * row, float(left)
        parts.append(f'<text x="0" y="{y + 17}" font-size="13">rank {r["rank"]}</text>')
        for p in PHASES:
            w = bar_w * r["share"][p]
            if w < 0.1:  # nothing to see (and "0.0" wide)
                continue
            parts.append(f'<rect class="phase" data-phase="{p}" x="{x:.1f}" y="{y}" width="{w:.1f}" height="24" '
                         f'fill="{COLORS[p]}"><title>{html.escape(PHASE_WORDS[p])}: {r["share"][p]:.1%}</title></rect>')
            x += w
    legend_y = 30 + len(report["ranks"]) * row + 10
    for j, p in enumerate(PHASES):
        lx, ly = (j % 3) * 225, legend_y + (j // 3) * 18
        parts.append(f'<rect x="{lx}" y="{ly}" width="12" height="12" fill="{COLORS[p]}"/>'
                     f'<text x="{lx + 16}" y="{ly + 11}" font-size="11">{html.escape(PHASE_WORDS[p])} '
                     f'{report["share"][p]:.1%}</text>')
    height = legend_y + 18 * ((len(PHASES) + 2) // 3) + 6
    return (f'<svg id="chart-phases" class="bars" xmlns="http://www.w3.org/2000/svg" width="{width}" '
            f'height="{height}" role="img">{"".join(parts)}</svg>')


def steps_svg(report: dict) -> str:
    """Each profiled step's time on rank 0, one column per step."""
    steps = report["ranks"][0]["step_ms"]
    width, height, left, right = 680, 140, 60, 660
    top = max(steps, default=0) or 1.0
    step_w = (right - left) / max(len(steps), 1)
    cols = "".join(f'<rect class="column" x="{left + i * step_w:.1f}" y="{30 + height * (1 - v / top):.1f}" '
                   f'width="{max(step_w - 2, 1):.1f}" height="{height * v / top:.1f}" fill="#4c72b0">'
                   f'<title>step {report["steps"][0] + i}: {v:.1f} ms</title></rect>' for i, v in enumerate(steps))
    return (f'<svg id="chart-steps" class="columns" xmlns="http://www.w3.org/2000/svg" width="{width}" '
            f'height="{height + 50}" role="img">'
            f'<text x="0" y="16" font-size="14" font-weight="bold">Time of each profiled step (rank 0)</text>'
            f'<text class="tick" x="{left - 6}" y="36" font-size="11" text-anchor="end">{top:.0f} ms</text>'
            f'<text class="tick" x="{left - 6}" y="{30 + height}" font-size="11" text-anchor="end">0</text>'
            f'{cols}<text x="{left}" y="{height + 46}" font-size="11">step {report["steps"][0]}</text>'
            f'<text x="{right}" y="{height + 46}" font-size="11" text-anchor="end">step {report["steps"][1]}</text></svg>')


def render_html(report: dict) -> str:
    ranks = report["ranks"]
    phases_rows = ""
    for p in PHASES:
        cells = "".join(f"<td>{r['share'][p]:.1%}</td>" for r in ranks)
        phases_rows += f"<tr><th>{html.escape(PHASE_WORDS[p])}</th>{cells}<td>{report['share'][p]:.1%}</td></tr>"
    head = "".join(f"<th>rank {r['rank']}</th>" for r in ranks)
    totals = "".join(f"<td>{r['total_s'] * 1e3:.1f} ms</td>" for r in ranks)
    cuda = report["device"].startswith("cuda")
    ops = ""
    for o in report["top_operators"]:
        cuda_cell = f"<td>{(o['self_cuda_ms'] or 0):.2f}</td>" if cuda else ""
        ops += (f'<tr><td class="op">{html.escape(o["name"])}</td><td>{o["calls"]}</td>'
                f"<td>{o['self_cpu_ms']:.2f}</td>{cuda_cell}</tr>")
    memory_rows = ""
    for r in ranks:
        m = r["memory"]
        what = "CUDA allocated" if m["kind"] == "cuda_allocated" else "process RSS"
        total = f"{m['device_total_mb']:.0f} MiB" if m["device_total_mb"] else "(CPU)"
        memory_rows += f"<tr><td>rank {r['rank']}</td><td>{what}</td><td>{m['peak_mb']:.0f} MiB</td><td>{total}</td></tr>"
    recs = report["recommendations"]
    rec_html = ("<ul id=\"recommendations\">" + "".join(f"<li data-rule=\"{html.escape(r['rule'])}\">"
                                                          f"{html.escape(r['advice'])}</li>" for r in recs) + "</ul>"
                if recs else "<p id=\"recommendations\">No rule fired: no phase is over its threshold.</p>")
    traces = "".join(f"<li><code>{html.escape(t)}</code></li>" for t in report["traces"])
    comm = "; ".join(f"rank {r['rank']} {r['communication_s'] * 1e3:.1f} ms" for r in report["ranks"])
    title = f"Training profile: {report['run']}"
    body = f"""<p>Steps {report['steps'][0]} to {report['steps'][1]} ({report['profiled_steps']} steps after the
profiler's warm-up), {report['world_size']} process(es) on {html.escape(report['device'])}; profiler activities
{', '.join(report['activities'])}. <b>{report['samples_per_s']:.1f} samples/s</b> over the window (all processes),
median step {report['step_ms_median']:.1f} ms. Times are measured under the profiler, which adds a little to every
operator; <code>metrics.jsonl</code> has the unprofiled rate.</p>
<h2>Recommendations</h2>
{rec_html}
<h2>Where the step time went</h2>
{shares_svg(report)}
<table id="phases"><tr><th>phase</th>{head}<th>mean</th></tr>{phases_rows}
<tr><th>profiled time</th>{totals}<td></td></tr></table>
<p>Each phase is timed on the host clock{' and ends with a CUDA synchronisation, so it includes its kernels' if cuda else ''}.
Gradient all-reduce counts only communication during which no compute ran (from the profiler's events): DDP's
gradient all-reduce in backward and its buffer broadcast in forward; the part hidden behind compute stays in its phase. Communication in all (hidden or not): {comm}. Other is the rest of the
step: logging, the per-step stop agreement (a small all-reduce that also waits for slower ranks), Python between
phases. Validation and the epoch-end checkpoint count in the step that follows them.</p>
{steps_svg(report)}
<h2>Top operators (rank 0, by self {'CUDA' if cuda else 'CPU'} time)</h2>
<table id="operators"><tr><th>operator</th><th>calls</th><th>self CPU ms</th>{'<th>self CUDA ms</th>' if cuda else ''}</tr>{ops}</table>
<h2>Peak memory</h2>
<table id="memory"><tr><th>rank</th><th>what</th><th>peak</th><th>device</th></tr>{memory_rows}</table>
<p>Peak since the process started{' (tensors allocated by the caching allocator)' if cuda else ' (resident set size)'}.</p>
<h2>Traces</h2>
<p>One Chrome trace per rank, relative to the run directory; open it in Perfetto (ui.perfetto.dev, or its offline
build) or <code>chrome://tracing</code>, or with TensorBoard's profiler plugin:
<code>tensorboard --logdir {html.escape(report['run_dir'])}/tb</code> (run <code>{TRACE_DIR}</code>).</p>
<ul id="traces">{traces}</ul>"""
    return page(title, MADE_BY, PROFILE_JSON, None, body, style="td,th{text-align:right}td.op{text-align:left}")
