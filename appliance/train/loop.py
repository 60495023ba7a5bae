"""The training loop, one process per device, started by torchrun (see launcher.py).

Read `train()` top to bottom: set up, resume, then per optimizer step: micro-batches with
gradient accumulation, clipping, the (scaled) optimizer step, the schedule, logging, and
checkpoints; evaluation after each epoch. SIGTERM/SIGINT end the run at the next step boundary
with a checkpoint, so `--resume auto` continues exactly there. A non-finite loss on any rank stops
every rank at that step without saving, so the newest checkpoint stays the resume point.
An ApplianceError in a worker is one line, left in RUN_DIR/.worker-error for the launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import resource
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from appliance.core.errors import ApplianceError, ConfigError, EnvironmentProblem
from appliance.train import data, faults, worker_error
from appliance.train.checkpoint import CheckpointDamaged, CheckpointManager
from appliance.train.config import Config, check_data_report, load_config
from appliance.train.determinism import rng_state, set_determinism, set_rng_state
from appliance.core.manifest import atomic_write_text
from appliance.models import ONNX_ARCHITECTURE, ONNX_GRAPH_NAME, ModelCard, save_trained_model
from appliance.train.ddp import build_training_model, pick_precision
from appliance.tasks import task_for
from appliance.train.optimizer import build_optimizer, build_scheduler
from appliance.train import profiling
from appliance.train.profile_report import PROFILE_HTML, PROFILE_JSON
from appliance.train.report import REPORT_HTML, REPORT_JSON, write_training_report
from appliance.core.manifest import write_manifest
from appliance.core.progress import Progress
from appliance.train.checkpoint import _broadcast_int, _all_gather_json
from appliance.train.profile_report import write_profile_report


INIT_REPORT = "init.json"  # how [model] init's weights matched the model


class TrainingDiverged(ApplianceError):
    """The loss became NaN or infinite."""


class StopFlag:
    """Set by SIGTERM/SIGINT; all ranks agree on it each step so they stop at the same step."""

    def __init__(self):
        self.local = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._set)

    def _set(self, signum, frame):
        # A second signal is normal (the job's process group, then torchrun, both send one), so
        # it changes nothing; torchrun's SIGKILL after its grace period is the hard stop.
        self.local = True

    def agreed(self, device, loss: torch.Tensor, rank: int) -> tuple[bool, int]:
        """(stop, a rank whose loss of this step is not finite, or -1): one collective for both."""
        flags = torch.stack([torch.tensor(int(self.local), device=device),
                             torch.where(torch.isfinite(loss), 0, rank + 1).to(device)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0].item()), int(flags[1].item()) - 1


def _log_line(run_dir: Path, record: dict) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


@torch.no_grad()
def evaluate(model, loader, device, autocast, num_classes: int = 0, task=None) -> dict:
    """Loss and top-1 over the whole validation set (each record counted once across ranks), and
    with num_classes the confusion counts val_confusion[true][predicted] (for the quality gate).
    The task (default classification) says what is counted: images, or labelled pixels.

    Takes the unwrapped model: shares may differ by a batch between ranks, and DDP's forward
    would run collectives. Rank 0's buffers (BatchNorm statistics) are what gets saved, so
    every rank evaluates with them."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device)
    task = task or task_for(None)
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with autocast():
            logits = model(images)
        loss, correct, counted, pairs = task.eval_counts(logits, labels, num_classes)
        totals[0] += loss
        totals[1] += correct
        totals[2] += counted
        if num_classes:
            # On the CPU: CUDA's bincount has no deterministic kernel (use_deterministic_algorithms refuses it).
            pairs = pairs.cpu()
            confusion += torch.bincount(pairs, minlength=num_classes ** 2).to(device)
    dist.all_reduce(totals)
    model.train()
    count = max(totals[2].item(), 1)
    metrics = {"val_loss": totals[0].item() / count, "val_acc": totals[1].item() / count}
    if num_classes:
        dist.all_reduce(confusion)
        metrics["val_confusion"] = confusion.view(num_classes, num_classes).tolist()
    return metrics


