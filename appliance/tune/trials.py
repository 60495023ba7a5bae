"""One trial as a real training run: `appliance train TRIAL/config.toml` in its own process (torchrun,
its own run directory and checkpoints, exact resume), watched through the metrics.jsonl it writes.

The tuner reads each epoch's validation record as the run appends it, so the pruner can stop a
trial between epochs (SIGTERM: the workers stop at a step boundary and checkpoint, as for Ctrl-C).
A trial whose process dies with the tuner (PR_SET_PDEATHSIG) is resumed from its newest checkpoint
when `appliance tune` starts again.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from appliance.core.dirlock import DirectoryInUse, directory_lock
from appliance.train.result import METRICS_NAME  # what `appliance train` appends in its run directory

LOG_NAME = "train.log"
GATE_FAILED = 3  # `appliance train`'s exit status when the run finished and its quality gate did not pass
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: a killed tuner leaves the trial running; the restart waits for its lock


def train_command(config: Path, nproc: int | str) -> list[str]:
    return [sys.executable, "-m", "appliance", "train", str(config), "--nproc-per-node", str(nproc), "--quiet"]


def wait_until_free(run_dir: Path, timeout_s: float = 600.0) -> None:
    """A trial left by a killed tuner may still be checkpointing: wait for its run directory's lock."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with directory_lock(run_dir, "run directory"):
                return
        except DirectoryInUse:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def epoch_values(metrics: Path, objective: str) -> dict[int, float]:
    """epoch -> the objective at that epoch's validation pass, from the lines written so far."""
    values = {}
    try:
        text = metrics.read_text()
    except FileNotFoundError:
        return values
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line being written
        if isinstance(record, dict) and objective in record and "epoch" in record:
            value = record[objective]
            values[int(record["epoch"])] = float(value) if isinstance(value, (int, float)) else math.nan
    return values


@dataclass
class TrialRun:
    """A running trial: its optuna trial, its run directory and its `appliance train` process."""

    trial: object  # optuna.trial.Trial
    run_dir: Path
    objective: str
    env: dict
    nproc: int | str
    slot: int = 0
    proc: subprocess.Popen | None = None
    reported: set = field(default_factory=set)
    pruned: bool = False
    started: float = 0.0
    seconds: float = 0.0
    earlier_seconds: float = 0.0  # training time before a killed tuner's restart

    def start(self) -> None:
        wait_until_free(self.run_dir)
        log = open(self.run_dir / LOG_NAME, "ab")
        try:
            self.proc = subprocess.Popen(train_command(self.run_dir / "config.toml", self.nproc), stdout=log,
                                         stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                         preexec_fn=_die_with_parent)
        finally:
            log.close()
        self.started = time.monotonic()

    def new_values(self) -> list[tuple[int, float]]:
        """(epoch, value) of the validation passes not reported yet, in order."""
        values = epoch_values(self.run_dir / METRICS_NAME, self.objective)
        fresh = [(e, v) for e, v in sorted(values.items()) if e not in self.reported]
        self.reported.update(e for e, _ in fresh)
        return fresh

    def stop(self) -> None:
        """SIGTERM: the run stops at a step boundary and checkpoints (pruned, or the tuner is stopping)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def finished(self) -> bool:
        if self.proc is None or self.proc.poll() is None:
            return False
        self.seconds = time.monotonic() - self.started
        return True

    def outcome(self) -> tuple[float | None, str]:
        """(final objective, "") for a finished run, (None, the reason) for a failed one."""
        code = self.proc.returncode
        values = epoch_values(self.run_dir / METRICS_NAME, self.objective)
        if code in (0, GATE_FAILED) and values:
            value = values[max(values)]
            if not math.isfinite(value):
                return None, f"the final {self.objective} is not finite ({value})"
            return value, ""
        return None, self.reason(code)

    def reason(self, code: int) -> str:
        """The run's own error line (the last line it wrote), else its exit status."""
        try:
            lines = [ln.strip() for ln in (self.run_dir / LOG_NAME).read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        errors = [ln for ln in lines if ln.startswith("appliance train: ")]
        if errors:
            return errors[-1].removeprefix("appliance train: ").removeprefix("error: ")[:2000]
        return f"`appliance train` exited with status {code}" + (f": {lines[-1][:500]}" if lines else "")
