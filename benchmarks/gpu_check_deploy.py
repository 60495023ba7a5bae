"""benchmarks/gpu_check.py's deploy checks: onnxruntime-gpu and TensorRT through `appliance compile`
on the train check's exported model."""

from __future__ import annotations

import json
import time
from pathlib import Path

from gpu_check_helpers import appliance_cmd, last_line, run_logged, write_config, write_data

def _exported_model(ctx) -> Path:
    """model.onnx from `appliance export` of the train check's resnet18 fp32 run (trained here if absent)."""
    out = ctx.work / "export"
    if (out / "model.onnx").exists():
        return out / "model.onnx"
    data = write_data(ctx.work, ctx.args.image_size)
    run = ctx.work / "runs" / "resnet18-fp32"
    if not (run / "model" / "model.safetensors").exists():
        run = ctx.work / "runs" / "export-source"
        cfg = write_config(ctx.work, "export-source", data, arch="resnet18", precision="auto", steps=40, batch=64,
                           size=ctx.args.image_size, deterministic=False, workers=ctx.workers)
        proc = run_logged(appliance_cmd("train", str(cfg), "--nproc-per-node", "1", "--resume", "none"),
                          ctx.log("export"), ctx.left(), env=ctx.env)
        if proc.returncode != 0:
            raise RuntimeError(f"training the model to export failed: {last_line(proc)}")
    proc = run_logged(appliance_cmd("export", str(run), "--out", str(out), "--samples", str(data / "val.tfrecord")),
                      ctx.log("export"), ctx.left())
    if proc.returncode != 0:
        raise RuntimeError(f"appliance export failed: {last_line(proc)}")
    return out / "model.onnx"


def _median_ms(fn, repeats: int = 30) -> float:
    import statistics

    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _compile_summary(ctx, target: str, model: Path, extra: list[str]) -> dict:
    data = write_data(ctx.work, ctx.args.image_size)
    out = ctx.work / f"compile-{target}"
    proc = run_logged(appliance_cmd("compile", str(model), "--target", target, "--out", str(out),
                                    "--samples", str(data / "val.tfrecord"), *extra), ctx.log(target), ctx.left())
    result = {"exit": proc.returncode, "error": None if proc.returncode == 0 else last_line(proc)}
    if (out / "compile.json").exists():  # written before the gate decides, so figures exist either way
        info = json.loads((out / "compile.json").read_text())
        result["builds"] = [{k: b[k] for k in ("precision", "bytes", "build_seconds", "check", "latency_ms",
                                               "speedup_vs_cpu_batch1", "passed")}
                            | ({"top1": b["accuracy"]["quantized"]["top1"], "fp32_top1": b["accuracy"]["fp32"]["top1"]}
                               if "accuracy" in b else {}) for b in info["builds"]]
        result["reference_latency_ms"] = info["reference"]["latency_ms"]
        result["versions"] = info.get("versions")
    return result


def _builds_line(result: dict) -> str:
    if "builds" not in result:
        return f"FAILED {result['error']}"
    return ", ".join(f"{b['precision']} max|diff| {b['check']['max_abs_diff']:.3g} agree {b['check']['top1_agreement']:.3f} "
                     f"{b['latency_ms']['batch1_median']:.2f} ms b1, {b['latency_ms']['samples_per_s']:.0f} img/s b32"
                     f"{'' if b['passed'] else ' GATE FAILED'}" for b in result["builds"])


def check_onnxruntime(ctx) -> dict:
    """CUDA EP vs CPU EP on the exported FP32 model (parity, latency), then `compile --target cuda-ort`."""
    import numpy as np
    import onnxruntime as ort

    from appliance.deploy.onnx_model import metadata, ort_session, run_ort
    from appliance.deploy.samples import load_samples

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        from importlib.metadata import PackageNotFoundError, version

        try:
            gpu_build = version("onnxruntime-gpu")
        except PackageNotFoundError:  # e.g. a bare GPU box whose image has the CPU build only
            return {"status": "skip", "summary": f"onnxruntime {ort.__version__} is the CPU build (no onnxruntime-gpu "
                    "here; the trainer-cuda bundle installs it): CUDA EP not measured"}
        return {"status": "fail", "summary": f"onnxruntime-gpu {gpu_build} is installed but lists no "
                f"CUDAExecutionProvider ({', '.join(ort.get_available_providers())})"}
    model = _exported_model(ctx)
    import onnx

    if hasattr(ort, "preload_dlls"):  # as appliance compile --target cuda-ort does
        try:
            ort.preload_dlls()
        except Exception:
            pass

    x = load_samples([write_data(ctx.work, ctx.args.image_size) / "val.tfrecord"],
                     metadata(onnx.load(str(model)))["preprocessing"]).x
    cpu = ort_session(model)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    gpu = ort.InferenceSession(str(model), options, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    if "CUDAExecutionProvider" not in gpu.get_providers():
        return {"status": "fail", "summary": f"the CUDA execution provider did not start (session providers "
                f"{gpu.get_providers()})"}
    expected, got = run_ort(cpu, x, batch=32), run_ort(gpu, x, batch=32)
    diff = float(np.abs(got.astype(np.float64) - expected).max())
    agree = float((got.argmax(1) == expected.argmax(1)).mean())
    name = cpu.get_inputs()[0].name
    lat = {}
    for label, sess in (("cpu", cpu), ("cuda", gpu)):
        for b in (1, 32):
            lat[f"{label}_b{b}_ms"] = _median_ms(lambda: sess.run(None, {name: x[:b]}), 20 if b == 32 else 30)
    routed = _compile_summary(ctx, "cuda-ort", model, [])
    fp32_ok = diff <= 1e-3 * max(1.0, float(np.abs(expected).max())) and agree == 1.0
    summary = (f"FP32 CUDA EP vs CPU EP on {len(x)} samples: max|diff| {diff:.3g}, top-1 agree {agree:.3f}; latency "
               f"b1 {lat['cuda_b1_ms']:.2f} ms (CPU {lat['cpu_b1_ms']:.2f}), b32 {lat['cuda_b32_ms']:.2f} ms "
               f"(CPU {lat['cpu_b32_ms']:.2f}); compile --target cuda-ort: {_builds_line(routed)}")
    ok = fp32_ok and routed["exit"] == 0
    return {"status": "ok" if ok else "fail", "summary": summary, "fp32_max_abs_diff": diff, "fp32_top1_agreement": agree,
            "latency_ms": lat, "onnxruntime": ort.__version__, "compile_cuda_ort": routed}


def check_tensorrt(ctx) -> dict:
    try:
        import tensorrt as trt
    except ImportError as err:
        return {"status": "skip", "summary": f"tensorrt does not import here ({err}); the trainer-cuda bundle carries it"}
    model = _exported_model(ctx)
    calib = write_data(ctx.work, ctx.args.image_size) / "train-0.tfrecord"
    routed = _compile_summary(ctx, "tensorrt", model, ["--int8-calib", str(calib), "--max-drop", "2"])
    return {"status": "ok" if routed["exit"] == 0 else "fail", "tensorrt": trt.__version__,
            "summary": f"TensorRT {trt.__version__}: {_builds_line(routed)}", "compile_tensorrt": routed}


