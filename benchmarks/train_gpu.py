"""`appliance train`'s step path against a bare PyTorch loop, side by side in one process (issue 27).

    .venv/bin/python benchmarks/train_gpu.py [--cases cpu-tiny] [--rounds 7] [--steps 40] [--threads N] [--out DIR]
    .venv/bin/python benchmarks/train_gpu.py --cases resnet18-b64-bf16,resnet50-b256-fp32 ...   # on a GPU

Both sides train the same model (appliance.models.build_model), batch, image size, precision and
optimizer (AdamW, fused where torch has it) on the same synthetic batches already on the device:
what is measured is the loop, not the loader. Ours is the product's own step path, called as
`appliance train` calls it: a Run built by appliance.train.setup from a real config and TFRecord
file, then loop.run_epoch (train_step, the Guard, logging every log_every steps to metrics.jsonl
and TensorBoard). The bare loop is what a user writes by hand: forward, loss, backward, step.
Rounds alternate (bare, ours, ours, bare, ...); each round's ratio is ours' time per step over the
bare loop's, and the median of the ratios is the figure. On a CPU with a tiny model the host
dominates, so the ratio is the product's host overhead per step (target <= 1.1, judged on the wall
clock; the process's CPU-time ratio is recorded beside it, since on a shared box the wall clock also
counts other jobs); on a GPU the figures are images per second (target: ours >= 0.85x the bare
loop). Both sides run on one torch thread without a GPU (--threads); `--compile on` compiles
both models ([train] compile for ours), `--compile compare` only ours (against the eager bare loop),
`--compile cuda-graphs` ours with [train] compile = "cuda-graphs" (its kernels replayed as CUDA
graphs) against the eager bare loop; a comma list (`off,compare,cuda-graphs`) measures each in turn.

Writes DIR/train_gpu.json and DIR/train_gpu.html (per-round ratios plotted).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name: (architecture, batch, image size, precision, channels, classes)
CASES = {
    "cpu-tiny": ("small_cnn", 16, 16, "fp32", 1, 3),
    "resnet18-b64-fp32": ("resnet18", 64, 224, "fp32", 3, 100),
    "resnet18-b64-bf16": ("resnet18", 64, 224, "bf16", 3, 100),
    "resnet50-b64-bf16": ("resnet50", 64, 224, "bf16", 3, 100),
    "resnet50-b256-fp32": ("resnet50", 256, 224, "fp32", 3, 100),
    "resnet50-b256-bf16": ("resnet50", 256, 224, "bf16", 3, 100),
}
CPU_TARGET, GPU_TARGET = 1.1, 1 / 0.85  # ours / bare time per step


def write_case(work: Path, name: str, arch: str, batch: int, size: int, precision: str, channels: int,
               classes: int, compile_mode: str = "off") -> Path:
    """A config and a small real TFRecord file for the case (the Run is built from them)."""
    import numpy as np
    from PIL import Image

    from data_tools.example import encode_example
    from data_tools.tfrecord import write_records

    rng = np.random.default_rng(0)

    def records():
        for i in range(batch * 2):
            buf = io.BytesIO()
            shape = (size, size, 3) if channels == 3 else (size, size)
            Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(buf, format="PNG")
            yield encode_example({"image/encoded": buf.getvalue(), "image/class/label": i % classes})

    write_records(work / f"{name}.tfrecord", records())
    classes_line = ", ".join(f'"c{i}"' for i in range(classes))
    config = work / f"{name}.toml"
    config.write_text(f"""[run]
name = "{name}"
out_dir = "runs"
log_every = 10
deterministic = false
[data]
train = ["{name}.tfrecord"]
classes = [{classes_line}]
image_size = {size}
channels = {channels}
mean = {[0.5] * channels}
std = {[0.25] * channels}
num_workers = 0
[model]
architecture = "{arch}"
[optimizer]
name = "adamw"
lr = 0.001
[train]
batch_size = {batch}
precision = "{precision}"
grad_clip = 0.0
epochs = 1
compile = "{compile_mode}"
[checkpoint]
every_steps = 1000000000
min_free_gb = 0.0
""")
    return config


class Batches:
    """The loader's stand-in: the same device batches, `steps` of them per epoch."""

    def __init__(self, batches, steps: int):
        self.batches, self.steps = batches, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        return (self.batches[i % len(self.batches)] for i in range(self.steps))


def ours(run, steps: int, sync) -> tuple[float, float]:
    """Seconds per step of the product's step path (loop.run_epoch) over `steps` steps (wall, and
    this process's CPU time)."""
    from appliance.train.components import Checkpointing, MetricsLog
    from appliance.train.loop import run_epoch
    from appliance.train.step import Guard

    run.train_loader.steps = steps
    run.step, run.batches_done, run.total_steps = 0, 0, steps
    guard = Guard(run.device, run.rank, run.world, steps)
    logs = MetricsLog(run, ours.writer, _NoBar())
    sync()
    start, cpu = time.perf_counter(), time.process_time()
    run_epoch(run, iter(run.train_loader), guard, logs, Checkpointing(run), None)
    sync()
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


