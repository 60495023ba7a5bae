"""Training benchmark: `appliance train`'s loop against a bare PyTorch DDP loop, plus checkpoints.

    .venv/bin/python benchmarks/train.py [--records 2048] [--steps 120] [--nproc 2] [--rounds 2]

Both loops run in the same torchrun workers (gloo, CPU here; NCCL on GPUs), on the same model
(small_cnn), the same TFRecord data through the same DataLoader (data_tools TFRecordDataset +
ShardedSampler + appliance.train.data.decode_image), the same batch size and fp32. The bare loop
is what a user would write by hand: DDP, AdamW, forward/backward/step, nothing else. Ours adds
the schedule, clipping, the per-step stop-flag all-reduce, sampler bookkeeping, logging and
TensorBoard (checkpoints are timed separately). Step rate is measured after --warmup steps;
rounds alternate bare/ours and each loop's best round counts (the machine may be shared).

Then: checkpoint save and verified-load time and size for small_cnn and resnet18 (AdamW state),
and the data-wait share of our loop's step time (from its metrics.jsonl).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET_RATIO = 0.97  # ours / bare, from issue 6


def write_data(out: Path, records: int, size: int = 32) -> None:
    import numpy as np
    from PIL import Image

    from data_tools.example import encode_example
    from data_tools.tfrecord import write_records

    rng = np.random.default_rng(0)

    def gen():
        for i in range(records):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
            yield encode_example({"image/encoded": buf.getvalue(), "image/class/label": i % 10})

    write_records(out / "train.tfrecord", gen())


def write_config(out: Path, name: str, steps: int, batch: int) -> Path:
    text = f"""
[run]
name = "{name}"
out_dir = "runs"
log_every = 10
[data]
train = ["train.tfrecord"]
num_classes = 10
image_size = 32
num_workers = 1
[optimizer]
name = "adamw"
lr = 0.001
[train]
max_steps = {steps}
batch_size = {batch}
precision = "fp32"
grad_clip = 1.0
[checkpoint]
every_steps = 100000
keep_last = 1
keep_best = 0
min_free_gb = 0.0
"""
    path = out / f"{name}.toml"
    path.write_text(text)
    return path


def bare_loop(cfg, warmup: int) -> float:
    """Steps per second of the hand-written DDP loop after `warmup` steps."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from appliance.train import data
    from appliance.models import build_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    loader, sampler = data.train_loader(cfg, rank, world, torch.Generator(), pin=False)
    model = DistributedDataParallel(build_model("small_cnn", cfg.num_classes, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr)
    criterion = torch.nn.CrossEntropyLoss()
    step, epoch, start = 0, 0, None
    while step < cfg.train.max_steps:
        sampler.set_epoch(epoch)
        for images, labels in loader:
            loss = criterion(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == warmup:
                start = time.perf_counter()
            if step == cfg.train.max_steps:
                break
        epoch += 1
    rate = (step - warmup) / (time.perf_counter() - start)
    dist.destroy_process_group()
    return rate


def our_loop(cfg, warmup: int) -> tuple[float, float]:
    """(steps per second after warmup, mean data-wait %) of appliance.train.loop.train."""
    from appliance.train.loop import train

    train(cfg, resume="none")
    lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [x for x in lines if "samples_per_s" in x and x["step"] > warmup]
    world = int(os.environ["WORLD_SIZE"])
    per_step = cfg.train.batch_size * world
    # Harmonic mean of equal-length windows = total steps / total time.
    rate = len(windows) / sum(per_step / w["samples_per_s"] for w in windows)
    wait = sum(w["data_wait_pct"] for w in windows) / len(windows)
    return rate, wait


def worker(args) -> None:
    """One loop per torchrun launch: each gets a fresh process group and fresh processes."""
    import dataclasses

    from appliance.train.config import load_config

    out = Path(args.dir)
    cfg = load_config(out / "bench.toml")
    if args.worker == "bare":
        result = {"rate": bare_loop(cfg, args.warmup)}
    else:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=f"ours-{args.round}"))
        rate, wait = our_loop(cfg, args.warmup)
        result = {"rate": rate, "data_wait_pct": wait}
    if int(os.environ["RANK"]) == 0:
        (out / f"{args.worker}-{args.round}.json").write_text(json.dumps(result))


