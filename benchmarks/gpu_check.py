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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the check modules beside this one

from gpu_check_deploy import check_onnxruntime, check_tensorrt  # noqa: E402
from gpu_check_helpers import child_env  # noqa: E402
from gpu_check_train import (check_ddp, check_doctor, check_graphs, check_jpeg, check_loader, check_profile,  # noqa: E402
                             check_resume, check_speed, check_train)

CHECKS = ("doctor", "jpeg", "loader", "train", "speed", "resume", "ddp", "onnxruntime", "tensorrt", "profile",
          "graphs")
TIMEOUT_S = {"doctor": 90, "jpeg": 60, "loader": 120, "train": 240, "speed": 150, "profile": 90, "resume": 150,
             "ddp": 100, "onnxruntime": 120, "tensorrt": 180, "graphs": 420}
# A check that needs more than MIN_CHECK_S to mean anything: skipped, not started, with less left. The
# graphs check compiles resnet18 (cold: minutes) and so comes last, usually in a call of its own.
NEEDS_S = {"graphs": 300}
MIN_CHECK_S = 10  # a check that would get less than this is skipped: the budget is spent
DEFAULT_BUDGET_S = 450  # < 8 minutes with the GPU probe and start-up

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

