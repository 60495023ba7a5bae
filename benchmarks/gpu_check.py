"""The GPU path, proven in one run: doctor, CUDA training (fp32/bf16/fp16), exact resume, NCCL DDP,
onnxruntime-gpu, TensorRT, GPU JPEG decode, the input pipeline alone (benchmarks/loader.py) and the step
path against a bare loop (benchmarks/train_gpu.py), on one GPU box in under 8 minutes.

    .venv/bin/python benchmarks/gpu_check.py --out DIR [--budget-s 420] [--checks doctor,train,...]
    .venv/bin/python benchmarks/gpu_check.py --cpu-reference --out DIR   # the training check on CPU

Installs nothing: it uses the venv it runs in (the project's bootstrap, or a venv carried to the
box) and the product's own commands (`appliance doctor`, `train`, `export`, `compile`) on
synthetic TFRecords and configs written to a temporary directory. Each check runs in its own
process with its own timeout inside a total budget, so one failing or hanging check does not stop
the others. Prints one line per check and writes DIR/gpu_check.json (plus DIR/logs/). Without a
CUDA GPU it prints why it skipped and exits 0. Exit 1 when a check failed or timed out.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHECKS = ("doctor", "jpeg", "loader", "train", "speed", "resume", "ddp", "onnxruntime", "tensorrt", "profile",
          "graphs")
TIMEOUT_S = {"doctor": 90, "jpeg": 60, "loader": 120, "train": 240, "speed": 150, "profile": 90, "resume": 150,
             "ddp": 100, "onnxruntime": 120, "tensorrt": 180, "graphs": 420}
# A check that needs more than MIN_CHECK_S to mean anything: skipped, not started, with less left. The
# graphs check compiles resnet18 (cold: minutes) and so comes last, usually in a call of its own.
NEEDS_S = {"graphs": 300}
DISTINCT_IMAGES = 1024  # per file written by write_data
TRAIN_RECORDS_MAX = 8192  # the train check's data: one epoch of its steps (a restart of the loader per epoch is not what it measures)
MIN_CHECK_S = 10  # a check that would get less than this is skipped: the budget is spent
DEFAULT_BUDGET_S = 450  # < 8 minutes with the GPU probe and start-up
NUM_CLASSES = 10


# --- shared helpers (run in the check processes) ---------------------------------------------------

def appliance_cmd(*args: str) -> list[str]:
    """`appliance ...` as a user types it: the venv's console script, else `python -m appliance`."""
    script = Path(sys.executable).parent / "appliance"
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "appliance", *args]


def child_env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            **extra}


def run_logged(cmd: list[str], log: Path, timeout: float, env=None, cwd=None) -> subprocess.CompletedProcess:
    """Run cmd in its own session (a timeout kills torchrun and its workers too); output kept in log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or child_env(),
                            cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(1, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(killed after {timeout:.0f} s)"
        proc.returncode = 124
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{out}{err}\n(exit {proc.returncode})\n\n")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def last_line(proc: subprocess.CompletedProcess) -> str:
    """The line that says what went wrong: an `error:` line, else the last non-empty one."""
    lines = [x.strip() for x in (proc.stderr + "\n" + proc.stdout).splitlines() if x.strip()]
    errors = [x for x in lines if "error" in x.lower() and not x.startswith("$")]
    return (errors or lines or [f"exit status {proc.returncode}"])[-1][:300]


def write_data(root: Path, size: int, train_records: int = 1024, val_records: int = 128) -> Path:
    """Learnable synthetic JPEG TFRecords: class c is a bright square in cell c of a 4x3 grid on a
    smooth random background. Two train shards and one val file, made once per image size and count;
    beyond DISTINCT_IMAGES per file the examples repeat (decoding costs the same, writing much less)."""
    import numpy as np
    from PIL import Image

    from data_tools.example import encode_example
    from data_tools.tfrecord import write_records

    out = root / f"data-{size}-{train_records}"
    if (out / "done").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)

    def examples(n: int, seed: int):
        rng = np.random.default_rng(seed)
        cell = size // 4
        made = []
        for i in range(n):
            if len(made) == DISTINCT_IMAGES:
                yield made[i % DISTINCT_IMAGES]
                continue
            label = int(rng.integers(0, NUM_CLASSES))
            small = rng.integers(0, 110, (8, 8, 3), dtype=np.uint8)
            img = np.asarray(Image.fromarray(small).resize((size, size), Image.BILINEAR)).copy()
            r, c = divmod(label, 4)
            img[r * cell + cell // 4:r * cell + 3 * cell // 4, c * cell + cell // 4:c * cell + 3 * cell // 4,
                label % 3] = 230
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=90)
            made.append(encode_example({"image/encoded": buf.getvalue(), "image/format": b"jpeg",
                                        "image/class/label": label}))
            yield made[-1]

    half = train_records // 2
    write_records(out / "train-0.tfrecord", examples(half, 1))
    write_records(out / "train-1.tfrecord", examples(train_records - half, 2))
    write_records(out / "val.tfrecord", examples(val_records, 3))
    (out / "done").write_text("")
    return out


def write_config(work: Path, name: str, data: Path, *, arch: str, precision: str, steps: int, batch: int,
                 size: int, deterministic: bool, workers: int, every: int = 100000, val: bool = False,
                 compile_mode: str = "auto") -> Path:
    text = f"""# written by benchmarks/gpu_check.py