def checkpoint_numbers(out: Path) -> list[dict]:
    import torch

    from appliance.train.checkpoint import CheckpointManager
    from appliance.train.determinism import rng_state
    from appliance.models import ModelCard, build_model

    rows = []
    for arch, size in (("small_cnn", 32), ("resnet18", 224)):
        model = build_model(arch, 10, 3)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 3, size, size)).sum().backward()
        opt.step()
        manager = CheckpointManager(out / f"ck-{arch}", keep_last=1)
        card = ModelCard(architecture=arch, num_classes=10)
        t0 = time.perf_counter()
        path = manager.save(1, model=model, card=card, optimizer_state=opt.state_dict(), optimizer_sharded=False,
                            trainer={"epoch": 0, "batches_done": 0, "sampler": {}, "scheduler": {}, "scaler": {},
                                     "metrics": {}, "config_hash": ""}, rng=rng_state())
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        manager.load_latest()  # sha256 of every file + parse
        load_s = time.perf_counter() - t0
        size_mb = sum(p.stat().st_size for p in path.iterdir()) / 2**20
        rows.append({"model": arch, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
                     "size_mb": size_mb, "save_s": save_s, "verified_load_s": load_s,
                     "save_mb_per_s": size_mb / save_s})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", choices=("bare", "ours"), help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        out = Path(tmp)
        write_data(out, args.records)
        write_config(out, "bench", args.steps, args.batch)
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo",
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc))),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        loop = {"bare": [], "ours": [], "data_wait_pct": []}
        for r in range(args.rounds):
            for which in ("bare", "ours"):
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
                       "--nproc-per-node", str(args.nproc), __file__, "--worker", which, "--round", str(r),
                       "--dir", tmp, "--steps", str(args.steps), "--warmup", str(args.warmup)]
                subprocess.run(cmd, check=True, env=env, cwd=tmp, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                result = json.loads((out / f"{which}-{r}.json").read_text())
                loop[which].append(result["rate"])
                if which == "ours":
                    loop["data_wait_pct"].append(result["data_wait_pct"])
        ckpt = checkpoint_numbers(out)

    import statistics

    bare, ours = max(loop["bare"]), max(loop["ours"])
    ratio = ours / bare
    median_ratio = statistics.median(loop["ours"]) / statistics.median(loop["bare"])
    import torch
    print(f"appliance train loop vs bare DDP loop: small_cnn, 32x32 RGB PNG TFRecords, batch {args.batch} per process, "
          f"{args.nproc} processes ({'CUDA' if torch.cuda.is_available() else 'CPU, gloo'}), fp32, "
          f"steps {args.warmup}..{args.steps}, best of {args.rounds} rounds")
    print(f"  bare loop : {bare:7.2f} steps/s   (rounds: {', '.join(f'{r:.2f}' for r in loop['bare'])})")
    print(f"  ours      : {ours:7.2f} steps/s   (rounds: {', '.join(f'{r:.2f}' for r in loop['ours'])})")
    print(f"  ratio ours/bare, best rounds: {ratio:.3f}  (target >= {TARGET_RATIO}: {'met' if ratio >= TARGET_RATIO else 'NOT met'})")
    print(f"  ratio ours/bare, median rounds: {median_ratio:.3f}")
    print(f"  data wait (ours): {min(loop['data_wait_pct']):.1f}% of step time (rounds: "
          f"{', '.join(f'{w:.1f}' for w in loop['data_wait_pct'])})")
    print("checkpoint save (fsync'd, sha256 manifest) and verified load, one process:")
    for row in ckpt:
        print(f"  {row['model']:10s} {row['params_m']:6.2f} M params  {row['size_mb']:7.1f} MB  "
              f"save {row['save_s']:6.3f} s ({row['save_mb_per_s']:.0f} MB/s)  verified load {row['verified_load_s']:6.3f} s")
    print(json.dumps({"loop": loop, "ratio_best": ratio, "ratio_median": median_ratio, "checkpoints": ckpt}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
