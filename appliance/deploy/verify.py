"""`appliance edge verify`: check an edge package's signature (the site key, or --pubkey) and
checksums, then run its native runner under qemu-aarch64 and compare its logits with the host's
onnxruntime on the same samples, before the package leaves the building.
It also runs the package's own `bin/run --selftest` (golden samples, gated) and `bin/run --bench`
(latency under emulation: reported, never gated, since qemu says nothing about ARM speed).

A segmentation package (model.json "task") is compared per pixel: the share of pixels whose class
agrees between device and host (gate: the task's 0.995 unless --min-agreement), the mIoU of both
against the samples' masks, and the runner's PNG class maps decoded and checked against its logits."""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.deploy.edge.qemu import DEFAULT_SYSROOT, check_sysroot, find_qemu, run_counting_samples, run_json
from appliance.deploy.edge.cycles import describe as describe_estimate, not_estimated
from appliance.deploy.edge.signing import trusted_key
from appliance.deploy.edge.unpack import unpack_checked
from appliance.core.errors import DataError, GateFailed
from appliance.deploy.options import BENCH_RUNS
from appliance.deploy.edge.sysroot import build_python_sysroot, default_debs_dir, run_python_runner, run_python_selftest
from appliance.deploy.onnx_model import default_tolerance, ort_session, run_ort
from appliance.deploy.samples import check_input_shape, load_samples, synthetic_samples
from appliance.deploy.tolerance import qdq_allowance
from appliance.core.manifest import atomic_write_text, write_manifest
from appliance.core.html_report import PALETTE, columns_svg, page
from appliance.core.stage import Figures, flat_figures, read_result_json
from data_tools.preprocessing import PREPROCESSING_KEYS
from appliance.tasks import task_of_metadata
from appliance.deploy.verify_pixels import check_class_maps, pixel_figures, segmentation_html
from appliance.deploy.openvino_route.server_verify import RUNNER as SERVER_RUNNER, is_server_package, run_server_runner
from appliance.deploy.openvino_route.server_verify import selftest_and_bench as server_selftest_and_bench

VERIFY_JSON = "verify.json"
VERIFY_HTML = "verify.html"

if TYPE_CHECKING:
    import numpy as np

BENCH_WARMUP = 3


def selftest_line(t: dict) -> str:
    runner = t.get("runner", "bin/run --selftest (qemu-aarch64)")  # a server package's run.py names itself
    if "error" in t:
        return f"{runner}: {t['samples']} golden samples: {t['error']}: FAIL"
    diff = "nan" if t["max_abs_diff"] is None else f"{t['max_abs_diff']:.3g}"
    what = "pixel" if "pixel_agreement" in t else "top1"
    return (f"{runner}: {t['samples']} golden samples: {what.replace('1', '-1')} agreement "
            f"{t[f'{what}_agreement']:.4f}, max logit diff {diff} (allowed {t['allowed_abs_diff']:.3g}): "
            f"{'PASS' if t['passed'] else 'FAIL'}")


MAX_MODEL_JSON_BYTES = 16 << 20


def read_model_info(root: Path, package: Path) -> dict:
    """model.json as the runner and the checks need it; one line for anything else (it is signed,
    but a signer's tool can still write a bad one)."""
    import onnx
    from google.protobuf.message import DecodeError

    path = root / "model.json"
    what = f"{package}: model.json"
    if not path.is_file() or path.stat().st_size > MAX_MODEL_JSON_BYTES:
        raise DataError(f"{what}: missing or larger than {MAX_MODEL_JSON_BYTES} bytes")
    try:
        info = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise DataError(f"{what}: not UTF-8 text (byte {err.start})") from None
    except (ValueError, RecursionError) as err:
        raise DataError(f"{what}: not JSON ({str(err).splitlines()[0] if str(err) else type(err).__name__})") \
            from None
    inp = info.get("input") if isinstance(info, dict) else None
    shape = inp.get("shape") if isinstance(inp, dict) else None
    if not (isinstance(shape, list) and len(shape) == 4 and all(type(d) is int and 0 < d <= 1 << 16 for d in shape)
            and isinstance(inp.get("name"), str) and isinstance(info.get("preprocessing"), (dict, type(None)))):
        raise DataError(f"{what}: no valid input (name, shape [N, C, H, W] of positive sizes) and preprocessing")
    # null: a model compiled as it came (no `appliance export` metadata); it is fed tensors only
    problem = None if info["preprocessing"] is None else preprocessing_problem(info["preprocessing"], shape[1])
    if problem:
        raise DataError(f"{what}: preprocessing: {problem}")
    try:
        inputs = onnx.load(str(root / "reference" / "model.onnx"), load_external_data=False).graph.input
    except (OSError, ValueError, DecodeError) as err:
        raise DataError(f"{package}: reference/model.onnx: not a readable ONNX model "
                        f"({(str(err).splitlines() or [type(err).__name__])[0][:120]})") from None
    if not inputs:
        raise DataError(f"{package}: reference/model.onnx: the graph has no input")
    reference = [d.dim_value or None for d in inputs[0].type.tensor_type.shape.dim]
    if len(reference) != 4 or any(r is not None and r != d for r, d in zip(reference[1:], shape[1:])):
        said = ", ".join("N" if r is None else str(r) for r in reference)
        raise DataError(f"{what}: input shape {shape} is not the reference model's [{said}]")
    return info


