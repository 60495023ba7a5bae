"""What a pipeline run leaves on top of its stage directories: OUT/summary.json (accuracy at each stage,
sizes, latencies, where every artifact is, the lineage), the same figures printed, and OUT/index.html,
one page linking every stage's reports. Built from the stages' typed results and their manifests only.
"""

from __future__ import annotations

import html
import os
from pathlib import Path

from appliance.core.html_report import bars_svg, page
from appliance.core.manifest import read_manifest
from appliance.core.stage import figures_under, html_reports
from appliance.deploy.edge.cycles import describe as describe_estimate
from appliance.pipeline.config import PipelineConfig
from appliance.pipeline.plan import Results
from appliance.tasks import task_for

SUMMARY_JSON = "summary.json"
INDEX_HTML = "index.html"


def build_summary(cfg: PipelineConfig, results: Results, ran: list[str], seconds: float) -> dict:
    """Accuracy at each stage, sizes, latencies, where every artifact is, and the lineage, composed from
    each stage's figures() only. The task (appliance/tasks/) names the figures: top-1 for
    classification, mIoU for segmentation."""
    stages = {name: result.figures() for name, result in results.items()}
    task = pipeline_task(cfg, stages)
    m = task.metric
    summary = {"made_by": "appliance pipeline", "config": str(cfg.source), "out_dir": str(cfg.out_dir),
               "seconds": round(seconds, 1), "ran": ran, "stages": stages,
               "accuracy": {}, "sizes_bytes": {}, "latency_ms": {}, "artifacts": {}}
    if task.kind != "classification":  # a classification summary reads as before tasks existed
        summary["task"] = {"kind": task.kind, "metric": m, "metric_label": task.metric_label}
    accuracy = summary["accuracy"]
    train, gate, quantized = stages.get("train"), stages.get("gate"), stages.get("quantize")
    if train is not None:
        accuracy.update(task.train_summary(train))
    if gate is not None and task.gate_summary(gate):
        accuracy.update(task.gate_summary(gate))
        summary["quality_gate"] = {"passed": gate["passed"], "line": gate.get("line", "")}
    if "export" in stages:
        accuracy.update(task.export_summary(stages["export"]))
    if quantized is not None:
        add_quantize_figures(summary, quantized, m)
    elif train is not None and task.train_summary(train):
        accuracy[f"fp32_{m}"] = task.train_summary(train).get(f"train_val_{m}")
    if "verify" in stages:
        add_verify_figures(summary, stages["verify"], task)
    for name, build in stages.items():  # what each build computes: int8 or simulated, size, speed
        if not name.startswith("compile-"):
            continue
        target = name[len("compile-"):]
        summary.setdefault("builds", {})[target] = {
            k: figures_under(build, k) for k in ("int8_compute", "layers", "int8_kernels", "fp32_kernels",
                                                 "tuned_tasks", "library_bytes", "host_latency_ms", "device_estimate",
                                                 "runtime", "runtime_reason")}
        if task.kind != "classification" and "check.top1_agreement" in build:  # argmax per pixel, on (N, K, H, W)
            accuracy[f"compile_{target}_{task.agreement_key}_with_ort"] = build.get(
                f"check.{task.agreement_key}", build["check.top1_agreement"])
    if "package" in stages:
        summary["sizes_bytes"]["edge_package"] = stages["package"]["bytes"]
        summary["lineage"] = lineage(results.package.out_dir, results.check)
    for name, result in results.items():
        summary["artifacts"][name] = str(result.out_dir)
    return summary