[run]
name = "{name}"
out_dir = "{work / 'runs'}"
seed = 7
deterministic = {str(deterministic).lower()}
log_every = 10
[data]
train = ["{data}/train-*.tfrecord"]
val = [{f'"{data}/val.tfrecord"' if val else ''}]
num_classes = {NUM_CLASSES}
image_size = {size}
num_workers = {workers}
[model]
architecture = "{arch}"
[optimizer]
name = "adamw"
lr = 0.001
[train]
max_steps = {steps}
batch_size = {batch}
precision = "{precision}"
grad_clip = 1.0
compile = "{compile_mode}"
[checkpoint]
every_steps = {every}
keep_last = 2
keep_best = 0
min_free_gb = 0.0
"""
    path = work / "configs" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def run_figures(run_dir: Path, warmup: int, batch: int, world: int = 1) -> dict:
    """Step rate after warmup (total steps / total time), peak memory and data wait from metrics.jsonl."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [x for x in lines if "samples_per_s" in x and x["step"] > warmup] or \
              [x for x in lines if "samples_per_s" in x]
    per_step = batch * world
    rate = len(windows) / sum(per_step / w["samples_per_s"] for w in windows)
    return {"steps_per_s": rate, "images_per_s": rate * per_step,
            "peak_memory_mb": max(w.get("peak_memory_mb", 0) for w in windows),
            "data_wait_pct": sum(w["data_wait_pct"] for w in windows) / len(windows),
            "windows": len(windows), "final_loss": windows[-1].get("loss")}


# --- the checks: each returns {"status": ok|fail|skip, "summary": one line, ...figures} ------------

def check_doctor(ctx) -> dict:
    proc = run_logged(appliance_cmd("doctor", "--json"), ctx.log("doctor"), ctx.timeout)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"status": "fail", "summary": f"no JSON report: {last_line(proc)}"}
    t, o = report.get("torch", {}), report.get("onnxruntime", {})
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB, sm {g['capability']})" for g in t.get("gpus", []))
    facts = {"exit": proc.returncode, "driver": (report.get("nvidia_driver") or {}).get("version"),
             "driver_required_minimum": (report.get("nvidia_driver") or {}).get("required_minimum"),
             "torch": t.get("version"), "cuda_build": t.get("cuda_build"), "cuda_runtime": t.get("cuda_runtime"),
             "nccl": t.get("nccl_version"), "gpus": t.get("gpus"), "training_device": report.get("training_device"),
             "onnxruntime": o.get("version"), "ort_providers": o.get("providers"),
             "problems": report.get("problems"), "warnings": report.get("warnings"), "report": report}
    ok = proc.returncode == 0 and report.get("training_device") == ("cpu" if ctx.cpu else "cuda")
    summary = (f"{gpus or 'no GPU'}; driver {facts['driver']} (needs >= {facts['driver_required_minimum']}), torch "
               f"{facts['torch']} CUDA {facts['cuda_build']}, NCCL {facts['nccl']}, onnxruntime {facts['onnxruntime']} "
               f"[{', '.join(facts['ort_providers'] or [])}]")
    if report.get("problems"):
        summary += f"; PROBLEMS: {'; '.join(report['problems'])}"
    return {"status": "ok" if ok else "fail", "summary": summary, **facts}


