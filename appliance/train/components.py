"""The parts of the loop that act now and then, each deciding when (the torchtitan way): logging
every `log_every` steps, checkpoints every `every_steps` steps and on a stop, validation at an
epoch's end. Each reads from the device only when it acts; before anything is written the Guard's
agreement runs, so a non-finite loss stops every rank and is never saved.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from appliance.core.errors import ApplianceError
from appliance.train.collectives import broadcast_int
from appliance.train.result import METRICS_NAME
from appliance.train.determinism import rng_state
from appliance.tasks import task_for
from appliance.train.step import Guard, TrainWindow, to_device


class TrainingDiverged(ApplianceError):
    """The loss became NaN or infinite."""


def log_line(run_dir: Path, record: dict) -> None:
    with open(run_dir / METRICS_NAME, "a") as f:
        f.write(json.dumps(record) + "\n")


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def check_finite(run, guard: Guard) -> bool:
    """The Guard's agreement (a collective): whether to stop; raises TrainingDiverged if any rank's
    loss was not finite since the start, before the caller writes anything."""
    stop, bad_step, bad_rank = guard.agree()
    if bad_step >= 0:
        raise diverged(run, bad_step, bad_rank)
    return stop


def diverged(run, step: int, on_rank: int) -> TrainingDiverged:
    found = run.checkpoints.committed() if run.checkpoints.rank == 0 else []
    newest = broadcast_int(found[-1][0] if found else -1)
    kept = (f"the newest checkpoint step-{newest:08d} is the resume point" if newest >= 0
            else "no checkpoint was written yet")
    return TrainingDiverged(
        f"{run.cfg.source}: the training loss is not finite (NaN or inf) at step {step} (rank {on_rank}); every "
        f"process stopped without saving, {kept}; lower [optimizer] lr or set [train] grad_clip")


class MetricsLog:
    """metrics.jsonl, TensorBoard and the progress bar's figures, every log_every steps and at the end."""

    def __init__(self, run, writer, bar):
        self.run, self.writer, self.bar = run, writer, bar
        self.window = TrainWindow(run.device, run.cfg.train.grad_clip)

    def due(self, step: int) -> bool:
        return step % self.run.cfg.run.log_every == 0 or step == self.run.total_steps

    def new_window(self) -> None:
        self.window = TrainWindow(self.run.device, self.run.cfg.train.grad_clip)

    def write(self, step: int) -> None:
        """The window's figures (a collective; the only read of them), then a new window."""
        run, window = self.run, self.window
        cfg = run.cfg
        figures = window.figures()
        elapsed = time.perf_counter() - window.start
        record = {"step": step, "epoch": run.epoch, "loss": figures.pop("loss_sum") / (window.steps * run.world),
                  "lr": run.scheduler.get_last_lr()[0],
                  "samples_per_s": window.steps * cfg.train.batch_size * cfg.train.grad_accum * run.world / elapsed,
                  "data_wait_pct": 100 * window.data_wait / elapsed, "peak_memory_mb": peak_memory_mb(run.device),
                  **figures}
        if run.rank == 0:
            log_line(cfg.run_dir, record)
            for key, value in record.items():
                if key not in ("step", "epoch"):
                    self.writer.add_scalar(f"train/{'acc' if key == 'train_acc' else key}", value, step)
            self.bar.set_postfix(f"loss {record['loss']:.4f}, lr {record['lr']:.2e}")
        self.new_window()


class Checkpointing:
    """A checkpoint every every_steps steps, on a stop, at an epoch's end and at the finish."""

    def __init__(self, run):
        self.run = run

    def due(self, step: int, stopped: bool) -> bool:
        return stopped or step % self.run.cfg.checkpoint.every_steps == 0

    def save(self, metrics: dict) -> None:
        run = self.run
        trainer = {"epoch": run.epoch, "batches_done": run.batches_done, "sampler": run.sampler.state_dict(),
                   "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(), "metrics": metrics,
                   "config_hash": run.cfg.training_hash()}
        run.checkpoints.save(run.step, model=run.raw_model, card=run.card,
                             optimizer_state=run.local_optimizer.state_dict(),
                             optimizer_sharded=run.cfg.optimizer.zero_redundancy, trainer=trainer, rng=rng_state())


