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
from appliance.core.stage import html_reports
from appliance.deploy.edge.cycles import describe as describe_estimate
from appliance.pipeline.config import PipelineConfig
from appliance.pipeline.plan import Results

SUMMARY_JSON = "summary.json"
INDEX_HTML = "index.html"


def build_summary(cfg: PipelineConfig, results: Results, ran: list[str], seconds: float) -> dict:
    """Accuracy at each stage, sizes, latencies, where every artifact is, and the lineage."""
    summary = {"made_by": "appliance pipeline", "config": str(cfg.source), "out_dir": str(cfg.out_dir),
               "seconds": round(seconds, 1), "ran": ran, "stages": {n: r.figures() for n, r in results.items()},
               "accuracy": {}, "sizes_bytes": {}, "latency_ms": {}, "artifacts": {}}
    accuracy = summary["accuracy"]
    train, gate, quantized = results.train, results.gate, results.quantize
    if train is not None and train.val_acc is not None:
        accuracy["train_val_top1"] = train.val_acc
    if gate is not None and "val_acc" in gate.quality:
        accuracy["val_majority_baseline_top1"] = gate.quality["majority_baseline"]
        accuracy["quality_gate_required_top1"] = gate.quality["required_val_acc"]
        summary["quality_gate"] = {"passed": gate.quality["passed"], "line": gate.quality.get("line", "")}
    if quantized is not None:
        q = quantized.report
        accuracy["fp32_top1"] = q["fp32"]["top1"]
        accuracy[f"{q['mode']}_top1"] = q["quantized"]["top1"]
        accuracy["quantized_top1_drop_points"] = q["top1_drop_points"]
        if q["mode"] == "int8":  # which path made the model the edge runs (fallback: which layers stayed float)
            summary["quantize_path"] = {"produced_by": q.get("produced_by", "ptq"), "method": q.get("method"),
                                        "per_channel": q.get("per_channel", False), "float_layers": q.get("float_layers", [])}
        summary["sizes_bytes"].update({"onnx_fp32": q["fp32"]["bytes"], f"onnx_{q['mode']}": q["quantized"]["bytes"]})
        summary["latency_ms"].update({"host_ort_fp32": q["fp32"]["latency_ms_median"],
                                      f"host_ort_{q['mode']}": q["quantized"]["latency_ms_median"]})
    elif train is not None and train.val_acc is not None:
        accuracy["fp32_top1"] = train.val_acc
    if results.verify is not None:
        add_verify_figures(summary, results.verify.report)
    for target, build in results.compiled.items():  # what each build computes: int8 or simulated, size, speed
        summary.setdefault("builds", {})[target] = {
            k: build.info.get(k) for k in ("int8_compute", "layers", "int8_kernels", "fp32_kernels", "tuned_tasks",
                                           "library_bytes", "host_latency_ms", "device_estimate")}
    if results.package is not None:
        summary["sizes_bytes"]["edge_package"] = results.package.bytes
        summary["lineage"] = lineage(results.package.out_dir, results.check)
    for name, result in results.items():
        summary["artifacts"][name] = str(result.out_dir)
    return summary


def add_verify_figures(summary: dict, report: dict) -> None:
    """The edge verification's figures: agreement, accuracy and (emulated, never gated) speed."""
    route = report["routes"][0]
    summary["accuracy"]["edge_agreement_with_host"] = route["top1_agreement"]
    if "top1" in route:
        summary["accuracy"]["edge_top1"] = route["top1"]
    summary["accuracy"]["edge_max_logit_diff"] = route["max_logit_diff"]
    summary["latency_ms"]["edge_qemu_per_sample"] = round(1000 * route["seconds"] / max(1, report["samples"]), 2)
    summary["verified_samples"] = report["samples"]
    selftest, bench = report.get("selftest"), report.get("bench")
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
        shown = f"{100 * value:.2f} %" if ("top1" in key or "agreement" in key) and "drop" not in key else f"{value:.4g}"
        lines.append(f"  {key:32s} {shown}")
    for key, value in summary["sizes_bytes"].items():
        lines.append(f"  size {key:27s} {value / 1024:.1f} KiB")
    for key, value in summary["latency_ms"].items():
        lines.append(f"  latency {key:24s} {value:.3f} ms")
    for target, build in summary.get("builds", {}).items():
        if build.get("device_estimate") is not None:
            lines.append(f"  {'device estimate ' + target:32s} {describe_estimate(build['device_estimate'])}")
    path = summary.get("quantize_path")
    if path:
        floats = f"; kept in float: {', '.join(path['float_layers'])}" if path["float_layers"] else ""
        lines.append(f"  {'int8 made by':32s} {path['produced_by']} ({path['method']}"
                     f"{', per-channel' if path['per_channel'] else ''}){floats}")
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
    tops = [(k.replace("_top1", ""), 100 * v) for k, v in summary["accuracy"].items()
            if k.endswith("_top1") and "drop" not in k and isinstance(v, (int, float))]
    body = (f"<p>{html.escape(summary['config'])}: {len(summary['ran'])} of {len(rows)} stages ran, "
            f"{summary['seconds']} s.</p>"
            + (bars_svg("top-1 at each stage", "%", tops, "{:.2f}") if tops else "")
            + "<h2>Figures</h2><table>" + "".join(figures) + "</table>"
            + "<h2>Stages</h2><table><tr><th>stage</th><th>this run</th><th>reports</th><th>directory</th></tr>"
            + "".join(rows) + "</table>")
    gate = summary.get("quality_gate")
    return page("Pipeline", "appliance pipeline", SUMMARY_JSON, None if gate is None else bool(gate["passed"]), body)


def _href(path: Path, out: Path) -> str:
    return Path(os.path.relpath(path, out)).as_posix()


def _shown(key: str, value) -> str:
    if isinstance(value, (int, float)) and ("top1" in key or "agreement" in key) and "drop" not in key:
        return f"{100 * value:.2f} %"
    return html.escape(f"{value:.4g}" if isinstance(value, float) else str(value))