def preprocessing_problem(pre: dict, channels: int) -> str | None:
    """What is wrong with model.json's preprocessing for an input of `channels` channels, or None."""
    missing = [k for k in PREPROCESSING_KEYS if k not in pre]
    if missing:
        return f"missing {', '.join(missing)} (it needs {', '.join(PREPROCESSING_KEYS)})"
    size, order = pre["image_size"], pre["channel_order"]
    if type(size) is not int or not 0 < size <= 1 << 16:
        return f"image_size {size!r} is not a whole number of pixels from 1 to {1 << 16}"
    if order not in ("RGB", "L"):
        return f"channel_order {order!r} is not \"RGB\" or \"L\""
    if channels != (3 if order == "RGB" else 1):
        return f"channel_order {order!r} does not give the input's {channels} channel(s)"
    for key in ("mean", "std"):
        value = pre[key]
        if not (isinstance(value, list) and len(value) == channels
                and all(type(v) in (int, float) and math.isfinite(v) for v in value)):
            return f"{key} {str(value)[:60]} is not a list of {channels} finite numbers"
    if not all(v > 0 for v in pre["std"]):
        return f"std {pre['std']} has a value that is not positive"
    return None


def run_native(root: Path, x: np.ndarray, sysroot: str) -> tuple[np.ndarray, float]:
    """Logits from bin/run under qemu-aarch64 for the whole batch in one process (a segmentation
    model's class maps go to verify-masks/)."""
    import numpy as np

    qemu, sysroot = find_qemu(), check_sysroot(sysroot)
    np.save(root / "verify-input.npy", x)
    start = time.perf_counter()
    returncode, stderr = run_counting_samples(
        [qemu, "-L", sysroot, str(root / "bin" / "run"), "--input", str(root / "verify-input.npy"),
         "--output", str(root / "verify-output.npy"), "--top-k", "1", "--masks", str(root / "verify-masks")],
        len(x), "native runner")
    seconds = time.perf_counter() - start
    if returncode != 0:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        raise DataError(f"{root / 'bin' / 'run'}: native runner failed under qemu (exit {returncode}): {tail}")
    return np.load(root / "verify-output.npy"), seconds


def run_selftest_and_bench(root: Path, sysroot: str, bench_runs: int) -> tuple[dict, dict | None]:
    """The package's own proof, as the device would run it: `bin/run --selftest` against the
    golden samples and the host outputs recorded at packaging, and `bin/run --bench` (emulated)."""
    run = [find_qemu(), "-L", check_sysroot(sysroot), str(root / "bin" / "run")]
    _, selftest = run_json([*run, "--selftest", "--json"], f"{root / 'bin' / 'run'} --selftest")
    bench = None
    if bench_runs > 0:
        _, bench = run_json([*run, "--bench", "--json", "--runs", str(bench_runs), "--warmup", str(BENCH_WARMUP)],
                            f"{root / 'bin' / 'run'} --bench", ok_codes=(0,))
        bench.update({"emulated": True, "gated": False,
                      "note": "qemu-aarch64 on an x86 host: says nothing about the device's latency"})
    return selftest, bench