def add_quantize_figures(summary: dict, q: dict, m: str) -> None:
    """The quantize stage's figures: FP32 and quantized metric, the drop, which path made the model."""
    accuracy, mode = summary["accuracy"], q["mode"]
    if f"fp32.{m}" in q:  # a report made before quantize counted this task's metric has none of it
        accuracy[f"fp32_{m}"] = q[f"fp32.{m}"]
        accuracy[f"{mode}_{m}"] = q[f"quantized.{m}"]
        accuracy[f"quantized_{m}_drop_points"] = q[f"{m}_drop_points"]
    for row in figures_under(q, "schemes") or []:  # segmentation: symmetric and asymmetric activations side by side
        if row["scheme"] != "FP32":
            accuracy[f"{row['scheme'].lower().replace(' ', '_')}_{m}"] = row[m]
    if mode == "int8":  # which path made the model the edge runs (fallback: which layers stayed float)
        path = summary["quantize_path"] = {"produced_by": q.get("produced_by", "ptq"), "method": q.get("method"),
                                           "per_channel": q.get("per_channel", False),
                                           "float_layers": q.get("float_layers", [])}
        if "activation_scheme" in q:
            path["activation_scheme"] = q["activation_scheme"]
        if f"qat.{m}" in q:  # QAT ran: its figures next to PTQ's
            path["qat"] = {k: q[f"qat.{k}"] for k in (m, f"{m}_drop_points", "passed")}
            path[f"ptq_{m}_drop_points"] = q[f"ptq.{m}_drop_points"]
    summary["sizes_bytes"].update({"onnx_fp32": q["fp32.bytes"], f"onnx_{mode}": q["quantized.bytes"]})
    summary["latency_ms"].update({"host_ort_fp32": q["fp32.latency_ms_median"],
                                  f"host_ort_{mode}": q["quantized.latency_ms_median"]})


def pipeline_task(cfg: PipelineConfig, stages: dict):
    """The task of the trained model (its card), or of the config before anything was trained."""
    trained = figures_under(stages.get("train", {}), "task")
    if trained:
        return task_for(trained)
    if "quantize" in stages:  # the model card's, as quantize read it (a classification report names none)
        return task_for({"kind": stages["quantize"].get("task", "classification")})
    return task_for(cfg.training.get("task"))


def add_verify_figures(summary: dict, figures: dict, task=None) -> None:
    """The edge verification's figures (the verify stage's): agreement, accuracy and (emulated, never
    gated) speed."""
    task = task or task_for(None)
    route = figures_under(figures, "routes.0")
    summary["accuracy"]["edge_agreement_with_host"] = route.get(task.agreement_key, route["top1_agreement"])
    if task.metric in route:
        summary["accuracy"][f"edge_{task.metric}"] = route[task.metric]
    summary["accuracy"]["edge_max_logit_diff"] = route["max_logit_diff"]
    summary["latency_ms"]["edge_qemu_per_sample"] = round(1000 * route["seconds"] / max(1, figures["samples"]), 2)
    summary["verified_samples"] = figures["samples"]
    selftest, bench = figures_under(figures, "selftest"), figures_under(figures, "bench")
    if selftest:
        summary["edge_selftest"] = {k: selftest.get(k) for k in ("passed", "samples", "top1_agreement",
                                                                  "max_abs_diff", "allowed_abs_diff")}
    if bench:  # measured under qemu: a figure of the emulator, not of the device; never gated
        summary["latency_ms"]["edge_bench_median_emulated"] = bench["median_ms"]
        summary["latency_ms"]["edge_bench_p99_emulated"] = bench["p99_ms"]
        summary["edge_bench_fluctuation_emulated"] = bench["fluctuation"]


def lineage(package_dir: Path, check) -> list[dict]:
    """The edge package's lineage, from the raw data files the check stage read to the compiled model."""
    manifest = read_manifest(package_dir)
    steps = manifest.get("lineage") or manifest["params"].get("lineage", [])  # params: older manifests
    if check is not None and not any(s.get("stage") == "check" for s in steps):
        manifest = read_manifest(check.out_dir)
        steps = [{"stage": "check", "dir": str(check.out_dir), "inputs": manifest["inputs"]}, *steps]
    return steps


def format_summary(summary: dict) -> str:
    lines = [f"pipeline finished in {summary['seconds']} s; artifacts under {summary['out_dir']}"]
    for key, value in summary["accuracy"].items():
        shown = f"{100 * value:.2f} %" if _is_share(key) else f"{value:.4g}"
        lines.append(f"  {key:32s} {shown}")
    for key, value in summary["sizes_bytes"].items():
        lines.append(f"  size {key:27s} {value / 1024:.1f} KiB")
    for key, value in summary["latency_ms"].items():
        lines.append(f"  latency {key:24s} {value:.3f} ms")
    for target, build in summary.get("builds", {}).items():
        if build.get("device_estimate") is not None:
            lines.append(f"  {'device estimate ' + target:32s} {describe_estimate(build['device_estimate'])}")
        if build.get("runtime") is not None:
            lines.append(f"  {'runtime ' + target:32s} {build['runtime']} ({build.get('runtime_reason')})")
    path = summary.get("quantize_path")
    if path:
        floats = f"; kept in float: {', '.join(path['float_layers'])}" if path["float_layers"] else ""
        scheme = f", {path['activation_scheme']} activations" if "activation_scheme" in path else ""
        how = "" if path["produced_by"] == "qat" else (f" ({path['method']}"
                                                       f"{', per-channel' if path['per_channel'] else ''}{scheme})")
        lines.append(f"  {'int8 made by':32s} {path['produced_by']}{how}{floats}")
    for name, path in summary["artifacts"].items():
        lines.append(f"  {name:32s} {path}")
    lines.append(f"  summary                          {Path(summary['out_dir']) / SUMMARY_JSON}")
    lines.append(f"  index                            {Path(summary['out_dir']) / INDEX_HTML}")
    return "\n".join(lines)