def check_train(ctx) -> dict:
    """Step rate and peak memory per (architecture, precision) with `appliance train`, and the ratios; the
    data set holds a whole run's samples (up to TRAIN_RECORDS_MAX), so no epoch restarts the loader."""
    size = ctx.args.image_size
    data = write_data(ctx.work, size, train_records=min(TRAIN_RECORDS_MAX, max(1024, ctx.args.steps * ctx.args.batch)))
    rows, failures = [], []
    for arch in ctx.args.archs:
        for precision in ctx.args.precisions:
            name = f"{arch}-{precision}"
            steps = ctx.args.steps
            cfg = write_config(ctx.work, name, data, arch=arch, precision=precision, steps=steps,
                               batch=ctx.args.batch, size=size, deterministic=False, workers=ctx.workers)
            start = time.perf_counter()
            proc = run_logged(appliance_cmd("train", str(cfg), "--nproc-per-node", "1", "--resume", "none"),
                              ctx.log("train"), ctx.left(), env=ctx.env)
            row = {"arch": arch, "precision": precision, "wall_s": round(time.perf_counter() - start, 1)}
            if proc.returncode != 0:
                row["error"] = last_line(proc)
                failures.append(f"{name}: {row['error']}")
            else:
                row.update(run_figures(ctx.work / "runs" / name, ctx.args.warmup, ctx.args.batch))
            rows.append(row)
    by = {(r["arch"], r["precision"]): r for r in rows if "steps_per_s" in r}
    ratios = {}
    for arch in ctx.args.archs:
        base = by.get((arch, "fp32"))
        for precision in ctx.args.precisions:
            if base and precision != "fp32" and (arch, precision) in by:
                ratios[f"{arch} {precision}/fp32"] = by[(arch, precision)]["steps_per_s"] / base["steps_per_s"]
    parts = []
    for arch in ctx.args.archs:
        cells = []
        for precision in ctx.args.precisions:
            r = by.get((arch, precision))
            if r:
                ratio = ratios.get(f"{arch} {precision}/fp32")
                cells.append(f"{precision} {r['steps_per_s']:.1f} it/s {r['peak_memory_mb'] / 1024:.2f} GB"
                             + (f" ({ratio:.2f}x)" if ratio else ""))
        if cells:
            parts.append(f"{arch}: " + ", ".join(cells))
    summary = (f"{'CPU' if ctx.cpu else 'CUDA'} {size}px batch {ctx.args.batch}, steps {ctx.args.warmup}..{ctx.args.steps}: "
               + "; ".join(parts) + (f"; FAILED {'; '.join(failures)}" if failures else ""))
    return {"status": "fail" if failures else "ok", "summary": summary, "runs": rows, "ratios": ratios,
            "device": "cpu" if ctx.cpu else "cuda", "image_size": size, "batch": ctx.args.batch}


def check_profile(ctx) -> dict:
    """`appliance train --profile`: where a GPU step's time goes (CUDA activity, exposed NCCL, peak memory
    against the device) and which recommendations fire, on the first architecture and last precision."""
    size, arch, precision = ctx.args.image_size, ctx.args.archs[-1], ctx.args.precisions[-1]
    data = write_data(ctx.work, size)
    name = f"profile-{arch}-{precision}"
    steps = max(ctx.args.warmup + 12, 20)
    cfg = write_config(ctx.work, name, data, arch=arch, precision=precision, steps=steps, batch=ctx.args.batch,
                       size=size, deterministic=False, workers=ctx.workers)
    proc = run_logged(appliance_cmd("train", str(cfg), "--nproc-per-node", "1", "--resume", "none", "--profile", "8"),
                      ctx.log("profile"), ctx.left(), env=ctx.env)
    report_path = ctx.work / "runs" / name / "profile.json"
    if proc.returncode != 0 or not report_path.exists():
        return {"status": "fail", "summary": f"{name}: {last_line(proc)}"}
    report = json.loads(report_path.read_text())
    shares = ", ".join(f"{p} {report['share'][p]:.0%}" for p in report["phases"] if report["share"][p] >= 0.01)
    memory = report["ranks"][0]["memory"]
    fired = [r["rule"] for r in report["recommendations"]]
    summary = (f"{arch} {precision} {size}px batch {ctx.args.batch} on {report['device']} "
               f"({'+'.join(report['activities'])}): {report['samples_per_s']:.0f} samples/s, "
               f"step {report['step_ms_median']:.1f} ms; {shares}; memory {memory}; "
               f"recommendations: {', '.join(fired) or 'none'}")
    ok = abs(sum(report["share"].values()) - 1) < 1e-3 and (ctx.cpu or "CUDA" in " ".join(report["activities"]).upper())
    return {"status": "ok" if ok else "fail", "summary": summary, "profile": report}


