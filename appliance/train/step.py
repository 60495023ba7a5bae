"""One optimizer step, and what a step counts, with no host-device synchronisation.

`train_step` runs the micro-batches of one optimizer step (gradient accumulation, clipping, the
scaled optimizer step, the schedule) and leaves every figure on the device: the loss in a device
sum, gradient norms and training hits in a `TrainWindow`, a non-finite loss in the `Guard`. The
host reads them only where it must (components.py): every `log_every` steps, before every
checkpoint, at an epoch's end and at the finish. So on a GPU the host runs ahead of the kernels.
"""

from __future__ import annotations

import contextlib
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

from appliance.train import faults

FOLD_EVERY = 64  # per-step device scalars kept before they are reduced (a bound on what is held)


class Guard:
    """SIGTERM/SIGINT and non-finite losses, agreed by every rank without a read per step.

    Each step's loss is kept as it is (`note`: no device work per step); `agree()` (a few device
    operations, one collective and one read) says whether any rank's was not finite since the
    start, at which step first and on which rank. The components call it before anything is
    written, so a NaN never reaches a checkpoint or the final model.

    The stop signal is host state. One process stops at the next step boundary. Several agree on
    it through a small all-reduce started each step and read LAG steps later (every rank reads the
    same step's result at the same step, so all stop together, at most LAG steps after the signal);
    by then the GPU has long finished it, so the read does not wait for the step in flight.
    """

    LAG = 2

    def __init__(self, device, rank: int, world: int, horizon: int):
        self.device, self.rank, self.world, self.horizon = device, rank, world, horizon + 1
        self.local = False
        self._first_bad = torch.zeros((), dtype=torch.int64, device=device)  # 0: every loss finite
        self._losses: list[torch.Tensor] = []  # step losses not yet looked at, and their steps
        self._steps: list[int] = []
        self._pending: list = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._set)

    def _set(self, signum, frame):
        # A second signal is normal (the job's process group, then torchrun, both send one), so
        # it changes nothing; torchrun's SIGKILL after its grace period is the hard stop.
        self.local = True

    def note(self, step_loss: torch.Tensor, step: int) -> None:
        """Keep the step's loss (a reference, no device work); `agree()` looks at the kept ones."""
        self._losses.append(step_loss.detach())
        self._steps.append(step)
        if len(self._losses) >= FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        """Remember the first kept step whose loss is not finite, as a code whose maximum over ranks is
        the earliest such step (then the lowest rank): (horizon - step) * (world + 1) + (world - rank).
        A few device operations for many steps; no read."""
        if not self._losses:
            return
        losses = torch.stack(self._losses)
        steps = torch.tensor(self._steps, dtype=torch.int64).to(self.device, non_blocking=True)
        codes = (self.horizon - steps) * (self.world + 1) + (self.world - self.rank)
        first = torch.where(~torch.isfinite(losses), codes, 0).max()  # the earliest step has the largest code
        self._first_bad = torch.where(self._first_bad == 0, first, self._first_bad)
        self._losses.clear()
        self._steps.clear()

    def stop_requested(self) -> bool:
        """Called at every step boundary, the same on every rank; no wait for the step in flight."""
        if self.world == 1:
            return self.local
        flag = torch.full((1,), int(self.local), dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # NCCL: queued on the stream, the host goes on
        event = None
        if self.device.type == "cuda":  # a copy to pinned memory and an event: the read waits for this step only
            host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            flag = host
        self._pending.append((flag, event))
        if len(self._pending) <= self.LAG:
            return False
        flag, event = self._pending.pop(0)
        if event is not None:
            event.synchronize()
        return bool(flag[0])

    def agree(self) -> tuple[bool, int, int]:
        """(stop, the first step whose loss was not finite or -1, its rank or -1): a collective."""
        self._fold()
        flags = torch.stack([torch.tensor(int(self.local), dtype=torch.int64, device=self.device), self._first_bad])
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, code = flags.tolist()
        if code == 0:
            return bool(stop), -1, -1
        return bool(stop), self.horizon - code // (self.world + 1), self.world - code % (self.world + 1)

    def drain(self) -> None:
        """Forget the stop flags still to be read (at the end, before the process group goes)."""
        for _, event in self._pending:
            if event is not None:
                event.synchronize()
        self._pending.clear()


class TrainWindow:
    """Counts of one logging window, kept on the device so a step adds no host sync: gradient
    norms (before clipping), clipped steps, and top-1 hits of the training batches' own logits.

    A step only keeps its device scalars (norm, loss, hits); they are reduced every FOLD_EVERY
    steps and when the window is read, a few operations for many steps. The gradients are already
    averaged across ranks, so the norm is the same on every rank; the accuracy counts are summed
    across ranks when the window is logged."""

    def __init__(self, device, clip: float = 0.0):
        # norm sum, max, clipped steps, steps with a non-finite norm, correct, seen, loss sum
        self.counts = torch.zeros(7, dtype=torch.float64, device=device)
        self.clip = clip
        self.steps = 0
        self.data_wait = 0.0
        self.start = time.perf_counter()
        self._norms: list[torch.Tensor] = []
        self._losses: list[torch.Tensor] = []
        self._correct: list[torch.Tensor] = []  # per micro-batch
        self._labelled: list[torch.Tensor] = []  # per micro-batch with ignored labels (segmentation's masks)
        self._labelled_host = 0  # labels counted on the host (classification: every label is a class)

    def count_predictions(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        if labels.is_floating_point():  # detection's box targets: no per-sample argmax to count
            return
        self._correct.append((logits.detach().argmax(1) == labels).sum())
        if labels.dim() == 1:  # class labels, each within the classes (the loader refuses others)
            self._labelled_host += labels.shape[0]
        else:  # a label past the logits (segmentation's ignored pixels) equals no argmax: no prediction to count
            self._labelled.append((labels < logits.shape[1]).sum())

    def count_loss(self, step_loss: torch.Tensor) -> None:
        self._losses.append(step_loss.detach())
        if len(self._losses) >= FOLD_EVERY:
            self._fold()

    def count_step(self, grad_norm: torch.Tensor) -> None:
        self.steps += 1
        self._norms.append(grad_norm.detach())

    def _fold(self) -> None:
        """The kept scalars into the counts (device operations only)."""
        counts = self.counts
        if self._norms:
            norms = torch.stack(self._norms).to(counts)
            finite = torch.isfinite(norms)  # not finite: an fp16 step the scaler skips (or a divergence)
            kept = torch.where(finite, norms, 0.0)
            counts[0] += kept.sum()
            counts[1] = torch.maximum(counts[1], kept.max())
            counts[3] += (~finite).sum()
            if self.clip > 0:
                # clip_grad_norm_ scales the gradients down exactly then
                counts[2] += (finite & (norms > self.clip)).sum()
        if self._correct:
            counts[4] += torch.stack(self._correct).to(counts).sum()
        if self._labelled:
            counts[5] += torch.stack(self._labelled).to(counts).sum()
        if self._labelled_host:
            counts[5] += self._labelled_host
        if self._losses:
            counts[6] += torch.stack(self._losses).to(counts).sum()
        self._norms.clear()
        self._correct.clear()
        self._labelled.clear()
        self._labelled_host = 0
        self._losses.clear()

    def figures(self) -> dict:
        """grad_norm (mean over the window's steps with a finite norm), grad_norm_max, clipped_fraction,
        nonfinite_grad_steps, train_acc, loss_sum (over ranks); a collective and the window's one read."""
        self._fold()
        summed = self.counts[4:].clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(summed)
        norm_sum, norm_max, clipped, nonfinite = self.counts[:4].tolist()
        correct, seen, loss_sum = summed.tolist()
        return {"grad_norm": norm_sum / max(self.steps - nonfinite, 1), "grad_norm_max": norm_max,
                "clipped_fraction": clipped / max(self.steps, 1), "nonfinite_grad_steps": int(nonfinite),
                "train_acc": correct / max(seen, 1), "loss_sum": loss_sum}


def to_device(images: torch.Tensor, labels: torch.Tensor, device, normalise, memory_format):
    """A batch onto the device; uint8 pixels cross as uint8 (a quarter of float32's bytes) and are
    scaled and normalised there by `normalise`."""
    images = images.to(device, non_blocking=True)
    labels = labels.to(device, non_blocking=True)
    if images.dtype == torch.uint8:
        images = normalise(images)
    if images.dim() == 4:
        images = images.contiguous(memory_format=memory_format)
    return images, labels


class Normalise:
    """uint8 [N, C, H, W] -> float32 (x / 255 - mean) / std, the arithmetic of
    data_tools.preprocessing.preprocess_image (same order of operations, float32)."""

    def __init__(self, mean, std, channels: int, device):
        def column(values):
            values = list(values) if len(values) == channels else [sum(values) / len(values)] * channels
            return torch.tensor(values, dtype=torch.float32, device=device).view(1, channels, 1, 1)

        self.mean, self.std = column(mean), column(std)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return (images.float() / 255.0 - self.mean) / self.std


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """nn.utils.get_total_norm's 2-norm, the same operations (a norm per tensor, the norm of those),
    without its grouping by device and dtype and its dynamo guard where the gradients share both:
    about 0.1 ms of a CPU step's host time (benchmarks/train_gpu.py)."""
    if not grads or any(g.device != grads[0].device or g.dtype != grads[0].dtype for g in grads):
        return nn.utils.get_total_norm(grads)
    with torch.no_grad():
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)


def train_step(run, batches, window: TrainWindow) -> torch.Tensor:
    """One optimizer step over grad_accum micro-batches; the step's loss (a device scalar).

    `run` is the loop's Run (setup.py): model (DDP-wrapped or not), its trainable parameters (listed
    once), optimizer, scaler, scheduler, sampler, autocast, profiler, device. Nothing here reads a
    value back from the device."""
    cfg, phase = run.cfg, run.profiler.phase
    accum = cfg.train.grad_accum
    if run.cuda_graphs:  # a new step: the graphs' outputs of the last one are not read again
        torch.compiler.cudagraph_mark_step_begin()
    step_loss = None
    for micro in range(accum):
        t0 = time.perf_counter()
        with phase("data_wait"):
            images, labels = next(batches)
            run.sampler.advance(len(labels))
        with phase("h2d_copy"):
            images, labels = to_device(images, labels, run.device, run.normalise, run.memory_format)
        window.data_wait += time.perf_counter() - t0
        # Gradients are averaged across ranks only on the last micro-batch.
        last = micro == accum - 1
        with contextlib.nullcontext() if last or not run.ddp else run.model.no_sync():
            with phase("forward"):
                with run.autocast():
                    logits = run.model(images)
                    loss = run.criterion(logits, labels)
                    loss = loss / accum if accum > 1 else loss  # x / 1 is x: one operation less per step
                window.count_predictions(logits, labels)
                if faults.armed("nan-loss", run.step + 1, run.rank):
                    loss = loss * float("nan")
            with phase("backward"):
                run.scaler.scale(loss).backward()
        step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
    with phase("optimizer"):
        scaler = run.scaler
        if cfg.train.grad_clip > 0:
            scaler.unscale_(run.optimizer)
            grad_norm = nn.utils.clip_grad_norm_(run.trainable, cfg.train.grad_clip)
        else:  # measured only: the gradients stay untouched (and scaled, with fp16)
            grad_norm = total_norm([p.grad for p in run.trainable if p.grad is not None])
            grad_norm = grad_norm / scaler._get_scale_async() if scaler.is_enabled() else grad_norm  # get_scale() reads
        window.count_step(grad_norm)
        scaler.step(run.optimizer)
        scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
        run.scheduler.step()
    window.count_loss(step_loss)
    return step_loss