def index_html(summary: dict, results: Results) -> str:
    """OUT/index.html: the summary's figures, then one row per stage linking its reports and directory."""
    out = Path(summary["out_dir"])
    rows = []
    for name, result in results.items():
        links = [f'<a href="{html.escape(_href(p, out))}">{html.escape(p.name)}</a>' for p in html_reports(result)]
        ran = "ran" if name in summary["ran"] else "unchanged"
        rows.append(f'<tr><td>{html.escape(name)}</td><td>{ran}</td><td>{", ".join(links) or "-"}</td>'
                    f'<td><a href="{html.escape(_href(Path(result.out_dir), out))}/">{html.escape(_href(Path(result.out_dir), out))}/</a></td></tr>')
    figures = [f"<tr><td>{html.escape(k)}</td><td>{_shown(k, v)}</td></tr>" for k, v in summary["accuracy"].items()]
    figures += [f"<tr><td>size {html.escape(k)}</td><td>{v / 1024:.1f} KiB</td></tr>"
                for k, v in summary["sizes_bytes"].items()]
    figures += [f"<tr><td>latency {html.escape(k)}</td><td>{v:.3f} ms</td></tr>" for k, v in summary["latency_ms"].items()]
    metric, label = summary.get("task", {}).get("metric", "top1"), summary.get("task", {}).get("metric_label", "top-1")
    tops = [(k.replace(f"_{metric}", ""), 100 * v) for k, v in summary["accuracy"].items()
            if k.endswith(f"_{metric}") and "drop" not in k and isinstance(v, (int, float))]
    body = (f"<p>{html.escape(summary['config'])}: {len(summary['ran'])} of {len(rows)} stages ran, "
            f"{summary['seconds']} s.</p>" + _path_html(summary.get("quantize_path"))
            + (bars_svg(f"{label} at each stage", "%", tops, "{:.2f}") if tops else "")
            + "<h2>Figures</h2><table>" + "".join(figures) + "</table>"
            + "<h2>Stages</h2><table><tr><th>stage</th><th>this run</th><th>reports</th><th>directory</th></tr>"
            + "".join(rows) + "</table>")
    gate = summary.get("quality_gate")
    return page("Pipeline", "appliance pipeline", SUMMARY_JSON, None if gate is None else bool(gate["passed"]), body)


def _path_html(path: dict | None) -> str:
    """Which path made the edge model: ptq, ptq+fallback (the float layers), or qat."""
    if not path:
        return ""
    floats = f" keeping {len(path['float_layers'])} layers in float: " + ", ".join(
        f"<code>{html.escape(n)}</code>" for n in path["float_layers"]) if path["float_layers"] else ""
    qat = path.get("qat")
    drop = next((k for k in qat or {} if k.endswith("_drop_points")), None)  # top1_drop_points, miou_drop_points
    tried = (f" (QAT ran: drop {qat[drop]:.2f} points against PTQ's {path[f'ptq_{drop}']:.2f})" if drop else "")
    return f"<p>INT8 edge model made by <b>{html.escape(path['produced_by'])}</b>{floats}{tried}.</p>"


def _href(path: Path, out: Path) -> str:
    return Path(os.path.relpath(path, out)).as_posix()


def _is_share(key: str) -> bool:
    """A figure shown in percent: top-1, mIoU, pixel accuracy, agreement (not a drop in points)."""
    return any(word in key for word in ("top1", "agreement", "miou", "pixel_acc")) and "drop" not in key


def _shown(key: str, value) -> str:
    if isinstance(value, (int, float)) and _is_share(key):
        return f"{100 * value:.2f} %"
    return html.escape(f"{value:.4g}" if isinstance(value, float) else str(value))
