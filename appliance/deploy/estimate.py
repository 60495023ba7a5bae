"""`appliance edge estimate`: how fast an architecture will run on the device, before any training.

Each architecture is built untrained (latency does not depend on the weights), exported, quantized
to S8S8 QDQ INT8 with random calibration, compiled for the aarch64 target in FP32 and INT8, and each
build's cycles per inference are estimated on Cortex-A76 and Cortex-A55 (edge/cycles.py). The table
(estimate.json + estimate.html) gives parameters, library sizes, int8 kernel coverage (layers on our
kernels vs TVM's generic ones, from compile.json's counts), the estimated ms at stated clocks of our
builds and of onnxruntime on the same FP32 and INT8 models (compile's comparison), and which runtime a
package of each would use (`--runtime auto`).
The pipeline runs it for its architecture when `[deploy] latency_budget_ms` is set.
"""

from __future__ import annotations

import html
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from appliance.core.errors import ConfigError, EnvironmentProblem
from appliance.core.html_report import bars_svg, page, table_html
from appliance.core.manifest import atomic_write_text
from appliance.deploy.compiler.driver import compile_model
from appliance.deploy.edge.cycles import CLOCKS_HZ, METHOD, describe, not_estimated
from appliance.deploy.export import export_model
from appliance.deploy.options import estimate_problem
from appliance.deploy.quantize import quantize_int8
from appliance.models import ModelCard, build_model, save_trained_model

ESTIMATE_JSON, ESTIMATE_HTML = "estimate.json", "estimate.html"


def estimate_architecture(arch: str, target: str, size: int, work: Path, *, classes: int = 1000, log=print) -> dict:
    """One table row: the untrained arch's FP32 and INT8 builds for target, each with its device estimate."""
    start = time.perf_counter()
    try:
        model = build_model(arch, classes).eval()
    except ConfigError as err:
        raise ConfigError(f"--architectures {arch}: {err}") from None
    parameters = sum(p.numel() for p in model.parameters())
    save_trained_model(work / "model", model, ModelCard(arch, classes, 3, size))
    export_model(work, work / "export", batch=1, max_rel_error=1e-4)
    fp32, int8 = work / "export" / "model.onnx", work / "model.int8.onnx"
    calib = np.random.default_rng(0).standard_normal((4, 3, size, size)).astype(np.float32)
    quantize_int8(fp32, int8, calib, "input", "minmax", per_channel=True)
    row = {"architecture": arch, "parameters": parameters, "size": size, "target": target}
    for precision, source in (("fp32", fp32), ("int8", int8)):
        info = compile_model(source, target, work / precision, device_estimate=True, log=lambda line: None)
        total, kernels = info["layers"].get("int8", 0), info["int8_kernels"]
        ours = kernels.get("layers", 0) + kernels.get("depthwise", 0)
        row[precision] = {"library_bytes": info["library_bytes"], "device_estimate": info["device_estimate"],
                          "int8_layers": total, "int8_on_our_kernels": ours, "int8_generic": total - ours,
                          "int8_kernel_kind": kernels.get("kind"), "runtime": info["runtime"],
                          "runtime_reason": info["runtime_reason"],
                          # onnxruntime on the same ONNX model, estimated the same way (compile's comparison)
                          "onnxruntime": onnxruntime_estimate(info["onnxruntime_comparison"])}
        log(f"  {arch} {precision}: {describe(info['device_estimate'])}")
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def estimate_architectures(archs, target: str, size: int, out_dir=None, *, classes: int = 1000, log=print,
                           names=("--architectures", "--size", "--classes")) -> dict:
    """The table for archs; written as estimate.json + estimate.html into out_dir when given. Names, size
    and classes are checked first (options.estimate_problem, its line naming the flags or keys in names)."""
    problem = estimate_problem(list(archs), size, classes, names=names)
    if problem:
        raise ConfigError(problem)
    if not target.startswith("aarch64"):
        raise ConfigError(f"--target {target}: the estimate is for the device's cores (aarch64, aarch64-dotprod)")
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="edge-estimate-") as tmp:
        for number, arch in enumerate(archs):
            log(f"{arch} at {size} px for {target}: building FP32 and INT8 (untrained, random calibration)")
            work = Path(tmp) / str(number)  # never a path made of what the user typed
            work.mkdir()
            rows.append(estimate_architecture(arch, target, size, work, classes=classes, log=log))
    table = {"made_by": "appliance edge estimate", "target": target, "size": size, "classes": classes, "method": METHOD,
             "clocks_ghz": {cpu: hz / 1e9 for cpu, hz in CLOCKS_HZ.items()}, "rows": rows,
             "seconds": round(time.perf_counter() - start, 1)}
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / ESTIMATE_JSON, json.dumps(table, indent=2) + "\n")
        atomic_write_text(out_dir / ESTIMATE_HTML, estimate_html(table))
    return table


def onnxruntime_estimate(comparison: dict) -> dict:
    """compile.json's onnxruntime figures as a device_estimate, or why there are none."""
    if not comparison.get("ratios"):
        return not_estimated(comparison.get("reason", "not compared"))
    return {"estimated": True, "method": comparison["method"], **comparison["onnxruntime"]}