def _weights_diff(a: Path, b: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(a), load_file(b)
    if wa.keys() != wb.keys():
        return {"identical": False, "max_abs_diff": None, "tensors": len(wa), "note": "different tensor names"}
    diffs = {k: (wa[k].double() - wb[k].double()).abs().max().item() if wa[k].numel() else 0.0 for k in wa}
    return {"identical": all(torch.equal(wa[k], wb[k]) for k in wa), "max_abs_diff": max(diffs.values()),
            "tensors": len(wa), "tensors_differing": sum(1 for v in diffs.values() if v)}


def _resume_pair(ctx, arch: str, deterministic: bool, tag: str, precision: str = "auto", batch: int = 32,
                 compile_mode: str = "auto") -> dict:
    """An uninterrupted run and one SIGKILLed at a step then restarted; their final weights compared."""
    size, steps, kill_at, every = ctx.args.image_size, 30, 17, 10
    data = write_data(ctx.work, size)
    procs = {}
    for name, fault in ((f"resume-{tag}-reference", ""), (f"resume-{tag}-killed", f"step:{kill_at}:0")):
        cfg = write_config(ctx.work, name, data, arch=arch, precision=precision, steps=steps, batch=batch,
                           size=size, deterministic=deterministic, workers=ctx.workers, every=every,
                           compile_mode=compile_mode)
        # --resume auto (the default): the elastic restart after the SIGKILL resumes from the last checkpoint.
        proc = run_logged(appliance_cmd("train", str(cfg), "--nproc-per-node", "1", "--max-restarts", "1"),
                          ctx.log("resume"), ctx.left(), env={**ctx.env, "APPLIANCE_TEST_FAULT": fault})
        if proc.returncode != 0:
            return {"arch": arch, "deterministic": deterministic, "error": f"{name}: {last_line(proc)}"}
        procs[name] = proc
    killed = procs[f"resume-{tag}-killed"]
    figures = {"arch": arch, "deterministic": deterministic, "steps": steps, "killed_at": kill_at,
               "checkpoint_every": every, "resumed_from": kill_at // every * every,
               "kill_happened": "exitcode: -9" in killed.stderr or "SIGKILL" in killed.stderr,
               "resumed": "resumed from" in killed.stdout}
    weights = [ctx.work / "runs" / n / "model" / "model.safetensors" for n in procs]
    return {**figures, **_weights_diff(*weights)}


def check_resume(ctx) -> dict:
    """SIGKILL at a step (appliance/train/faults.py), elastic restart from the last checkpoint, final
    weights compared with an uninterrupted run: deterministic kernels, precision auto (fp16 +
    GradScaler on CUDA). When deterministic kernels fail, the same with them off, to measure the drift."""
    arch = "small_cnn" if ctx.cpu else "resnet18"
    det = _resume_pair(ctx, arch, True, "det")
    result = {"precision": "auto (fp16 + GradScaler on CUDA, bf16 on CPU)", "deterministic_run": det}

    def said(r):
        if "error" in r:
            return f"FAILED {r['error']}"
        if not (r["kill_happened"] and r["resumed"]):
            return f"the fault did not fire or no resume (killed {r['kill_happened']}, resumed {r['resumed']})"
        what = ("bit-identical" if r["identical"] else
                f"max |diff| {r['max_abs_diff']:.3g} in {r['tensors_differing']} of {r['tensors']} tensors")
        return (f"{r['arch']} SIGKILL at step {r['killed_at']}, resumed from step {r['resumed_from']}: final weights "
                f"{what} vs the uninterrupted run")

    summary = f"deterministic kernels: {said(det)}"
    ok = "error" not in det and det["kill_happened"] and det["resumed"] and det["identical"]
    if "error" in det and ctx.left() > 40:
        loose = _resume_pair(ctx, arch, False, "nondet")
        result["nondeterministic_run"] = loose
        summary += f"; deterministic = false: {said(loose)}"
    return {"status": "ok" if ok else "fail", "summary": summary, **result}


NCCL_PROBE = r"""
import os, torch, torch.distributed as dist
torch.cuda.set_device(0)  # every rank on GPU 0
dist.init_process_group("nccl")
t = torch.ones(4, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(t)
torch.cuda.synchronize()
if dist.get_rank() == 0:
    print("NCCL_PROBE_SUM", t[0].item())
dist.destroy_process_group()
"""


def check_ddp(ctx) -> dict:
    """`appliance train` with one process per GPU (NCCL); on one GPU also two processes sharing it."""
    import torch

    gpus = torch.cuda.device_count()
    data = write_data(ctx.work, ctx.args.image_size)
    figures, notes = {"gpus": gpus}, []
    cfg = write_config(ctx.work, "ddp", data, arch="small_cnn", precision="auto", steps=40, batch=64,
                       size=ctx.args.image_size, deterministic=False, workers=max(1, ctx.workers // max(gpus, 1)))
    proc = run_logged(appliance_cmd("train", str(cfg), "--nproc-per-node", str(gpus), "--resume", "none"),
                      ctx.log("ddp"), ctx.left(), env=ctx.env)
    figures["per_gpu"] = {"nproc": gpus, "exit": proc.returncode}
    if proc.returncode == 0:
        figures["per_gpu"].update(run_figures(ctx.work / "runs" / "ddp", 10, 64, world=gpus))
        notes.append(f"{gpus} process(es) x NCCL: {figures['per_gpu']['steps_per_s']:.1f} it/s")
    else:
        notes.append(f"{gpus} process(es): FAILED {last_line(proc)}")
    if gpus == 1:
        probe = ctx.work / "nccl_probe.py"
        probe.write_text(NCCL_PROBE)
        raw = run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
                          "--nproc-per-node", "2", str(probe)], ctx.log("ddp"), min(60, ctx.left()), env=ctx.env)
        nccl_ok = raw.returncode == 0 and "NCCL_PROBE_SUM 3.0" in raw.stdout
        figures["two_ranks_one_gpu_nccl"] = {"allowed": nccl_ok, "detail": None if nccl_ok else last_line(raw)}
        cfg2 = write_config(ctx.work, "ddp-shared", data, arch="small_cnn", precision="auto", steps=20, batch=32,
                            size=ctx.args.image_size, deterministic=False, workers=1)
        ours = run_logged(appliance_cmd("train", str(cfg2), "--nproc-per-node", "2", "--resume", "none"),
                          ctx.log("ddp"), min(90, ctx.left()), env=ctx.env)
        figures["two_ranks_one_gpu_appliance_train"] = {"exit": ours.returncode,
                                                        "detail": None if ours.returncode == 0 else last_line(ours)}
        notes.append("2 ranks on 1 GPU: NCCL " + ("allows it" if nccl_ok else f"refuses ({figures['two_ranks_one_gpu_nccl']['detail']})")
                     + "; appliance train --nproc-per-node 2: " + ("ran" if ours.returncode == 0 else f"fails ({figures['two_ranks_one_gpu_appliance_train']['detail']})"))
    return {"status": "ok" if proc.returncode == 0 else "fail", "summary": "; ".join(notes), **figures}


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


def check_jpeg(ctx) -> dict:
    """torchvision.io.decode_jpeg on the GPU (batched, nvJPEG) against the CPU, on the training JPEGs."""
    import torch
    import torchvision
    from torchvision.io import decode_jpeg

    from data_tools.example import decode_example
    from data_tools.tfrecord import read_records

    results = {}
    for size in (224, 512):
        data = write_data(ctx.work, size, train_records=256, val_records=8) if size != ctx.args.image_size \
            else write_data(ctx.work, size)
        blobs = [decode_example(bytes(r), keys=["image/encoded"])["image/encoded"][0]
                 for r in read_records(data / "train-0.tfrecord")][:256]
        tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
        torch.set_num_threads(1)
        start = time.perf_counter()
        cpu_imgs = [decode_jpeg(t) for t in tensors]
        cpu_rate = len(tensors) / (time.perf_counter() - start)
        decode_jpeg(tensors[:8], device="cuda")  # nvJPEG start-up
        torch.cuda.synchronize()
        rates = []
        for _ in range(3):
            start = time.perf_counter()
            gpu_imgs = decode_jpeg(tensors, device="cuda")
            torch.cuda.synchronize()
            rates.append(len(tensors) / (time.perf_counter() - start))
        diff = max((g.cpu().int() - c.int()).abs().float().mean().item() for g, c in zip(gpu_imgs[:32], cpu_imgs[:32]))
        results[f"{size}px"] = {"images": len(tensors), "cpu_one_thread_per_s": cpu_rate, "gpu_batched_per_s": max(rates),
                                "ratio": max(rates) / cpu_rate, "mean_abs_pixel_diff_max": diff,
                                "mean_jpeg_kb": sum(map(len, blobs)) / len(blobs) / 1024}
    line = "; ".join(f"{k}: GPU {v['gpu_batched_per_s']:.0f} img/s vs CPU 1 thread {v['cpu_one_thread_per_s']:.0f} "
                     f"({v['ratio']:.1f}x), pixel diff {v['mean_abs_pixel_diff_max']:.2f}" for k, v in results.items())
    ok = all(v["mean_abs_pixel_diff_max"] < 3 for v in results.values())
    return {"status": "ok" if ok else "fail", "summary": f"torchvision {torchvision.__version__} decode_jpeg: {line}",
            **results}


def _benchmark(ctx, script: str, args: list[str], folder: str = "") -> tuple[subprocess.CompletedProcess, dict | None, Path]:
    """benchmarks/<script> in its own process (this check's deadline), its JSON next to gpu_check.json
    (in OUT/<folder>, by default the script's name)."""
    out = Path(ctx.args.logs).parent / (folder or Path(script).stem)
    proc = run_logged([sys.executable, str(ROOT / "benchmarks" / script), "--out", str(out), *args], ctx.log(),
                      ctx.left(), env=ctx.env)
    report = out / f"{Path(script).stem}.json"
    return proc, (json.loads(report.read_text()) if proc.returncode in (0, 1) and report.exists() else None), out


def check_loader(ctx) -> dict:
    """benchmarks/loader.py: the input pipeline alone, [data] decode cpu against gpu, 224 and 512 px."""
    most = max(1, (os.cpu_count() or 2) - 1)  # 1 worker at 512 px would take this check's time alone
    args = (["--sizes", "32", "--workers", "1", "--rounds", "1", "--seconds", "0.2", "--records", "64"] if ctx.cpu
            else ["--sizes", "224,512", "--workers", ",".join(map(str, sorted({min(4, most), most}))),
                  "--rounds", "3", "--seconds", "1.5", "--records", "1024"])
    proc, report, out = _benchmark(ctx, "loader.py", args)
    if report is None:
        return {"status": "fail", "summary": f"benchmarks/loader.py: {last_line(proc)}"}
    cases = "; ".join(f"{r['case']} cpu {r['cpu_img_per_s']:.0f} gpu {r['gpu_img_per_s']:.0f} img/s (pixel "
                      f"difference mean {r['pixel_diff_levels']['mean']}, max {r['pixel_diff_levels']['max']})"
                      for r in report["results"])
    target = report.get("gpu_224_target")
    verdict = "" if target is None else (f"; 224 px gpu decode {target['best']:.0f} img/s, target >= "
                                         f"{target['img_per_s_at_least']:.0f}: {'met' if target['met'] else 'NOT met'}")
    return {"status": "ok" if target is None or target["met"] else "fail", "summary": cases + verdict,
            "results": report["results"], "target": target, "html": str(out / "loader.html")}


def check_speed(ctx) -> dict:
    """benchmarks/train_gpu.py: `appliance train`'s step path against a bare loop, side by side."""
    proc, report, out = _benchmark(ctx, "train_gpu.py", ["--rounds", "3", "--steps", "20"])
    if report is None:
        return {"status": "fail", "summary": f"benchmarks/train_gpu.py: {last_line(proc)}"}
    rows = report["results"]
    summary = "; ".join(f"{r['case']} ours/bare {r['median_ratio']} ({'met' if r['met'] else 'NOT met'})" for r in rows)
    return {"status": "ok" if all(r["met"] for r in rows) else "fail", "summary": summary, "results": rows,
            "html": str(out / "train_gpu.html")}


def check_graphs(ctx) -> dict:
    """[train] compile = "cuda-graphs": exact resume under it (SIGKILL at step 17, restart from step 10, final
    weights against an uninterrupted run, deterministic kernels, bf16), the run's manifest saying the graphs
    ran, and its step time against the eager bare loop beside the eager product (train_gpu.py, same case,
    so inductor's cache serves both). On the CPU reference the graphs do not exist: it runs as "on"."""
    arch, case = ("small_cnn", "cpu-tiny") if ctx.cpu else ("resnet18", "resnet18-b64-bf16")
    pair = _resume_pair(ctx, arch, True, "graphs", precision="bf16", batch=64, compile_mode="cuda-graphs")
    if "error" in pair:
        return {"status": "fail", "summary": f"resume under cuda-graphs: {pair['error']}", "resume": pair}
    manifest = json.loads((ctx.work / "runs" / "resume-graphs-reference" / "manifest.json").read_text())["params"]
    resumed = pair["kill_happened"] and pair["resumed"] and pair["identical"]
    said = ("bit-identical" if pair["identical"] else f"max |diff| {pair['max_abs_diff']:.3g} in "
            f"{pair['tensors_differing']} of {pair['tensors']} tensors")
    ran = ("ran" if manifest.get("cuda_graphs") else "none on a CPU (runs as 'on')" if ctx.cpu else "did NOT run")
    summary = (f"{arch} bf16 b64, CUDA graphs {ran}; SIGKILL at "
               f"step {pair['killed_at']}, resumed from {pair['resumed_from']}: final weights {said}")
    proc, report, out = _benchmark(ctx, "train_gpu.py", ["--cases", case, "--compile", "off,cuda-graphs",
                                                          "--rounds", "3", "--steps", "20"], folder="train_gpu_graphs")
    if report is None:
        return {"status": "fail", "summary": f"{summary}; benchmarks/train_gpu.py: {last_line(proc)}", "resume": pair}
    rows = {r["compile"]: r for r in report["results"]}
    eager, graphs = rows["off"], rows["cuda-graphs"]
    summary += (f"; ours/bare {eager['median_ratio']} eager, {graphs['median_ratio']} with cuda-graphs "
                f"({graphs['ours_img_per_s']:.0f} against {eager['ours_img_per_s']:.0f} img/s eager)")
    ok = resumed and (ctx.cpu or manifest.get("cuda_graphs") is True)
    return {"status": "ok" if ok else "fail", "summary": summary, "resume": pair, "manifest_params": manifest,
            "results": report["results"], "html": str(out / "train_gpu.html")}


CHECK_FUNCTIONS = {"doctor": check_doctor, "jpeg": check_jpeg, "loader": check_loader, "speed": check_speed,
                   "train": check_train, "profile": check_profile, "resume": check_resume,
                   "ddp": check_ddp, "onnxruntime": check_onnxruntime, "tensorrt": check_tensorrt,
                   "graphs": check_graphs}


class Context:
    """What a check process knows: its work directory, logs, deadline and the user's arguments."""

    def __init__(self, args):
        self.args, self.work, self.cpu = args, Path(args.work), args.cpu_reference
        self.timeout = args.timeout_s
        self.deadline = time.monotonic() + args.timeout_s
        self.workers = max(1, min(8, (os.cpu_count() or 2) // 2))
        # CPU reference: the same commands with the GPU hidden, so a GPU box measures its CPU too.
        self.env = child_env(CUDA_VISIBLE_DEVICES="") if self.cpu else child_env()
        if self.cpu:
            self.workers = 1

    def log(self, name: str = "") -> Path:
        """This check's log, whatever part of it runs: one file per check (a GPU lease returns few files)."""
        return Path(self.args.logs) / f"{self.args.run_check}.log"

    def left(self) -> float:
        return max(1.0, self.deadline - time.monotonic())


def run_one_check(args) -> int:
    """Child process: run one check, write its result JSON (even when it raises)."""
    started = time.perf_counter()
    try:
        result = CHECK_FUNCTIONS[args.run_check](Context(args))
    except Exception as err:  # the parent reports it as this check's failure and goes on
        import traceback

        with open(Path(args.logs) / f"{args.run_check}.log", "a") as f:
            traceback.print_exc(file=f)
        result = {"status": "fail", "summary": f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"}
    if result["status"] == "fail" and "(killed after" in result["summary"]:
        result["status"] = "timeout"  # a command ran into this check's own deadline
    result["seconds"] = round(time.perf_counter() - started, 1)
    Path(args.result).write_text(json.dumps(result, indent=2, default=str))
    return 0


# --- the parent: GPU probe, budget, one line per check, the JSON file ------------------------------

GPU_PROBE = r"""
import json, torch
print(json.dumps({"torch": torch.__version__, "cuda_build": torch.version.cuda,
                  "available": torch.cuda.is_available(), "count": torch.cuda.device_count(),
                  "names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))
"""


def probe_gpu(env: dict) -> dict:
    try:
        proc = subprocess.run([sys.executable, "-c", GPU_PROBE], capture_output=True, text=True, timeout=90, env=env)
    except subprocess.TimeoutExpired:
        return {"available": False, "error": "the torch CUDA probe did not answer within 90 s"}
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return {"available": False, "error": lines[-1] if lines else f"exit status {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _name_list(kind):
    def parse(text):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind}")
        return items
    return parse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--out", default="gpu-check", help="directory for gpu_check.json and logs/ (default ./gpu-check)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"total time for all checks, seconds (default {DEFAULT_BUDGET_S})")
    parser.add_argument("--checks", type=_name_list("checks"), default=list(CHECKS),
                        help=f"comma-separated subset of {','.join(CHECKS)} (default: all, in that order)")
    parser.add_argument("--cpu-reference", action="store_true",
                        help="run the training check on the CPU (GPU hidden): reference numbers, same JSON")
    parser.add_argument("--archs", type=_name_list("architectures"), default=None,
                        help="training check architectures (default small_cnn,resnet18; CPU reference: small_cnn)")
    parser.add_argument("--precisions", type=_name_list("precisions"), default=None,
                        help="training check precisions (default fp32,bf16,fp16; CPU reference: fp32,bf16)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per training run (default 120; CPU 30)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the rate (default 20; CPU 10)")
    parser.add_argument("--batch", type=int, default=None, help="batch size per process (default 64; CPU 16)")
    parser.add_argument("--image-size", type=int, default=None, help="image side in pixels (default 224; CPU 64)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (data, runs, engines) in OUT/work")
    parser.add_argument("--run-check", choices=CHECKS, help=argparse.SUPPRESS)
    for hidden in ("--work", "--logs", "--result"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=float, default=60, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    from appliance.train.config import PRECISIONS
    from appliance.models import ARCHITECTURES

    cpu = args.cpu_reference
    defaults = {"archs": ["small_cnn"] if cpu else ["small_cnn", "resnet18"],
                "precisions": ["fp32", "bf16"] if cpu else ["fp32", "bf16", "fp16"],
                "steps": 30 if cpu else 120, "warmup": 10 if cpu else 20, "batch": 16 if cpu else 64,
                "image_size": 64 if cpu else 224}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if cpu and args.checks == list(CHECKS):
        args.checks = ["train"]
    unknown = [c for c in args.checks if c not in CHECKS]
    if unknown:
        parser.error(f"--checks: unknown {', '.join(unknown)} (known: {', '.join(CHECKS)})")
    bad = [a for a in args.archs if a not in ARCHITECTURES]
    if bad:
        parser.error(f"--archs: unknown {', '.join(bad)} (known: {', '.join(ARCHITECTURES)})")
    bad = [p for p in args.precisions if p not in PRECISIONS or p == "auto"]
    if bad:
        parser.error(f"--precisions: unknown {', '.join(bad)} (known: fp32, bf16, fp16)")
    if cpu and "fp16" in args.precisions:
        parser.error("--precisions: fp16 needs CUDA (GradScaler); the CPU reference measures fp32 and bf16")
    if cpu and set(args.checks) - {"train", "resume", "profile", "loader", "graphs"}:
        parser.error("--cpu-reference runs only the train (and resume, profile, loader, graphs) checks")
    if args.budget_s <= 0:
        parser.error("--budget-s must be positive")
    for key in ("steps", "batch", "image_size"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1")
    if args.warmup >= args.steps:
        parser.error("--warmup must be smaller than --steps")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.run_check:
        return run_one_check(args)

    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    mode = "cpu-reference" if args.cpu_reference else "gpu"
    gpu = probe_gpu(child_env(CUDA_VISIBLE_DEVICES="") if args.cpu_reference else child_env())
    report = {"made_by": "benchmarks/gpu_check.py", "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "command": [sys.executable, *sys.argv], "mode": mode, "budget_s": args.budget_s, "gpu": gpu,
              "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
              "params": {k: getattr(args, k) for k in ("archs", "precisions", "steps", "warmup", "batch", "image_size")},
              "skipped": False, "reason": None, "checks": {}}
    if mode == "gpu" and not gpu.get("available"):
        reason = gpu.get("error") or (f"torch {gpu.get('torch')} (CUDA build {gpu.get('cuda_build')}) sees no CUDA GPU")
        report.update(skipped=True, reason=reason, elapsed_s=round(time.monotonic() - t0, 1))
        write_report(out, report)
        print(f"gpu_check: skipped: no CUDA GPU here ({reason}); nothing measured. "
              f"Run it on a GPU box (docs/gpu.md); {out / 'gpu_check.json'} says skipped")
        return 0
    print(f"gpu_check: {mode} on {', '.join(gpu.get('names') or []) or 'CPU'}; checks {','.join(args.checks)}; "
          f"budget {args.budget_s:.0f} s", flush=True)

    work_parent = out if args.keep else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work = work_parent / "work" if args.keep else work_parent
    work.mkdir(parents=True, exist_ok=True)
    try:
        for name in args.checks:
            left = args.budget_s - (time.monotonic() - t0)
            timeout = min(TIMEOUT_S[name], left)
            if timeout < NEEDS_S.get(name, MIN_CHECK_S):
                result = {"status": "skip", "summary": f"total budget of {args.budget_s:.0f} s spent", "seconds": 0.0}
                if name in NEEDS_S:
                    result["summary"] += (f" (it needs {NEEDS_S[name]} s: `sh benchmarks/gpu_check.sh --checks {name}` "
                                          "runs it alone)")
            else:
                result = run_check_process(name, args, work, out, timeout)
            report["checks"][name] = result
            print(f"gpu_check: {name:<11} {result['status']:<7} {result['seconds']:6.1f} s  {result['summary']}", flush=True)
            write_report(out, {**report, "elapsed_s": round(time.monotonic() - t0, 1)})
    finally:
        if not args.keep:
            shutil.rmtree(work_parent, ignore_errors=True)
    report["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_report(out, report)
    failed = [n for n, r in report["checks"].items() if r["status"] in ("fail", "timeout")]
    print(f"gpu_check: {len(report['checks']) - len(failed)}/{len(report['checks'])} checks without failure in "
          f"{report['elapsed_s']:.0f} s; {out / 'gpu_check.json'}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def run_check_process(name: str, args, work: Path, out: Path, timeout: float) -> dict:
    result_file = work / f"result-{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-check", name, "--work", str(work),
           "--logs", str(out / "logs"), "--result", str(result_file), "--timeout-s", str(timeout - 3),
           "--archs", ",".join(args.archs), "--precisions", ",".join(args.precisions), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--batch", str(args.batch), "--image-size", str(args.image_size)]
    if args.cpu_reference:
        cmd += ["--cpu-reference", "--checks", name]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        with open(out / "logs" / f"{name}.log", "a") as f:
            f.write(output or "")
        return {"status": "timeout", "summary": f"no result within its {timeout:.0f} s (see logs/{name}.log)",
                "seconds": round(time.monotonic() - started, 1)}
    if output:
        with open(out / "logs" / f"{name}.log", "a") as f:
            f.write(output)
    if not result_file.exists():
        tail = [x for x in (output or "").splitlines() if x.strip()]
        return {"status": "fail", "summary": f"the check process died (exit {proc.returncode}): "
                f"{tail[-1][:300] if tail else 'no output'}", "seconds": round(time.monotonic() - started, 1)}
    return json.loads(result_file.read_text())


def write_report(out: Path, report: dict) -> None:
    tmp = out / ".gpu_check.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(out / "gpu_check.json")


if __name__ == "__main__":
    sys.exit(main())
