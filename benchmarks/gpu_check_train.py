"""benchmarks/gpu_check.py's training checks (each returns {"status": ok|fail|skip, "summary": one line,
...figures}): doctor, CUDA training, the profiler, exact resume, NCCL DDP, GPU JPEG decode, the input
pipeline alone, the step path against a bare loop, CUDA graphs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_helpers import (ROOT, TRAIN_RECORDS_MAX, appliance_cmd, last_line, run_figures, run_logged, write_config,
                               write_data)

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