def ms(build: dict, cpu: str) -> float | None:
    device = build["device_estimate"]
    return device[cpu]["ms"] if device.get("estimated") else None


def table_rows(table: dict) -> tuple[list[str], list[list[str]], list[str]]:
    """(header, rows, reasons a build was not estimated): what the printed table and estimate.html show."""
    cpus = list(CLOCKS_HZ)
    head = ["architecture", "params (M)", "FP32 lib MB", "INT8 lib MB", "int8 layers ours/generic",
            *(f"{who} {p} {cpu} ms ({table['clocks_ghz'][cpu]:g} GHz)" for p in ("FP32", "INT8") for who in ("TVM", "ORT")
              for cpu in cpus), "package runs FP32 / INT8"]
    rows = []
    for r in table["rows"]:
        cells = [r["architecture"], f"{r['parameters'] / 1e6:.2f}", f"{r['fp32']['library_bytes'] / 1e6:.1f}",
                 f"{r['int8']['library_bytes'] / 1e6:.1f}", f"{r['int8']['int8_on_our_kernels']}/{r['int8']['int8_generic']}"]
        for p in ("fp32", "int8"):
            for build in (r[p], {"device_estimate": r[p].get("onnxruntime") or not_estimated("not compared")}):
                cells += [f"{ms(build, cpu):.2f}" if ms(build, cpu) is not None else "not estimated" for cpu in cpus]
        cells.append(f"{r['fp32'].get('runtime', 'tvm')} / {r['int8'].get('runtime', 'tvm')}")
        rows.append(cells)
    reasons = {describe(r[p]["device_estimate"]) for r in table["rows"] for p in ("fp32", "int8")
               if not r[p]["device_estimate"].get("estimated")}
    return head, rows, sorted(reasons)


def format_table(table: dict) -> str:
    head, rows, reasons = table_rows(table)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines + reasons)


def _columns(head: list[str], rows: list[list[str]], keep: list[int]) -> tuple[list[str], list[list[str]]]:
    """Those columns of the table: estimate.html shows sizes and speeds as two tables, since one with every
    TVM and onnxruntime column ran past a 1,280 px page."""
    return [head[i] for i in keep], [[row[i] for i in keep] for row in rows]


def estimate_html(table: dict) -> str:
    head, rows, reasons = table_rows(table)
    bars = [(f"{r['architecture']} {who} {p}", ms(build, "cortex-a76")) for r in table["rows"] for p in ("fp32", "int8")
            for who, build in (("TVM", r[p]), ("ORT", {"device_estimate": r[p].get("onnxruntime") or {}}))]
    chart = bars_svg(f"estimated ms per inference, Cortex-A76 at {table['clocks_ghz']['cortex-a76']:g} GHz", "ms",
                     [(label, v) for label, v in bars if v is not None], "{:.1f}")
    body = (f"<p>{html.escape(table['target'])}, {table['size']} px, batch 1, one thread; {html.escape(table['method'])}."
            f" Estimates, not timings (benchmarks/README.md says how close they come).</p>{chart}"
            f"{table_html(*_columns(head, rows, [*range(5), len(head) - 1]))}"
            f"{table_html(*_columns(head, rows, [0, *range(5, len(head) - 1)]))}"
            + "".join(f"<p>{html.escape(reason)}</p>" for reason in reasons))
    return page("Estimated device speed", "appliance edge estimate", ESTIMATE_JSON, None, body)


def estimate_once(out_dir: Path, arch: str, target: str, size: int, classes: int, log=print) -> dict:
    """The table of one architecture, kept in out_dir (estimate.json) and reused while arch, size, classes
    and target stay; `appliance edge estimate --out out_dir` makes one too."""
    kept = Path(out_dir) / ESTIMATE_JSON
    try:
        table = json.loads(kept.read_text()) if kept.is_file() else {}
        same = ([r["architecture"] for r in table["rows"]] == [arch] and
                (table["target"], table["size"], table["classes"]) == (target, size, classes)) if table else False
    except (ValueError, KeyError, TypeError):
        same = False  # not a table of ours: made again
    if same:
        log(f"latency budget: the estimate kept in {kept}")
        return table
    log(f"latency budget: estimating {arch} at {size} px for {target} before training")
    return estimate_architectures([arch], target, size, out_dir, classes=classes, log=log,
                                  names=("[model] architecture", "[data] image_size (for [deploy] latency_budget_ms)",
                                         "[model] num_classes"))


def check_latency_budget(table: dict, budget_ms: float, core: str, precision: str) -> float:
    """The estimated ms of the table's first row on core; one ConfigError line when it exceeds the budget,
    one EnvironmentProblem line when it could not be estimated here."""
    row = table["rows"][0]
    estimate = ms(row[precision], core)
    if estimate is None:
        raise EnvironmentProblem(f"[deploy] latency_budget_ms: {row['architecture']} cannot be estimated here "
                                 f"({describe(row[precision]['device_estimate'])})")
    if estimate > budget_ms:
        raise ConfigError(f"[deploy] latency_budget_ms {budget_ms:g}: {row['architecture']} {precision} at "
                          f"{row['size']} px is estimated at {estimate:.2f} ms on {core} ({CLOCKS_HZ[core] / 1e9:g} "
                          "GHz), over the budget; nothing was trained (try a smaller architecture or size)")
    return estimate
