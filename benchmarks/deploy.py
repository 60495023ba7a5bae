"""Host CPU latency of the deploy routes, side by side in one process run.

    PYTHONPATH=. .venv/bin/python benchmarks/deploy.py [--models resnet18 mobilenet_v2] [--runs 20]

For each model at 1x3x224x224 (--size; untrained weights; latency does not depend on them):
onnxruntime FP32, onnxruntime INT8 (S8S8 QDQ, `appliance quantize`'s default, and U8S8 with
reduce_range, its `--scheme u8s8`), the TVM host builds as `appliance compile --target x86_64`
makes them, untuned: FP32, and int8 (the S8S8 QDQ model with int8 compute; where the host has
AVX-512 VNNI also the same build on TVM's generic kernels, `--int8-kernels generic`) and, for the models in
--tune-models, both tuned by `appliance compile --tune N` (N = --tune-trials trials per task; the
tuning time is printed). Prints median latency, the median over rounds of each route's ratio to
onnxruntime FP32 in that round (each route's figure in a round: the median of 5 calls after 2
warm-up calls), and file sizes. Targets from the issue: TVM int8 tuned <= 1.0x,
TVM FP32 tuned <= 1.5x ORT FP32.

Where the openvino wheel is installed, OpenVINO FP32 and INT8 run beside them: the same FP32 and
S8S8 QDQ ONNX models converted by `appliance compile --target openvino` (IR, float32 inference
precision, LATENCY hint, one synchronous request), and the median over rounds of TVM int8 / OpenVINO
INT8 is printed (the issue's goal: at most 1.0x). --threads N runs every route on N threads
(TVM_NUM_THREADS, onnxruntime's intra-op threads, OpenVINO's INFERENCE_NUM_THREADS); default: all
physical cores. TVM's pool is sized once per process, so one thread and all threads are two runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def interleaved_rounds(fns: dict, runs: int, budget_s: float = 90.0, calls: int = 5, warmup: int = 2) -> dict:
    """ms per call of each function: the median of `calls` calls after `warmup` untimed ones, one such
    block of each route per round, round-robin, so that load from other processes on a shared machine
    hits every route alike. The warm-up calls absorb what the route before left behind: its threads
    still spinning on the cores (onnxruntime's and TVM's pools both spin after a call) and its weights
    in the caches; timed alone, one call right after another route measured onnxruntime FP32 at
    14.9 ms where it runs 4.6-5.7 ms. A route stops after 5 rounds once it has used budget_s (untuned
    TVM on generic kernels is slow): None for its later rounds."""
    times = {name: [] for name in fns}
    spent = dict.fromkeys(fns, 0.0)
    for _ in range(runs):
        for name, fn in fns.items():
            done = [t for t in times[name] if t is not None]
            if len(done) >= 5 and spent[name] > budget_s:
                times[name].append(None)
                continue
            for _ in range(warmup):
                fn()
            block = []
            for _ in range(calls):
                t = time.perf_counter()
                fn()
                block.append(time.perf_counter() - t)
            spent[name] += sum(block)
            times[name].append(statistics.median(block) * 1000)
    return times


def summarise(times: dict, base: str = "ort_fp32") -> dict:
    """Per route: median ms, calls, and the median over rounds of (route ms / base ms in that round)."""
    out = {}
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, times[base]) if t is not None]
        done = [t for t in ts if t is not None]
        out[name] = {"ms": statistics.median(done), "rounds": len(done), "ratio": statistics.median(ratios)}
    return out


def ort_session_threads(path, spinning: bool, threads: int):
    """appliance's onnxruntime session (onnx_model.ort_session), on `threads` intra-op threads (0: all)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def openvino_routes(fp32: Path, int8: Path, work: Path, x, threads: int) -> tuple[dict, dict]:
    """OpenVINO FP32 and INT8 routes (IR made by `appliance compile --target openvino`'s code), and their figures."""
    from appliance.deploy.openvino_route.build import compile_openvino
    from appliance.deploy.openvino_route.run import compile_ir

    routes, figures = {}, {}
    for name, model in (("ov_fp32", fp32), ("ov_int8", int8)):
        info = compile_openvino(model, work / name, timing_s=0.2, log=lambda line: None)
        compiled = compile_ir(work / name / "model.xml", "LATENCY", threads or None)
        request = compiled.create_infer_request()
        routes[name] = lambda request=request: request.infer({0: x})
        figures[name] = {"max_abs_diff_vs_ort": info["check"]["max_abs_diff"], "layers": info["layers"],
                         "steps_vs_ort_qdq": info["check"]["max_quantized_units"]}
    return routes, figures