def compare_with_host(runner: str, edge: np.ndarray, host: np.ndarray, seconds: float, package,
                      min_agreement: float, max_logit_diff: float, labels: np.ndarray | None = None,
                      min_allowed: float = 0.0, task=None) -> dict:
    """Agreement of the argmax over axis 1 (top-1 per sample, or the class per pixel of (N, K, H, W)
    logits: then also `pixel_agreement` and the mIoU of both against the masks)."""
    import numpy as np

    if edge.shape != host.shape:
        raise DataError(f"{package}: {runner} returned logits {edge.shape}, host {host.shape}")
    diff = float(np.abs(edge.astype(np.float64) - host).max())
    allowed = max(max_logit_diff * max(1.0, float(np.abs(host).max())), min_allowed)
    agreement = float((edge.argmax(1) == host.argmax(1)).mean())
    differs = (edge.argmax(1) != host.argmax(1)).reshape(len(host), -1).any(1)
    route = {"runner": runner, "seconds": round(seconds, 2), "top1_agreement": agreement, "max_logit_diff": diff,
             "allowed_logit_diff": allowed, "disagreeing_samples": [int(i) for i in np.flatnonzero(differs)],
             "max_logit_diff_per_sample": [float(v) for v in
                                           np.abs(edge.astype(np.float64) - host).reshape(len(host), -1).max(1)],
             "passed": bool(agreement >= min_agreement and diff <= allowed)}
    if task is not None and task.kind == "segmentation":
        route.update(pixel_figures(edge, host, labels, task))
    elif task is not None and task.kind == "detection":  # the device's boxes matched to the host's
        route.update({"box_agreement": task.agreement(edge, host), "passed": diff <= allowed})
        route["passed"] = bool(route["passed"] and route["box_agreement"] >= min_agreement)
        if labels is not None:
            route.update({"map50": task.score(edge, labels), "host_map50": task.score(host, labels)})
    elif labels is not None:  # the accuracy on ARM beside the host's on the same samples
        route.update({"top1": float((edge.argmax(1) == labels).mean()),
                      "host_top1": float((host.argmax(1) == labels).mean())})
    return route


def verify_package(package, *, sample_files=None, num_samples=32, min_agreement=None,
                   max_logit_diff=None, sysroot=DEFAULT_SYSROOT, out_dir=None,
                   python=False, sysroot_debs=None, bench_runs=BENCH_RUNS, pubkey=None) -> dict:
    """Returns the report: `routes` (per runner: top1_agreement, max_logit_diff, passed, ...),
    `selftest` (bin/run --selftest --json), `bench` (bin/run --bench --json, emulated, or None)
    and `passed` (every route and the self-test). min_agreement None: the task's (1.0 for
    classification's top-1, 0.995 of the pixels for segmentation)."""
    package = Path(package)
    pubkey = trusted_key(pubkey)
    with tempfile.TemporaryDirectory(prefix="edge-verify-") as tmp:
        try:
            root = unpack_checked(package, Path(tmp), pubkey)
            info = read_model_info(root, package)
            python = python or info.get("runtime") == "onnxruntime"  # the Python runner is what runs it
            if python and is_server_package(info):
                raise DataError(f"{package}: a server package's runner is python/run.py on this host, checked "
                                "without --python")
            if python and not (root / "python" / "run.py").is_file():
                raise DataError(f"{package}: has no Python runner (packaged without --with-python); "
                                "verify it without --python, or repackage with --with-python")
            run = _run_routes(root, info, package, sample_files, num_samples, min_agreement, max_logit_diff,
                              sysroot, python, sysroot_debs, bench_runs)
        except DataError as err:  # the package's files by their names in it, not in a folder that is gone
            if f"{tmp}/" not in str(err):
                raise
            raise DataError(f"{package}: " * (not str(err).startswith(f"{package}:"))
                            + str(err).replace(f"{tmp}/", "")) from None
    task, samples, routes, selftest = run["task"], run["samples"], run["routes"], run["selftest"]
    seg = {"task": task.kind, "agreement": "per pixel"} if task.kind == "segmentation" else {}
    report = {"made_by": "appliance edge verify", "package": str(package.resolve()), **seg,
              **({"runtime": info["runtime"]} if is_server_package(info) else {}),
              "samples": int(len(samples.x)), "sample_source": samples.source, "min_agreement": run["min_agreement"],
              "routes": routes, "glibc_floor": info.get("glibc_floor"), "selftest": selftest, "bench": run["bench"],
              "device_estimate": info.get("device_estimate") or not_estimated("the package's compile.json has none"),
              "signature": {"checked_with": str(pubkey)}, "runtime": info.get("runtime", "tvm"),
              **({"python_selftest": run["python_selftest"]} if run.get("python_selftest") else {}),
              "passed": all(r["passed"] for r in routes) and bool(selftest["passed"])
              and bool((run.get("python_selftest") or {"passed": True})["passed"])}
    if out_dir:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / VERIFY_JSON, json.dumps(report, indent=2) + "\n")
        atomic_write_text(out_dir / VERIFY_HTML, verify_html(report))
        write_manifest(out_dir, "verify", [package, *samples.files],
                       {"min_agreement": run["min_agreement"], "max_logit_diff": run["max_logit_diff"],
                        "sysroot": sysroot, "python": python, "bench_runs": bench_runs})
    return report