class TrainWindow:
    """Counts of one logging window, kept on the device so a step adds no host sync: gradient
    norms (before clipping), clipped steps, and top-1 hits of the training batches' own logits.

    The gradients are already averaged across ranks, so the norm is the same on every rank;
    the accuracy counts are summed across ranks when the window is logged."""

    def __init__(self, device):
        # norm sum, max, clipped steps, steps with a non-finite norm, correct, seen
        self.counts = torch.zeros(6, dtype=torch.float64, device=device)
        self.steps = 0

    def count_predictions(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        labelled = labels < logits.shape[1]  # segmentation's ignored pixels are no prediction to count
        self.counts[4] += ((logits.detach().argmax(1) == labels) & labelled).sum()
        self.counts[5] += labelled.sum()

    def count_step(self, grad_norm: torch.Tensor, clip: float) -> None:
        norm = grad_norm.detach().to(self.counts)
        self.steps += 1
        finite = torch.isfinite(norm)  # not finite: an fp16 step the scaler skips (or a divergence)
        self.counts[0] += torch.where(finite, norm, 0.0)
        self.counts[1] = torch.maximum(self.counts[1], torch.where(finite, norm, 0.0))
        self.counts[3] += ~finite
        if clip > 0:
            self.counts[2] += finite & (norm > clip)  # clip_grad_norm_ scales the gradients down exactly then

    def figures(self) -> dict:
        """grad_norm (mean over the window's steps with a finite norm), grad_norm_max, clipped_fraction,
        nonfinite_grad_steps, train_acc; a collective."""
        hits = self.counts[4:].clone()
        dist.all_reduce(hits)
        norm_sum, norm_max, clipped, nonfinite = self.counts[:4].tolist()
        correct, seen = hits.tolist()
        return {"grad_norm": norm_sum / max(self.steps - nonfinite, 1), "grad_norm_max": norm_max,
                "clipped_fraction": clipped / max(self.steps, 1), "nonfinite_grad_steps": int(nonfinite),
                "train_acc": correct / max(seen, 1)}


STORAGE_WORDS = {"shared": "one directory shared by every node (a shared filesystem was detected)",
                 "per-node": "each node writes its own directory (no shared filesystem was detected)"}


def write_run_manifest(cfg: Config, run_dir: Path, step: int, checkpoint_storage: str = "shared",
                       init_report: dict | None = None) -> None:
    """runs/<name>/manifest.json: the data files (sha256) and the init weights in, the model and metrics out."""
    outputs = sorted((run_dir / "model").iterdir())
    # metrics.jsonl and the training report are on rank 0's node only, with per-node storage.
    outputs += [path for path in (run_dir / "metrics.jsonl", run_dir / REPORT_JSON, run_dir / REPORT_HTML,
                                  run_dir / PROFILE_JSON, run_dir / PROFILE_HTML) if path.is_file()]
    inputs = [cfg.source, *cfg.data.train, *cfg.data.val] + ([cfg.data.check_report] if cfg.data.check_report else [])
    if init_report is not None:
        inputs.append(init_report["path"])  # its sha256 then travels in the lineage to the edge package
    write_manifest(run_dir, "train", inputs, {"config": cfg.to_dict(), "steps": step,
                                              "config_hash": cfg.training_hash(), "init": init_report,
                                              "checkpoint_storage": checkpoint_storage}, outputs=outputs)


def train(cfg: Config, resume: str = "auto") -> int:
    # --- set up: processes, determinism, data, model, optimizer -----------------------------------
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if rank == 0:
        worker_error.clear(cfg.run_dir)  # an earlier attempt's line; every rank is past start-up now
    faults.load()
    set_determinism(cfg.run.seed, rank, cfg.run.deterministic)
    check_data_report(cfg)
    run_dir = cfg.run_dir
    bar = None  # rank 0's progress (a bar on a terminal, plain lines in a log); lines go through it

    def log(line: str, flush: bool = True) -> None:
        if rank == 0:
            bar.write(line, sys.stdout) if bar is not None else print(line, flush=flush)

    # The loaders get their own generator, reseeded per epoch: creating an iterator then never
    # draws from the global RNG, whose stream the checkpoints capture mid-epoch.
    loader_generator = torch.Generator()
    train_loader, sampler = data.train_loader(cfg, rank, world, loader_generator, pin=device.type == "cuda")
    val_loader = data.val_loader(cfg, rank, world, loader_generator, pin=device.type == "cuda") if cfg.data.val else None
    steps_per_epoch = len(train_loader) // cfg.train.grad_accum
    if steps_per_epoch < 1:
        raise ConfigError(f"{cfg.source}: [train] batch_size x grad_accum x processes is larger than the data")
    total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch

    model, raw_model, init_report = build_training_model(cfg, device, log)
    optimizer = build_optimizer(cfg, raw_model)
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    precision = pick_precision(cfg.train.precision, device, cfg.source)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def autocast():
        return torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    task = task_for(cfg.task)
    sharded = cfg.optimizer.zero_redundancy
    local_optimizer = optimizer.optim if sharded else optimizer  # ZeRO: this rank's shard
    card = ModelCard(architecture=cfg.model.architecture, num_classes=cfg.num_classes,
                     in_channels=cfg.data.channels, image_size=cfg.data.image_size, mean=cfg.data.mean,
                     std=cfg.data.std, channel_order="RGB" if cfg.data.channels == 3 else "L",
                     class_names=cfg.data.classes,
                     extra={"run": cfg.run.name, "made_by": "appliance train", **task.card_extra()})
    onnx_graph = Path(cfg.model.init) if cfg.model.architecture == ONNX_ARCHITECTURE else None
    if onnx_graph is not None:
        card.extra["onnx_graph"] = ONNX_GRAPH_NAME
    if init_report is not None and rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / INIT_REPORT, json.dumps(init_report, indent=2) + "\n")
    checkpoints = CheckpointManager(
        run_dir / "checkpoints", keep_last=cfg.checkpoint.keep_last, keep_best=cfg.checkpoint.keep_best,
        monitor=cfg.checkpoint.monitor, mode=cfg.checkpoint.mode,
        min_free_bytes=int(cfg.checkpoint.min_free_gb * 2**30), rank=rank, world_size=world,
        local_rank=local_rank, node=int(os.environ.get("GROUP_RANK", 0)), log=log)
    if world > int(os.environ.get("LOCAL_WORLD_SIZE", world)):  # several machines: say where checkpoints live
        log(f"checkpoints: {STORAGE_WORDS[checkpoints.storage]} ({checkpoints.directory})", flush=True)

    # --- resume: weights, optimizer, schedule, scaler, RNG streams, data position -----------------
    step, epoch, batches_done, metrics = 0, 0, 0, {}
    ckpt = None
    if resume == "auto":
        ckpt = checkpoints.load_latest()
        if ckpt is None and checkpoints.any_set_aside():
            raise ConfigError(f"{checkpoints.directory}: no checkpoint verifies (see the warnings above); "
                              "refusing to start over on top of them: use a new [run] name")
    elif resume == "none":
        if checkpoints.any_committed():
            raise ConfigError(f"{run_dir / 'checkpoints'} already holds checkpoints of an earlier run; "
                              "use --resume auto to continue it, or a new [run] name to start over")
    else:
        try:
            ckpt = checkpoints.load(resume)
        except CheckpointDamaged as err:
            raise ConfigError(f"--resume {resume}: {err}") from None
    if ckpt is not None:
        if ckpt.trainer["config_hash"] != cfg.training_hash():
            raise ConfigError(f"{cfg.source}: differs from the config that made {ckpt.path} in a setting that "
                              "decides the weights; use a new [run] name to start a new run (with [model] init = "
                              f"\"{ckpt.path}\" to start it from those weights)")
        raw_model.load_state_dict(ckpt.model_state)
        local_optimizer.load_state_dict(ckpt.optimizer_state)
        scheduler.load_state_dict(ckpt.trainer["scheduler"])
        scaler.load_state_dict(ckpt.trainer["scaler"])
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr  # ZeRO keeps its own param groups; they must carry the resumed lr too
        set_rng_state(ckpt.rng)
        sampler.load_state_dict(ckpt.trainer["sampler"])  # rank 0's; every rank is at the same position
        step, epoch, batches_done = ckpt.step, ckpt.trainer["epoch"], ckpt.trainer["batches_done"]
        metrics = ckpt.trainer["metrics"]
        log(f"resumed from {ckpt.path} (step {step}, epoch {epoch})", flush=True)
        if rank == 0:  # later lines may repeat steps the lost attempt had logged
            _log_line(run_dir, {"step": step, "epoch": epoch, "resumed_from": str(ckpt.path)})

    def save(metrics: dict) -> None:
        trainer = {"epoch": epoch, "batches_done": batches_done, "sampler": sampler.state_dict(),
                   "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "metrics": metrics,
                   "config_hash": cfg.training_hash()}
        checkpoints.save(step, model=raw_model, card=card, optimizer_state=local_optimizer.state_dict(),
                         optimizer_sharded=sharded, trainer=trainer, rng=rng_state())

    writer = None
    if rank == 0:
        from tensorboardX import SummaryWriter

        writer = SummaryWriter(str(run_dir / "tb"))
        bar = Progress(total=total_steps, initial=step, desc="train", unit="step", every=30)
        _progress.append(bar)  # closed before an error line, which then starts a line of its own
    stop = StopFlag()
    criterion = task.criterion().to(device)
    model.train()
    profiler = start_profiler(cfg, device, rank, step, total_steps, log)
    phase = profiler.phase

    # --- the loop ------------------------------------------------------------------------------
    stopped = False
    while step < total_steps and not stopped:
        sampler.set_epoch(epoch)  # keeps the position of a resumed epoch
        if hasattr(train_loader.dataset, "set_epoch"):
            train_loader.dataset.set_epoch(epoch)  # augmentation is seeded by (seed, epoch, index)
        loader_generator.manual_seed(cfg.run.seed * 100_003 + epoch * 1009 + rank)
        with phase("data_wait"):  # starts the loader's workers
            batches = iter(train_loader)
        window_start, data_wait, window_steps, loss_sum = time.perf_counter(), 0.0, 0, torch.zeros((), device=device)
        window = TrainWindow(device)
        while batches_done + cfg.train.grad_accum <= len(train_loader) and step < total_steps:
            step_loss = torch.zeros((), device=device)
            for micro in range(cfg.train.grad_accum):
                t0 = time.perf_counter()
                with phase("data_wait"):
                    images, labels = next(batches)
                    sampler.advance(len(labels))
                with phase("h2d_copy"):
                    images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                data_wait += time.perf_counter() - t0
                # Gradients are averaged across ranks only on the last micro-batch.
                last = micro == cfg.train.grad_accum - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    with phase("forward"):
                        with autocast():
                            logits = model(images)
                            loss = criterion(logits, labels) / cfg.train.grad_accum
                        window.count_predictions(logits, labels)
                        if faults.armed("nan-loss", step + 1, rank):
                            loss = loss * float("nan")
                    with phase("backward"):
                        scaler.scale(loss).backward()
                step_loss += loss.detach()
            loss_sum += step_loss
            batches_done += cfg.train.grad_accum
            with phase("optimizer"):
                if cfg.train.grad_clip > 0:
                    scaler.unscale_(optimizer)
                    grad_norm = nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.train.grad_clip)
                else:  # measured only: the gradients stay untouched (and scaled, with fp16)
                    grad_norm = nn.utils.get_total_norm([p.grad for p in raw_model.parameters() if p.grad is not None])
                    grad_norm = grad_norm / scaler.get_scale() if scaler.is_enabled() else grad_norm
                window.count_step(grad_norm, cfg.train.grad_clip)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            step += 1
            window_steps += 1
            faults.maybe_die("step", step, rank)

            if step % cfg.run.log_every == 0 or step == total_steps:
                dist.all_reduce(loss_sum)
                elapsed = time.perf_counter() - window_start
                record = {"step": step, "epoch": epoch, "loss": loss_sum.item() / (window_steps * world),
                          "lr": scheduler.get_last_lr()[0],
                          "samples_per_s": window_steps * cfg.train.batch_size * cfg.train.grad_accum * world / elapsed,
                          "data_wait_pct": 100 * data_wait / elapsed, "peak_memory_mb": peak_memory_mb(device),
                          **window.figures()}
                if rank == 0:
                    _log_line(run_dir, record)
                    for key, value in record.items():
                        if key not in ("step", "epoch"):
                            writer.add_scalar(f"train/{'acc' if key == 'train_acc' else key}", value, step)
                    bar.set_postfix(f"loss {record['loss']:.4f}, lr {record['lr']:.2e}")
                window_start, data_wait, window_steps = time.perf_counter(), 0.0, 0
                loss_sum.zero_()
                window = TrainWindow(device)
            if rank == 0:
                bar.update(1)
            stopped, diverged_on = stop.agreed(device, step_loss, rank)
            if diverged_on >= 0:
                raise _diverged(cfg, checkpoints, step, diverged_on)
            if stopped or step % cfg.checkpoint.every_steps == 0:
                with phase("checkpoint"):
                    save({})
            profile_done(profiler.step_done(step), cfg, rank, world, log)
            if stopped:
                log(f"stopped by signal at step {step}; checkpoint saved, resume with the same command", flush=True)
                break
        if stopped:
            break
        if batches_done + cfg.train.grad_accum > len(train_loader):  # the epoch is complete
            epoch, batches_done = epoch + 1, 0
            if val_loader is not None:
                loader_generator.manual_seed(cfg.run.seed)
                with phase("validation"):
                    metrics = evaluate(raw_model, val_loader, device, autocast, cfg.num_classes, task)
                confusion = metrics.pop("val_confusion")  # in metrics.jsonl only, not in checkpoints
                figures = task.val_figures(confusion, cfg.data.classes)
                metrics.update({k: v for k, v in figures.items() if not isinstance(v, dict)})  # val_miou, ...
                if rank == 0:
                    per_class_figures = {k: v for k, v in figures.items() if isinstance(v, dict)}
                    _log_line(run_dir, {"step": step, "epoch": epoch - 1, **metrics, "val_confusion": confusion,
                                        **per_class_figures})
                    for key, value in metrics.items():
                        writer.add_scalar(f"val/{key[4:]}", value, step)
                    for key, values in per_class_figures.items():
                        for name, value in values.items():
                            if value is not None:  # a class seen nowhere has no IoU
                                writer.add_scalar(f"val/{key[4:]}/{name}", value, step)
                    log(f"epoch {epoch - 1}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
            with phase("checkpoint"):
                save(metrics)

    # --- finish: last checkpoint, the trained-model directory, the run manifest --------------------
    if profiler.enabled and profiler.summary is None:
        log("profile: the run ended before the profiling window did; no profile.html", flush=True)
    profiler.close()
    if not stopped:
        save(metrics)
        if not checkpoints.shared:
            # Every node gets the trained model and a manifest: rank 0's weights and buffers (the
            # other ranks' BatchNorm statistics differ from rank 0's until DDP's next forward).
            for tensor in raw_model.state_dict().values():
                dist.broadcast(tensor, src=0)
        if rank == 0 or local_rank == 0 and not checkpoints.shared:
            if bar is not None:
                bar.close()
            save_trained_model(run_dir / "model", raw_model, card, onnx_graph=onnx_graph)
            if writer is not None:  # rank 0: its metrics.jsonl and TensorBoard events
                writer.flush()
                write_training_report(run_dir, cfg.data.classes)
            write_run_manifest(cfg, run_dir, step, checkpoints.storage, init_report)
            log(f"trained {step} steps; model: {run_dir / 'model'}", flush=True)
    if writer is not None:
        writer.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def start_profiler(cfg: Config, device, rank: int, step: int, total_steps: int, log):
    """profiling.OFF, or a StepProfiler whose window fits the steps this attempt has left. Every
    rank takes rank 0's [profile] figures, so all of them reach the report's collective."""
    p = cfg.profile
    steps, wait, warmup = (_broadcast_int(v) for v in (p.steps, p.wait, p.warmup))
    if steps == 0:
        return profiling.OFF
    wait, warmup, active = profiling.window(steps, wait, warmup, total_steps - step)
    if active == 0:
        log("profile: no step left to profile", flush=True)
        return profiling.OFF
    if (wait, warmup, active) != (p.wait, p.warmup, steps):
        log(f"profile: {total_steps - step} steps left: profiling {active} after wait {wait}, warmup {warmup}",
            flush=True)
    return profiling.StepProfiler(device, wait, warmup, active, first_step=step,
                                  trace_dir=cfg.run_dir / "tb" / profiling.TRACE_DIR, rank=rank,
                                  top_operators=p.top_operators)


def profile_done(summary: dict | None, cfg: Config, rank: int, world: int, log) -> None:
    """Right after the window (the same step on every rank): gather every rank's summary; rank 0
    writes profile.json and profile.html."""
    if summary is None:
        return

    summaries = _all_gather_json(summary)
    if rank == 0:
        _, html_path = write_profile_report(cfg.run_dir, summaries, cfg, world)
        log(f"profile of steps {summary['steps'][0]}-{summary['steps'][1]}: {html_path}", flush=True)


def _diverged(cfg: Config, checkpoints: CheckpointManager, step: int, on_rank: int) -> TrainingDiverged:
    found = checkpoints.committed() if checkpoints.rank == 0 else []
    newest = _broadcast_int(found[-1][0] if found else -1)
    kept = (f"the newest checkpoint step-{newest:08d} is the resume point" if newest >= 0
            else "no checkpoint was written yet")
    return TrainingDiverged(
        f"{cfg.source}: the training loss is not finite (NaN or inf) at step {step} (rank {on_rank}); every "
        f"process stopped without saving, {kept}; lower [optimizer] lr or set [train] grad_clip")


_progress: list = []  # rank 0's progress bar, once it exists


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="appliance.train.loop", description="one training process (under torchrun)")
    parser.add_argument("config")
    parser.add_argument("--resume", default="auto")
    parser.add_argument("--profile", type=int, default=None, metavar="STEPS")
    args = parser.parse_args(argv)
    die_with_launcher()
    rank = os.environ.get("RANK", "0")
    run_dir = None
    try:
        cfg = load_config(args.config)
        if args.profile is not None:
            import dataclasses

            cfg = dataclasses.replace(cfg, profile=dataclasses.replace(cfg.profile, steps=args.profile))
        run_dir = cfg.run_dir
        try:
            return train(cfg, args.resume)
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT) or not err.filename:
                raise
            # A full disk outside a checkpoint save (metrics, TensorBoard, the final model).
            raise EnvironmentProblem(f"{err.filename}: {err.strerror}; checkpoints in {run_dir / 'checkpoints'} "
                                     "are intact: free space, then resume with the same command") from None
    except ApplianceError as err:
        # Raised in a DataLoader worker, the message carries the worker's traceback: keep its last line.
        line = str(err).strip().splitlines()[-1]
        line = line.split(": ", 1)[1] if line.startswith("appliance.core.errors.") else line
        _close_progress()
        if run_dir is not None:
            worker_error.record(run_dir, line)
        if not os.environ.get(worker_error.LAUNCHER_ENV):  # under `appliance train` the launcher prints it
            print(f"appliance train: error: {line}", file=sys.stderr, flush=True)
        _exit_now(worker_error.EXIT_STATUS)
    except BaseException:
        _close_progress()
        peer = worker_error.read(run_dir) if run_dir is not None else None
        if peer is not None:  # a collective failed because another rank stopped with its error line
            if not os.environ.get(worker_error.LAUNCHER_ENV):
                print(f"appliance train: rank {rank} stopped: another process failed ({peer})", file=sys.stderr,
                      flush=True)
        else:
            traceback.print_exc()
        _exit_now(1)


def _close_progress() -> None:
    for bar in _progress:
        bar.close()


def die_with_launcher() -> None:
    """Ask Linux to SIGKILL this worker when its torchrun agent dies.

    torchrun starts workers in sessions of their own, so a `kill -9` of `appliance train` (or of
    the pipeline around it) would otherwise leave them training on, writing checkpoints beside
    the run that resumes them.
    """
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: nothing to ask for
    if os.getppid() != parent:  # the agent died before prctl took effect
        _exit_now(1)


def _exit_now(status: int) -> None:
    """Leave without interpreter teardown, which can hang in DataLoader or process-group cleanup
    while peer ranks wait in a collective; our exit makes them fail fast, and torchrun restarts
    or ends the job. Checkpoints are atomic, so nothing is lost."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