def bench_model(arch: str, work: Path, runs: int, tune_trials: int = 0, size: int = 224,
                ort_spinning: bool = True, threads: int = 0, openvino: bool = True, generic: bool = True) -> dict:
    import tvm
    from tvm import relax

    from appliance.deploy.compiler.driver import compile_model
    from appliance.deploy.export import export_model
    from appliance.deploy.onnx_model import ort_session
    from appliance.deploy.quantize import quantize_int8
    from appliance.models import ModelCard, build_model, save_trained_model

    card = ModelCard(arch, 1000, 3, size)
    save_trained_model(work / "model", build_model(arch, 1000), card)
    export_model(work, work / "export", batch=1, max_rel_error=1e-4)
    fp32 = work / "export" / "model.onnx"
    rng = np.random.default_rng(0)
    calib = rng.standard_normal((16, 3, size, size)).astype(np.float32)
    int8 = work / "model.int8.onnx"
    quantize_int8(fp32, int8, calib, "input", "minmax", per_channel=False)
    u8 = work / "model.u8s8.onnx"
    quantize_int8(fp32, u8, calib, "input", "minmax", per_channel=False, scheme="u8s8")
    start = time.perf_counter()
    info = compile_model(fp32, "x86_64", work / "tvm")
    compile_s = time.perf_counter() - start
    int8_info = compile_model(int8, "x86_64", work / "tvm-int8")  # int8 compute, as `appliance compile` does
    builds = {"tvm": work / "tvm", "tvm_int8": work / "tvm-int8"}
    if generic and int8_info["int8_kernels"]["kind"] != "generic":  # the same build on TVM's generic kernels
        compile_model(int8, "x86_64", work / "tvm-int8-generic", int8_kernels="generic")
        builds["tvm_int8_generic"] = work / "tvm-int8-generic"
    tuned = tuned_int8 = None
    if tune_trials:
        def log(line):
            print(f"  {arch}: {line}", flush=True)

        tuned = compile_model(fp32, "x86_64", work / "tvm-tuned", tune_trials=tune_trials, log=log)
        tuned_int8 = compile_model(int8, "x86_64", work / "tvm-int8-tuned", tune_trials=tune_trials, log=log)
        builds.update(tvm_tuned=work / "tvm-tuned", tvm_int8_tuned=work / "tvm-int8-tuned")

    x = calib[:1]
    # Spinning threads hold the cores the next route in the round needs (int8_gemm.py measured a
    # small TVM call 250x slower right after one); --ort-no-spin turns it off.
    s_fp32, s_int8, s_u8 = (ort_session_threads(m, ort_spinning, threads) if threads else
                            ort_session(m, spinning=ort_spinning) for m in (fp32, int8, u8))
    ref = s_fp32.run(None, {"input": x})[0]

    def rel_err(session):
        return float(abs(session.run(None, {"input": x})[0] - ref).max() / abs(ref).max())

    x_tvm = tvm.runtime.tensor(x)
    routes = {"ort_fp32": lambda: s_fp32.run(None, {"input": x}),
              "ort_int8": lambda: s_int8.run(None, {"input": x}),
              "ort_u8s8": lambda: s_u8.run(None, {"input": x})}
    for name, directory in builds.items():
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(directory / "model.so")), tvm.cpu())
        routes[name] = lambda vm=vm: vm["main"](x_tvm)
    ov_figures = {}
    if openvino:
        ov_routes, ov_figures = openvino_routes(fp32, int8, work, x, threads)
        routes.update(ov_routes)
    times = interleaved_rounds(routes, runs)
    routes = summarise(times)
    if openvino:  # the goal: TVM int8 at most 1.0x OpenVINO INT8 (median over rounds)
        routes["tvm_int8"]["ratio_to_ov_int8"] = summarise(times, base="ov_int8")["tvm_int8"]["ratio"]
        routes["tvm"]["ratio_to_ov_fp32"] = summarise(times, base="ov_fp32")["tvm"]["ratio"]
    result = {"model": arch, "routes": routes, "int8_rel_err": rel_err(s_int8), "u8s8_rel_err": rel_err(s_u8),
              "fp32_mb": fp32.stat().st_size / 1e6, "int8_mb": int8.stat().st_size / 1e6,
              "tvm_mb": (work / "tvm" / "model.so").stat().st_size / 1e6,
              "tvm_int8_mb": (work / "tvm-int8" / "model.so").stat().st_size / 1e6, "tvm_compile_s": compile_s,
              "tvm_max_abs_diff_vs_ort": info["check"]["max_abs_diff"],
              "tvm_int8_layers": int8_info["layers"], "tvm_int8_kernels": int8_info["int8_kernels"],
              "tvm_int8_steps_vs_ort_qdq": int8_info["check"]["max_quantized_units"], "openvino": ov_figures,
              "threads": threads or "all"}
    if tuned:
        result.update(tune_trials_per_task=tune_trials, tune_tasks=tuned["tuning"]["tasks"],
                      tune_s=tuned["tuning"]["tuned_in_seconds"], int8_tune_tasks=tuned_int8["tuning"]["tasks"],
                      int8_tune_s=tuned_int8["tuning"]["tuned_in_seconds"],
                      tvm_tuned_max_abs_diff_vs_ort=tuned["check"]["max_abs_diff"])
    return result