@torch.no_grad()
def evaluate(model, loader, device, autocast, num_classes: int = 0, normalise=None,
             memory_format=torch.contiguous_format, task=None, graphs: bool = False) -> dict:
    """Loss and top-1 over the whole validation set (each record counted once across ranks), and
    with num_classes the confusion counts val_confusion[true][predicted] (for the quality gate).
    The task (default classification) says what is counted: images, or labelled pixels.

    Takes the unwrapped model: shares may differ by a batch between ranks, and DDP's forward
    would run collectives. Rank 0's buffers (BatchNorm statistics) are what gets saved, so
    every rank evaluates with them. With `graphs` (the model's kernels replayed as CUDA graphs) each
    batch starts a new replay: the last batch's outputs are not read again."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device)
    task = task or task_for(None)
    collector = task.val_collector() if hasattr(task, "val_collector") else None  # detection: boxes, not counts
    for images, labels in loader:
        images, labels = to_device(images, labels, device, normalise, memory_format)
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast():
            logits = model(images)
        loss, correct, counted, pairs = task.eval_counts(logits, labels, num_classes)
        totals[0] += loss
        totals[1] += correct
        totals[2] += counted
        if collector is not None:
            collector.add(logits, labels)
        elif num_classes:
            # On the CPU: CUDA's bincount has no deterministic kernel (use_deterministic_algorithms refuses it).
            pairs = pairs.cpu()
            confusion += torch.bincount(pairs, minlength=num_classes ** 2).to(device)
    dist.all_reduce(totals)
    model.train()
    count = max(totals[2].item(), 1)
    metrics = {"val_loss": totals[0].item() / count, "val_acc": totals[1].item() / count}
    if collector is not None:  # the task's rows (detection: COCO AP per class) stand for the confusion counts
        del metrics["val_acc"]
        metrics["val_confusion"] = collector.rows()
    elif num_classes:
        dist.all_reduce(confusion)
        metrics["val_confusion"] = confusion.view(num_classes, num_classes).tolist()
    return metrics


class Validation:
    """Evaluation at an epoch's end: metrics.jsonl (with the confusion counts), TensorBoard, a line."""

    def __init__(self, run, writer):
        self.run, self.writer = run, writer

    def due(self) -> bool:
        return self.run.val_loader is not None

    def evaluate(self, phase) -> dict:
        """The validation figures of the epoch just ended (run.epoch is already the next one)."""
        run, cfg = self.run, self.run.cfg
        run.loader_generator.manual_seed(cfg.run.seed)
        with phase("validation"):
            metrics = evaluate(run.raw_model, run.val_loader, run.device, run.autocast, cfg.num_classes,
                               run.normalise, run.memory_format, run.task, run.cuda_graphs)
        confusion = metrics.pop("val_confusion")  # in metrics.jsonl only, not in checkpoints
        figures = run.task.val_figures(confusion, cfg.data.classes)
        metrics.update({k: v for k, v in figures.items() if not isinstance(v, dict)})  # val_miou, ...
        if run.rank == 0:
            step, writer = run.step, self.writer
            per_class_figures = {k: v for k, v in figures.items() if isinstance(v, dict)}
            log_line(cfg.run_dir, {"step": step, "epoch": run.epoch - 1, **metrics, "val_confusion": confusion,
                                   **per_class_figures})
            for key, value in metrics.items():
                writer.add_scalar(f"val/{key[4:]}", value, step)
            for key, values in per_class_figures.items():
                for name, value in values.items():
                    if value is not None:  # a class seen nowhere has no IoU
                        writer.add_scalar(f"val/{key[4:]}/{name}", value, step)
            run.log(f"epoch {run.epoch - 1}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
        return metrics
