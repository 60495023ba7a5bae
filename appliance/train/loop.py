"""The training loop, one process per device, started by torchrun (see launcher.py).

`train()` reads top to bottom: set up (setup.py), resume, then epochs of optimizer steps
(step.train_step) with the components that act now and then (components.py: logging, checkpoints,
validation), then the finish. No step reads a value back from the device: losses, metrics and the
non-finite-loss check accumulate there and are read every `log_every` steps and before anything is
written. SIGTERM/SIGINT end the run at a step boundary with a checkpoint, so `--resume auto`
continues exactly there. A non-finite loss on any rank stops every rank without saving, so the
newest checkpoint stays the resume point. An ApplianceError in a worker is one line, left in
RUN_DIR/.worker-error for the launcher. A finished worker leaves like the error paths (os._exit),
after the process group is gone and every file is written: interpreter teardown could abort in a
C++ destructor (a thread still joinable) after the run had succeeded.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import os
import signal
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from appliance.core.errors import ApplianceError, ConfigError, DataError, EnvironmentProblem
from appliance.core.manifest import write_manifest
from appliance.core.progress import Progress
from appliance.models import save_trained_model
from appliance.train import data, faults, profiling, worker_error
from appliance.train.collectives import all_gather_json, broadcast_int
from appliance.train.components import (Checkpointing, MetricsLog, TrainingDiverged, Validation, check_finite,
                                        log_line)
from appliance.train.config import Config, load_config
from appliance.train.profile_report import PROFILE_HTML, PROFILE_JSON, write_profile_report
from appliance.train.report import REPORT_HTML, REPORT_JSON, write_training_report
from appliance.train.result import METRICS_NAME
from appliance.train.setup import INIT_REPORT, STORAGE_WORDS, Run, build, printer, resume as resume_run, start_processes
from appliance.train.step import Guard, TrainWindow, train_step

__all__ = ["INIT_REPORT", "STORAGE_WORDS", "TrainWindow", "TrainingDiverged", "main", "train", "write_run_manifest"]

FINISHED = worker_error.FINISHED_NAME


def write_run_manifest(cfg: Config, run_dir: Path, step: int, checkpoint_storage: str = "shared",
                       init_report: dict | None = None, tf32: bool = False, compiled: bool = False,
                       cuda_graphs: bool = False) -> None:
    """runs/<name>/manifest.json: the data files (sha256) and the init weights in, the model and metrics out;
    whether the kernels were deterministic, TF32 allowed for float32 matmuls and convolutions, and the
    model torch.compile'd and its kernels replayed as CUDA graphs ([train] compile as resolved here)."""
    outputs = sorted((run_dir / "model").iterdir())
    # metrics.jsonl and the training report are on rank 0's node only, with per-node storage.
    outputs += [path for path in (run_dir / METRICS_NAME, run_dir / REPORT_JSON, run_dir / REPORT_HTML,
                                  run_dir / PROFILE_JSON, run_dir / PROFILE_HTML) if path.is_file()]
    inputs = [cfg.source, *cfg.data.train, *cfg.data.val] + ([cfg.data.check_report] if cfg.data.check_report else [])
    if init_report is not None:
        inputs.append(init_report["path"])  # its sha256 then travels in the lineage to the edge package
    write_manifest(run_dir, "train", inputs, {"config": cfg.to_dict(), "steps": step,
                                              "config_hash": cfg.training_hash(), "init": init_report,
                                              "checkpoint_storage": checkpoint_storage,
                                              "deterministic": cfg.run.deterministic, "tf32": tf32,
                                              "compile": compiled, "cuda_graphs": cuda_graphs},
                   outputs=outputs)


def train(cfg: Config, resume: str = "auto") -> int:
    run = build(start_processes(cfg, printer(_progress)))
    resume_run(run, resume, log_line)
    writer = bar = None
    if run.rank == 0:
        from tensorboardX import SummaryWriter

        # Its "NaN or Inf found in input tensor." went to stderr above the guard's one error line: a
        # non-finite value is the guard's to name (and the epoch line shows val_loss nan).
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        writer = SummaryWriter(str(cfg.run_dir / "tb"))
        bar = Progress(total=run.total_steps, initial=run.step, desc="train", unit="step", every=30)
        _progress.append(bar)  # closed before an error line, which then starts a line of its own
    guard = Guard(run.device, run.rank, run.world, run.total_steps)
    logs, checkpoints, validation = MetricsLog(run, writer, bar), Checkpointing(run), Validation(run, writer)
    run.model.train()
    run.profiler = start_profiler(cfg, run.device, run.rank, run.step, run.total_steps, run.log)
    stopped = False
    while run.step < run.total_steps and not stopped:
        run.sampler.set_epoch(run.epoch)  # keeps the position of a resumed epoch; augmentation is seeded by (seed, epoch, index)
        run.loader_generator.manual_seed(cfg.run.seed * 100_003 + run.epoch * 1009 + run.rank)
        with run.profiler.phase("data_wait"):  # the first epoch starts the loader's workers; they persist
            batches = iter(run.train_loader)
        logs.new_window()
        stopped = run_epoch(run, batches, guard, logs, checkpoints, bar)
        if not stopped and run.batches_done + cfg.train.grad_accum > len(run.train_loader):  # the epoch is complete
            run.epoch, run.batches_done = run.epoch + 1, 0
            check_finite(run, guard)
            if validation.due():
                run.metrics = validation.evaluate(run.profiler.phase)
            with run.profiler.phase("checkpoint"):
                checkpoints.save(run.metrics)
    finish(run, guard, checkpoints, stopped, writer, bar)
    return 0