LABELS = {"ort_fp32": "ORT FP32", "ort_int8": "ORT INT8 S8S8", "ort_u8s8": "ORT INT8 U8S8-rr",
          "tvm": "TVM FP32", "tvm_int8": "TVM int8", "tvm_int8_generic": "TVM int8 generic kernels", "tvm_tuned": "TVM FP32 tuned", "tvm_int8_tuned": "TVM int8 tuned",
          "ov_fp32": "OpenVINO FP32", "ov_int8": "OpenVINO INT8"}


def main() -> None:
    import onnxruntime

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--size", type=int, default=224, help="input height and width")
    parser.add_argument("--tune-models", nargs="*", default=["mobilenet_v2"],
                        help="models also compiled with `--tune` (a tuned TVM column)")
    parser.add_argument("--tune-trials", type=int, default=8, help="MetaSchedule trials per task")
    parser.add_argument("--ort-no-spin", action="store_true",
                        help="onnxruntime threads do not spin after a call (session.intra_op.allow_spinning=0)")
    parser.add_argument("--threads", type=int, default=0,
                        help="threads of every route (default 0: all physical cores); run twice for 1 and all")
    parser.add_argument("--no-openvino", action="store_true", help="leave out the OpenVINO routes")
    parser.add_argument("--no-generic", action="store_true",
                        help="leave out TVM int8 on generic kernels (slow to compile and run)")
    args = parser.parse_args()
    import importlib.util
    import os

    from appliance.deploy.compiler.runtime import use_physical_cores

    if args.threads:
        os.environ["TVM_NUM_THREADS"] = str(args.threads)
    use_physical_cores()  # as `appliance compile` runs TVM: all physical cores (TVM alone halves them on x86_64)
    openvino = not args.no_openvino and importlib.util.find_spec("openvino") is not None
    print(f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (a shared machine inflates every "
          f"figure alike; compare ratios); onnxruntime {onnxruntime.__version__}"
          f"{' (threads not spinning)' if args.ort_no_spin else ''}; TVM on {os.environ.get('TVM_NUM_THREADS')} "
          "threads (TVM_NUM_THREADS)")
    results = []
    for arch in args.models:
        with tempfile.TemporaryDirectory(prefix=f"bench-{arch}-") as tmp:
            results.append(bench_model(arch, Path(tmp), args.runs,
                                       args.tune_trials if arch in args.tune_models else 0, args.size,
                                       ort_spinning=not args.ort_no_spin, threads=args.threads, openvino=openvino,
                                       generic=not args.no_generic))
        r = results[-1]
        cells = " | ".join(f"{LABELS[name]} {v['ms']:.2f} ms (x{v['ratio']:.2f}, {v['rounds']} rounds)"
                           for name, v in r["routes"].items())
        print(f"{arch:>13}  {cells}", flush=True)
        print(f"{arch:>13}  rel err vs FP32: ORT S8S8 {r['int8_rel_err']:.3f}, ORT U8S8-rr {r['u8s8_rel_err']:.3f}; "
              f"TVM int8 vs ORT QDQ reference {r['tvm_int8_steps_vs_ort_qdq']:.1f} output steps, layers "
              f"{r['tvm_int8_layers']['int8']} int8 / {r['tvm_int8_layers']['simulated']} simulated, "
              f"{r['tvm_int8_kernels']['layers']} on {r['tvm_int8_kernels']['kind']} kernels; sizes ONNX FP32 "
              f"{r['fp32_mb']:.1f} MB, INT8 {r['int8_mb']:.1f} MB, TVM .so FP32 {r['tvm_mb']:.1f} MB, int8 "
              f"{r['tvm_int8_mb']:.1f} MB; TVM FP32 compile {r['tvm_compile_s']:.0f} s", flush=True)
        if "ratio_to_ov_int8" in r["routes"]["tvm_int8"]:
            print(f"{arch:>13}  TVM int8 / OpenVINO INT8 x{r['routes']['tvm_int8']['ratio_to_ov_int8']:.2f}, TVM FP32 / "
                  f"OpenVINO FP32 x{r['routes']['tvm']['ratio_to_ov_fp32']:.2f} (median over rounds; "
                  f"{r['threads']} threads); OpenVINO INT8 layers {r['openvino']['ov_int8']['layers']}", flush=True)
        if "tune_s" in r:
            print(f"{arch:>13}  tuning {r['tune_trials_per_task']} trials/task: FP32 {r['tune_tasks']} tasks in "
                  f"{r['tune_s']:.0f} s, int8 {r['int8_tune_tasks']} tasks in {r['int8_tune_s']:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