class _NoBar:
    def set_postfix(self, text: str) -> None:
        pass


def bare(model, optimizer, batches, steps: int, autocast, sync) -> tuple[float, float]:
    """Seconds per step of the hand-written loop (wall, and this process's CPU time)."""
    import torch

    criterion = torch.nn.CrossEntropyLoss()
    sync()
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(steps):
        images, labels = batches[i % len(batches)]
        with autocast():
            loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def measure_case(work: Path, name: str, rounds: int, steps: int, compile_mode: str = "off") -> dict:
    """Alternating rounds of both loops on one case; per-round ratios and their median."""
    import torch
    from tensorboardX import SummaryWriter

    from appliance.models import build_model
    from appliance.train import profiling
    from appliance.train.optimizer import build_optimizer
    from appliance.train.config import load_config
    from appliance.train.setup import build, printer, start_processes

    arch, batch, size, precision, channels, classes = CASES[name]
    ours_compile = {"on": "on", "compare": "on", "cuda-graphs": "cuda-graphs"}.get(compile_mode, "off")
    cfg = load_config(write_case(work, name, arch, batch, size, precision, channels, classes, ours_compile))
    os.chdir(work)
    run = build(start_processes(cfg, printer([])))
    run.profiler = profiling.OFF
    device = run.device
    gen = torch.Generator().manual_seed(0)
    batches = [((torch.randn(batch, channels, size, size, generator=gen)).to(device).contiguous(
                    memory_format=run.memory_format),
                torch.randint(0, classes, (batch,), generator=gen).to(device)) for _ in range(4)]
    run.train_loader = Batches(batches, steps)
    ours.writer = SummaryWriter(str(cfg.run_dir / "tb"))
    run.model.train()
    model = build_model(arch, classes, channels).to(device, memory_format=run.memory_format)
    if compile_mode == "on":  # both sides compiled; "compare": ours compiled against the eager bare loop
        model.compile()
    optimizer = build_optimizer(cfg, model, fused=True)  # the same optimizer, parameter groups and fusion
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    ours(run, max(3, steps // 4), sync)  # warm-up: kernels, allocator, cuDNN's choices
    bare(model, optimizer, batches, max(3, steps // 4), run.autocast, sync)
    ratios, cpu_ratios, ours_s, bare_s = [], [], [], []
    for r in range(rounds):
        order = ("bare", "ours") if r % 2 == 0 else ("ours", "bare")
        times = {}
        for side in order:
            times[side] = (ours(run, steps, sync) if side == "ours"
                           else bare(model, optimizer, batches, steps, run.autocast, sync))
        ours_s.append(times["ours"][0])
        bare_s.append(times["bare"][0])
        ratios.append(times["ours"][0] / times["bare"][0])
        cpu_ratios.append(times["ours"][1] / times["bare"][1])
    ours.writer.close()
    median = statistics.median(ratios)
    target = CPU_TARGET if device.type == "cpu" else GPU_TARGET
    return {"case": name, "device": str(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu",
            "architecture": arch, "batch": batch, "image_size": size, "precision": precision,
            "fused_optimizer": bool(getattr(run.optimizer, "defaults", {}).get("fused")),
            "memory_format": str(run.memory_format).replace("torch.", ""), "tf32": run.tf32,
            "steps_per_round": steps, "rounds": rounds,
            "ours_ms_per_step": [round(t * 1000, 4) for t in ours_s],
            "bare_ms_per_step": [round(t * 1000, 4) for t in bare_s],
            "ratios": [round(x, 4) for x in ratios], "median_ratio": round(median, 4),
            "compile": compile_mode, "cuda_graphs": run.cuda_graphs, "threads": torch.get_num_threads(),
            # This process's CPU time per step, ours over bare, per round: on a shared CPU box the wall
            # clock also counts the time other jobs hold the cores; the process clock does not.
            "cpu_time_ratios": [round(x, 4) for x in cpu_ratios],
            "median_cpu_time_ratio": round(statistics.median(cpu_ratios), 4),
            "ours_img_per_s": round(batch / statistics.median(ours_s), 1),
            "bare_img_per_s": round(batch / statistics.median(bare_s), 1),
            "target_ratio_at_most": round(target, 4), "met": median <= target}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def html(results: list[dict]) -> str:
    """A small self-contained page: per-round ratio bars per case, the target as a line."""
    rows, charts = [], []
    for r in results:
        rows.append(f"<tr><td>{r['case']}</td><td>{r['compile']}</td><td>{r['device']}</td><td>{r['median_ratio']}</td>"
                    f"<td>{r['median_cpu_time_ratio']}</td>"
                    f"<td>{r['target_ratio_at_most']}</td><td>{'yes' if r['met'] else 'no'}</td>"
                    f"<td>{r['ours_img_per_s']}</td><td>{r['bare_img_per_s']}</td></tr>")
        width, height, top = 24 * len(r["ratios"]) + 40, 160, max(max(r["ratios"]), r["target_ratio_at_most"]) * 1.1
        bars = "".join(f'<rect x="{30 + 24 * i}" y="{height - 20 - v / top * (height - 30):.1f}" width="18" '
                       f'height="{v / top * (height - 30):.1f}" fill="#4a7"><title>round {i}: {v}</title></rect>'
                       for i, v in enumerate(r["ratios"]))
        ty = height - 20 - r["target_ratio_at_most"] / top * (height - 30)
        charts.append(f'<h3>{r["case"]} (compile {r["compile"]}): ours / bare time per step, per round</h3><svg width="{width}" '
                      f'height="{height}">{bars}<line x1="25" x2="{width}" y1="{ty:.1f}" y2="{ty:.1f}" '
                      f'stroke="#c33" stroke-dasharray="4"/><text x="0" y="{ty:.1f}" font-size="10">'
                      f'{r["target_ratio_at_most"]}</text></svg>')
    return ("<!doctype html><meta charset='utf-8'><title>appliance train vs a bare loop</title>"
            "<h1>appliance train vs a bare loop (benchmarks/train_gpu.py)</h1><table border='1' cellpadding='4'>"
            "<tr><th>case</th><th>compile</th><th>device</th><th>median ratio</th><th>median CPU-time ratio</th><th>target (at most)</th><th>met</th>"
            "<th>ours img/s</th><th>bare img/s</th></tr>" + "".join(rows) + "</table>" + "".join(charts))


COMPILE_MODES = ("off", "on", "compare", "cuda-graphs")


def compile_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in COMPILE_MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of {', '.join(COMPILE_MODES)}")
    return modes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="", help=f"comma-separated, of {', '.join(CASES)}; default: cpu-tiny "
                        "on a CPU, resnet18-b64 and resnet50-b256 in fp32 and bf16 on a GPU")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40, help="steps per round and side")
    parser.add_argument("--out", default="benchmarks/out/train_gpu")
    parser.add_argument("--compile", type=compile_modes, default=["off"],
                        help="on: [train] compile for ours and torch.compile of the bare loop's model; compare: "
                        "ours compiled against the eager bare loop (does compiling win?); cuda-graphs: ours "
                        "with [train] compile = 'cuda-graphs' against the eager bare loop; a comma list "
                        "measures each mode in turn (default off)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads for both sides; default: "
                        "1 without a GPU (on a shared box, OpenMP's spinning threads made one round 20x another), "
                        "torch's own choice with one")
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    if args.threads or not torch.cuda.is_available():
        torch.set_num_threads(args.threads or 1)

    cases = args.cases.split(",") if args.cases else (
        ["resnet18-b64-fp32", "resnet18-b64-bf16", "resnet50-b256-fp32", "resnet50-b256-bf16"]
        if torch.cuda.is_available() else ["cpu-tiny"])
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    results = []
    with tempfile.TemporaryDirectory(prefix="train-gpu-") as tmp:
        for name, mode in [(name, mode) for name in cases for mode in args.compile]:
            work = Path(tmp) / f"{name}-{mode}"  # a run directory of its own per mode
            work.mkdir()
            result = measure_case(work, name, args.rounds, args.steps, mode)
            dist.destroy_process_group()
            results.append(result)
            print(f"{name}{'' if mode == 'off' else f' (compile {mode})'}: ours/bare median {result['median_ratio']} (rounds {result['ratios']}; CPU time "
                  f"{result['median_cpu_time_ratio']}, rounds {result['cpu_time_ratios']}); ours "
                  f"{statistics.median(result['ours_ms_per_step']):.3f} ms/step, bare "
                  f"{statistics.median(result['bare_ms_per_step']):.3f} ms/step; target <= "
                  f"{result['target_ratio_at_most']}: {'met' if result['met'] else 'NOT met'}", flush=True)
    (out / "train_gpu.json").write_text(json.dumps({"results": results, "torch": torch.__version__,
                                                    "threads": torch.get_num_threads(),
                                                    "command": " ".join(sys.argv)}, indent=2) + "\n")
    (out / "train_gpu.html").write_text(html(results))
    print(f"wrote {out / 'train_gpu.json'} and {out / 'train_gpu.html'}")
    return 0 if all(r["met"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
