"""Host CPU latency of the deploy routes, side by side in one process run.

    PYTHONPATH=. .venv/bin/python benchmarks/deploy.py [--models resnet18 mobilenet_v2] [--runs 20]

For each model at 1x3x224x224 (untrained weights; latency does not depend on them): onnxruntime
FP32, onnxruntime INT8 (S8S8 QDQ, `appliance quantize`'s default, and U8S8 with
reduce_range, its `--scheme u8s8`), the TVM host build (as
`appliance compile --target x86_64` makes it, untuned) and, for the models in --tune-models, the
TVM build tuned by `appliance compile --tune N` (N = --tune-trials trials per task; the tuning
time is printed). Prints median latency, ratios against
onnxruntime FP32 and file sizes. Targets from the issue: INT8 <= 0.6x FP32, TVM <= 1.0x ORT FP32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def interleaved_medians(fns: dict, runs: int, budget_s: float = 90.0) -> dict:
    """Median ms per function, timed round-robin (one call of each per round) so that load from
    other processes on a shared machine hits every route alike; 2 warm-up rounds; a route stops
    after 5 calls once it has used budget_s (untuned TVM is slow)."""
    for _ in range(2):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    spent = dict.fromkeys(fns, 0.0)
    for _ in range(runs):
        for name, fn in fns.items():
            if len(times[name]) >= 5 and spent[name] > budget_s:
                continue
            t = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t
            spent[name] += elapsed
            times[name].append(elapsed * 1000)
    return {name: (statistics.median(t), len(t)) for name, t in times.items()}


def bench_model(arch: str, work: Path, runs: int, tune_trials: int = 0) -> dict:
    import tvm
    from tvm import relax

    from appliance.deploy.compile import compile_model
    from appliance.deploy.export import export_model
    from appliance.deploy.onnx_model import ort_session
    from appliance.deploy.quantize import quantize_int8
    from appliance.models import ModelCard, build_model, save_trained_model

    card = ModelCard(arch, 1000, 3, 224)
    save_trained_model(work / "model", build_model(arch, 1000), card)
    export_model(work, work / "export", batch=1, max_rel_error=1e-4)
    fp32 = work / "export" / "model.onnx"
    rng = np.random.default_rng(0)
    calib = rng.standard_normal((16, 3, 224, 224)).astype(np.float32)
    int8 = work / "model.int8.onnx"
    quantize_int8(fp32, int8, calib, "input", "minmax", per_channel=False)
    u8 = work / "model.u8s8.onnx"
    quantize_int8(fp32, u8, calib, "input", "minmax", per_channel=False, scheme="u8s8")
    start = time.perf_counter()
    info = compile_model(fp32, "x86_64", work / "tvm")
    compile_s = time.perf_counter() - start
    tuned = None
    if tune_trials:
        tuned = compile_model(fp32, "x86_64", work / "tvm-tuned", tune_trials=tune_trials,
                              log=lambda line: print(f"  {arch}: {line}", flush=True))

    x = calib[:1]
    s_fp32, s_int8, s_u8 = ort_session(fp32), ort_session(int8), ort_session(u8)
    ref = s_fp32.run(None, {"input": x})[0]

    def rel_err(session):
        return float(abs(session.run(None, {"input": x})[0] - ref).max() / abs(ref).max())

    vm = relax.VirtualMachine(tvm.runtime.load_module(str(work / "tvm" / "model.so")), tvm.cpu())
    x_tvm = tvm.runtime.tensor(x)
    routes = {"ort_fp32": lambda: s_fp32.run(None, {"input": x}),
              "ort_int8": lambda: s_int8.run(None, {"input": x}),
              "ort_u8s8": lambda: s_u8.run(None, {"input": x}),
              "tvm": lambda: vm["main"](x_tvm)}
    if tuned:
        vm_tuned = relax.VirtualMachine(tvm.runtime.load_module(str(work / "tvm-tuned" / "model.so")), tvm.cpu())
        routes["tvm_tuned"] = lambda: vm_tuned["main"](x_tvm)
    medians = interleaved_medians(routes, runs)
    (ort_fp32, n1), (ort_int8, n2), (tvm_ms, n3) = medians["ort_fp32"], medians["ort_int8"], medians["tvm"]
    ort_u8 = medians["ort_u8s8"][0]
    return {"model": arch, "ort_fp32_ms": ort_fp32, "ort_int8_ms": ort_int8, "tvm_ms": tvm_ms,
            "ort_u8s8_ms": ort_u8, "u8s8_ratio": ort_u8 / ort_fp32,
            "int8_rel_err": rel_err(s_int8), "u8s8_rel_err": rel_err(s_u8),
            "runs": [n1, n2, n3], "int8_ratio": ort_int8 / ort_fp32, "tvm_ratio": tvm_ms / ort_fp32,
            "fp32_mb": fp32.stat().st_size / 1e6, "int8_mb": int8.stat().st_size / 1e6,
            "tvm_mb": (work / "tvm" / "model.so").stat().st_size / 1e6, "tvm_compile_s": compile_s,
            "tvm_max_abs_diff_vs_ort": info["check"]["max_abs_diff"],
            **({"tvm_tuned_ms": medians["tvm_tuned"][0], "tvm_tuned_ratio": medians["tvm_tuned"][0] / ort_fp32,
                "tune_trials_per_task": tune_trials, "tune_tasks": tuned["tuning"]["tasks"],
                "tune_s": tuned["tuning"]["tuned_in_seconds"],
                "tvm_tuned_max_abs_diff_vs_ort": tuned["check"]["max_abs_diff"]} if tuned else {})}


def main() -> None:
    import onnxruntime

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--tune-models", nargs="*", default=["mobilenet_v2"],
                        help="models also compiled with `--tune` (a tuned TVM column)")
    parser.add_argument("--tune-trials", type=int, default=8, help="MetaSchedule trials per task")
    args = parser.parse_args()
    import os

    print(f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (a shared machine inflates every "
          f"figure alike; compare ratios); onnxruntime {onnxruntime.__version__}; TVM untuned (default Relax pipeline)")
    results = []
    for arch in args.models:
        with tempfile.TemporaryDirectory(prefix=f"bench-{arch}-") as tmp:
            results.append(bench_model(arch, Path(tmp), args.runs,
                                       args.tune_trials if arch in args.tune_models else 0))
        r = results[-1]
        print(f"{arch:>13}  ORT FP32 {r['ort_fp32_ms']:8.2f} ms | ORT INT8 S8S8 {r['ort_int8_ms']:8.2f} ms "
              f"(x{r['int8_ratio']:.2f}, target <= 0.6, rel err {r['int8_rel_err']:.3f}) | ORT INT8 U8S8-rr "
              f"{r['ort_u8s8_ms']:8.2f} ms (x{r['u8s8_ratio']:.2f}, rel err {r['u8s8_rel_err']:.3f}) | TVM {r['tvm_ms']:9.2f} ms (x{r['tvm_ratio']:.2f}, "
              f"target <= 1.0) | sizes FP32 {r['fp32_mb']:.1f} MB, INT8 {r['int8_mb']:.1f} MB, "
              f"TVM .so {r['tvm_mb']:.1f} MB | TVM compile {r['tvm_compile_s']:.0f} s, runs {r['runs']}", flush=True)
        if "tvm_tuned_ms" in r:
            print(f"{arch:>13}  TVM tuned {r['tvm_tuned_ms']:9.2f} ms (x{r['tvm_tuned_ratio']:.2f} ORT FP32, "
                  f"x{r['tvm_ms'] / r['tvm_tuned_ms']:.1f} faster than untuned) after {r['tune_s']:.0f} s of tuning, "
                  f"{r['tune_trials_per_task']} trials x {r['tune_tasks']} tasks; max abs diff vs ORT "
                  f"{r['tvm_tuned_max_abs_diff_vs_ort']:.2g}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