def _run_routes(root: Path, info: dict, package: Path, sample_files, num_samples, min_agreement, max_logit_diff,
                sysroot, python, sysroot_debs, bench_runs) -> dict:
    """The unpacked package's runners on the samples beside the host's onnxruntime, its self-test and bench."""
    import numpy as np

    shape, preprocessing = info["input"]["shape"], info["preprocessing"]
    task = task_of_metadata({"model_card": info.get("model_card")})
    if min_agreement is None:
        min_agreement = task.min_agreement
    min_allowed = 0.0
    if max_logit_diff is None:
        max_logit_diff = default_tolerance(info.get("precision", "fp32"))
        min_allowed = qdq_allowance(root / "reference" / "model.onnx")
    if sample_files:
        samples = load_samples(sample_files, preprocessing, limit=num_samples)
    else:
        samples = synthetic_samples(preprocessing, shape[1], 16, shape, package)
    check_input_shape(samples, shape, info["input"]["name"], package)
    host = run_ort(ort_session(root / "reference" / "model.onnx", optimize=False), samples.x)
    server = is_server_package(info)  # x86_64-openvino: its python/run.py on this host (openvino_route/)
    if server:
        edge, seconds = run_server_runner(root, samples.x)
    else:
        edge, seconds = run_native(root, samples.x, sysroot)
    if task.kind == "detection" and edge.size == host.size:  # bin/run writes each sample's raw outputs flat
        edge = edge.reshape(host.shape)
    routes = [compare_with_host(SERVER_RUNNER if server else "native runner (qemu-aarch64)", edge, host, seconds,
                                package, min_agreement, max_logit_diff, samples.y, min_allowed, task)]
    if task.kind == "segmentation":
        routes[0]["class_maps"] = check_class_maps(root, edge, package)
    if server:
        selftest, bench = server_selftest_and_bench(root, bench_runs)
    else:
        selftest, bench = run_selftest_and_bench(root, sysroot, bench_runs)
    python_selftest = None
    if python:
        debs = Path(sysroot_debs) if sysroot_debs else default_debs_dir()
        py_sysroot, site = build_python_sysroot(debs, root, root.parent / "python-sysroot")
        start = time.perf_counter()
        run_python_runner(root, py_sysroot, site, root / "verify-input.npy", root / "verify-python.npy",
                          len(samples.x))
        routes.append(compare_with_host("Python runner (arm64 python3.11 under qemu-aarch64)",
                                        np.load(root / "verify-python.npy"), host,
                                        time.perf_counter() - start, package, min_agreement, max_logit_diff,
                                        samples.y, min_allowed, task))
        routes[-1]["runtime"] = info.get("runtime", "tvm")
        if info.get("runtime") == "onnxruntime":  # the runtime the package uses proves itself on the device too
            python_selftest = run_python_selftest(root, py_sysroot, site)
    return {"task": task, "samples": samples, "routes": routes, "selftest": selftest, "bench": bench,
            "python_selftest": python_selftest,
            "min_agreement": min_agreement, "max_logit_diff": max_logit_diff}