def run_epoch(run: Run, batches, guard: Guard, logs: MetricsLog, checkpoints: Checkpointing, bar) -> bool:
    """Optimizer steps to the epoch's end or the run's; True when a signal stopped the run (saved)."""
    cfg, phase = run.cfg, run.profiler.phase
    while run.batches_done + cfg.train.grad_accum <= len(run.train_loader) and run.step < run.total_steps:
        step_loss = train_step(run, batches, logs.window)
        guard.note(step_loss, run.step + 1)
        run.batches_done += cfg.train.grad_accum
        run.step += 1
        step = run.step
        faults.maybe_die("step", step, run.rank)
        stopped = guard.stop_requested()
        if logs.due(step) or checkpoints.due(step, stopped):  # the same steps on every rank
            stopped = check_finite(run, guard) or stopped  # raises before anything of a non-finite loss is written
            if logs.due(step):
                logs.write(step)
        if bar is not None:
            bar.update(1)
        if checkpoints.due(step, stopped):
            with phase("checkpoint"):
                checkpoints.save({})
        profile_done(run.profiler.step_done(step), cfg, run.rank, run.world, run.log)
        if stopped:
            run.log(f"stopped by signal at step {step}; checkpoint saved, resume with the same command", flush=True)
            return True
    return False


def finish(run: Run, guard: Guard, checkpoints: Checkpointing, stopped: bool, writer, bar) -> None:
    """The last checkpoint, the trained-model directory, the report and the run manifest; then the
    loaders' workers, a barrier, the finished mark and the process group, in that order."""
    cfg, rank = run.cfg, run.rank
    if run.profiler.enabled and run.profiler.summary is None:
        run.log("profile: the run ended before the profiling window did; no profile.html", flush=True)
    run.profiler.close()
    writes_model = rank == 0 or run.local_rank == 0 and not run.checkpoints.shared
    if not stopped:
        check_finite(run, guard)
        checkpoints.save(run.metrics)
        if not run.checkpoints.shared:
            # Every node gets the trained model and a manifest: rank 0's weights and buffers (the
            # other ranks' BatchNorm statistics differ from rank 0's until DDP's next forward).
            for tensor in run.raw_model.state_dict().values():
                dist.broadcast(tensor, src=0)
        if writes_model:
            if bar is not None:
                bar.close()
            save_trained_model(cfg.run_dir / "model", run.raw_model, run.card, onnx_graph=run.onnx_graph)
            if writer is not None:  # rank 0: its metrics.jsonl and TensorBoard events
                writer.flush()
                write_training_report(cfg.run_dir, cfg.data.classes)
            write_run_manifest(cfg, cfg.run_dir, run.step, run.checkpoints.storage, run.init_report,
                               tf32=run.tf32, compiled=run.compiled,
                               cuda_graphs=run.cuda_graphs)
            run.log(f"trained {run.step} steps; model: {cfg.run_dir / 'model'}", flush=True)
    if writer is not None:
        writer.close()
    guard.drain()
    for loader in (run.train_loader, run.val_loader):
        shut_down_workers(loader)
    dist.barrier()
    if not stopped:
        if writes_model:
            (cfg.run_dir / FINISHED).write_text(f"{run.step}\n")
        dist.barrier()  # the mark is there before any rank can die
        faults.maybe_die("finished", run.step, rank, signal.SIGABRT)  # the test of a late crash
    dist.destroy_process_group()


def shut_down_workers(loader) -> None:
    """End a DataLoader's persistent worker processes now, not in a destructor at teardown.

    torch asks each worker to leave, waits 5 s, then sends SIGTERM, which our workers ignore by
    design (data._worker_ignores_stop_signals), and waits 5 s more. A worker still there after that
    (stuck, or starved on a loaded box) would outlive its rank: orphaned, holding the launcher's
    pipes, in whatever wait it was in. It is killed instead: the run needs nothing more from it."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        workers = list(getattr(iterator, "_workers", []))
        iterator._shutdown_workers()
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=30)
        loader._iterator = None


def start_profiler(cfg: Config, device, rank: int, step: int, total_steps: int, log):
    """profiling.OFF, or a StepProfiler whose window fits the steps this attempt has left. Every
    rank takes rank 0's [profile] figures, so all of them reach the report's collective."""
    p = cfg.profile
    steps, wait, warmup = (broadcast_int(v) for v in (p.steps, p.wait, p.warmup))
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
    summaries = all_gather_json(summary)
    if rank == 0:
        _, html_path = write_profile_report(cfg.run_dir, summaries, cfg, world)
        log(f"profile of steps {summary['steps'][0]}-{summary['steps'][1]}: {html_path}", flush=True)


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
            cfg = dataclasses.replace(cfg, profile=dataclasses.replace(cfg.profile, steps=args.profile))
        run_dir = cfg.run_dir
        try:
            train(cfg, args.resume)
            faults.record_teardown(rank, data.THREADS_AT_FORK)  # a test hook: unset in production
            _exit_now(0)  # everything is written and the process group is gone: no teardown to abort in
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
        if run_dir is not None:  # a record or the config at fault: a restart would meet it again
            worker_error.record(run_dir, line, final=isinstance(err, (DataError, ConfigError)))
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