def device_proof_html(report: dict) -> str:
    """The package's own self-test and (emulated) bench, as `bin/run` reported them."""
    import html

    parts = []
    if report.get("selftest"):
        parts.append(f"<p>{html.escape(selftest_line(report['selftest']))}</p>")
    if report.get("bench"):
        b = report["bench"]
        what = ("python/run.py --bench, LATENCY hint, on this host (not gated)" if "hints" in b
                else "bin/run --bench under qemu-aarch64 (emulated: not the device's latency, not gated)")
        parts.append(f"<p>{what}: "
                     f"{b['runs']} runs, median {b['median_ms']:.2f} ms, p90 {b['p90_ms']:.2f} ms, "
                     f"p99 {b['p99_ms']:.2f} ms, fluctuation {b['fluctuation']:.3f}</p>")
    if report.get("device_estimate") and report.get("runtime") != "openvino":
        parts.append(f"<p>Estimated on the device's cores (qemu block counts x llvm-mca, one thread, L1 hits only): "
                     f"{html.escape(describe_estimate(report['device_estimate']))}</p>")
    return "".join(parts)


def verify_html(report: dict) -> str:
    import html

    rows, charts = [], []
    for i, r in enumerate(report["routes"]):
        rows.append(f"<tr><td>{html.escape(r['runner'])}</td><td>{r['top1_agreement'] * 100:.2f}%</td>"
                    f"<td>{r['max_logit_diff']:.3g} (allowed {r['allowed_logit_diff']:.3g})</td>"
                    f"<td>{r['seconds']:.1f} s</td><td class=\"{'PASS' if r['passed'] else 'FAIL'}\">"
                    f"{'PASS' if r['passed'] else 'FAIL'}</td></tr>")
        charts.append(columns_svg(f"max |edge - host| logit per sample: {r['runner']}",
                                  r["max_logit_diff_per_sample"], r["allowed_logit_diff"], PALETTE[i % len(PALETTE)]))
    where = ("with the package's OpenVINO runner on this host" if report.get("runtime") == "openvino"
             else "inside the package under qemu-aarch64")
    body = (f"<p>{html.escape(report['package'])}: {report['samples']} {report['sample_source']} samples, each "
            f"run on the host with onnxruntime and {where}.</p>"
            f"<table><tr><th>runner</th><th>{'pixel' if report.get('task') == 'segmentation' else 'top-1'} agreement"
            "</th><th>max logit difference</th><th>time</th><th></th></tr>"
            + "".join(rows) + "</table>" + segmentation_html(report) + device_proof_html(report) + "".join(charts))
    return page("Edge package vs host", "appliance edge verify", VERIFY_JSON, report["passed"], body)


@dataclass(frozen=True)
class VerifyResult:
    out_dir: Path  # without --out (no report written): the package's directory
    report: dict

    @property
    def passed(self) -> bool:
        return bool(self.report["passed"])

    @classmethod
    def load(cls, out_dir: Path) -> "VerifyResult":
        return cls(Path(out_dir), read_result_json(Path(out_dir) / VERIFY_JSON))

    def figures(self) -> Figures:
        """verify.json flat ("samples", "passed", "routes.0.top1_agreement", "selftest.passed", ...)."""
        return flat_figures(self.report)


def verify_stage(package, out_dir: Path | None = None, *, sample_files=None, num_samples: int = 32,
                 min_agreement: float | None = None, on_result=None, **options) -> VerifyResult:
    """`appliance edge verify` and the pipeline's verify stage: run the package (a package stage's result or
    a tar) under qemu on samples and compare with the host; GateFailed (exit 3) when a runner disagrees or
    the on-device self-test fails. With out_dir, verify.json, verify.html and a manifest go there.
    on_result(result) is called before the gate (the CLI prints it). options: those of verify_package."""
    tar = Path(getattr(package, "package", package))
    report = verify_package(tar, sample_files=list(sample_files) if sample_files else None,
                            num_samples=num_samples or 1_000_000, min_agreement=min_agreement, out_dir=out_dir,
                            **options)
    result = VerifyResult.load(out_dir) if out_dir else VerifyResult(tar.parent, report)
    if on_result is not None:
        on_result(result)
    if not result.passed:
        failed = [r["runner"] for r in result.report["routes"] if not r["passed"]]
        selftest = result.report.get("selftest") or {}
        if selftest and not selftest.get("passed", False):
            failed.append("the on-device self-test")
        see = f" (see {Path(out_dir) / VERIFY_JSON})" if out_dir else ""
        raise GateFailed(f"{tar}: edge verification failed: {', '.join(failed) or 'see the report'}{see}")
    return result
