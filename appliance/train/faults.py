"""Test hook: fault injection for the resume and guard tests, never set in production.

APPLIANCE_TEST_FAULT="POINT:STEP:RANK" acts on rank RANK when it reaches POINT at optimizer step
STEP, on the first attempt only (torchrun's restart count 0), so the elastic restart that
follows runs clean. Points:
  step              SIGKILL after the optimizer step
  checkpoint-write  SIGKILL with this rank's files written, the checkpoint not yet committed
  nan-loss          this rank's loss of that step becomes NaN (the non-finite loss guard)
  finished          SIGABRT once the run is finished and committed (STEP: the last step), a late crash
  finished-hang     hang for ever at the same point, a late hang (the launcher kills it, reaper.py)
Unset or empty: does nothing. A malformed value is a ConfigError at start-up (`load()`).

APPLIANCE_TEST_SLOW_DECODE="SECONDS" makes every training sample's decode sleep that long (an
expensive decode, for the profiler's data-wait test), on every attempt.

APPLIANCE_TEST_LATE_HANG_S="SECONDS": how long the launcher waits for a finished run's processes to
leave before it kills them (default LATE_HANG_S), for the late-hang test.

APPLIANCE_TEST_TEARDOWN="DIR": a worker that finished writes DIR/rank-RANK.json just before it
leaves: whether the process group is still there, its live Python threads other than the main one,
its live child processes (DataLoader workers), for the teardown-order test. With it set, SIGUSR1
makes a worker (and each loader worker it forks) print every thread's Python stack on stderr
(faulthandler), so a test can see where a run that does not end is waiting before it kills it.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import signal
import threading
import time

from appliance.core.errors import ConfigError

ENV = "APPLIANCE_TEST_FAULT"
SLOW_DECODE_ENV = "APPLIANCE_TEST_SLOW_DECODE"
TEARDOWN_ENV = "APPLIANCE_TEST_TEARDOWN"
POINTS = ("step", "checkpoint-write", "nan-loss", "finished", "finished-hang")
LATE_HANG_ENV = "APPLIANCE_TEST_LATE_HANG_S"
LATE_HANG_S = 120.0  # after the finished mark, the run's processes get this long to leave

_fault: tuple[str, int, int] | None = None


def load() -> None:
    """Parse the environment once, at start-up; a malformed value is one line naming it."""
    global _fault
    spec = os.environ.get(ENV, "")
    _fault = None
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] not in POINTS or not all(p.isdigit() for p in parts[1:]):
        raise ConfigError(f"{ENV}={spec!r} is not POINT:STEP:RANK with POINT one of {', '.join(POINTS)} "
                          "(a test hook: unset it)")
    _fault = (parts[0], int(parts[1]), int(parts[2]))


def stacks_on_sigusr1() -> None:
    """Under APPLIANCE_TEST_TEARDOWN, SIGUSR1 prints every thread's stack (called before the loader
    workers are forked, so that they inherit it)."""
    if os.environ.get(TEARDOWN_ENV):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def armed(point: str, step: int, rank: int) -> bool:
    return _fault == (point, step, rank)


def maybe_die(point: str, step: int, rank: int, sig: int = signal.SIGKILL) -> None:
    if armed(point, step, rank):
        os.kill(os.getpid(), sig)
    if point == "finished" and armed("finished-hang", step, rank):
        while True:  # what the launcher's late-hang watchdog is for
            time.sleep(3600)


def late_hang_seconds() -> float:
    """How long the launcher lets a finished run's processes take to leave: LATE_HANG_S, or the
    test hook APPLIANCE_TEST_LATE_HANG_S (seconds) so a test need not wait two minutes."""
    spec = os.environ.get(LATE_HANG_ENV, "")
    try:
        seconds = float(spec or LATE_HANG_S)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= 3600:
        raise ConfigError(f"{LATE_HANG_ENV}={spec!r} is not a number of seconds up to 3600 (a test hook: unset it)")
    return seconds


def slow_decode_seconds() -> float:
    spec = os.environ.get(SLOW_DECODE_ENV, "")
    try:
        seconds = float(spec or 0)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < 60:
        raise ConfigError(f"{SLOW_DECODE_ENV}={spec!r} is not a number of seconds (a test hook: unset it)")
    return seconds


def record_teardown(rank: str, threads_at_fork: list[int]) -> None:
    """What is still alive as a finished worker leaves, and how many threads it had each time it
    forked its loader workers (APPLIANCE_TEST_TEARDOWN only)."""
    where = os.environ.get(TEARDOWN_ENV, "")
    if not where:
        return
    import torch.distributed as dist  # lazy: heavy, and loaded already in a worker

    state = {"process_group": dist.is_available() and dist.is_initialized(),
             "threads": sorted(t.name for t in threading.enumerate()
                               if t is not threading.main_thread() and t.is_alive()),
             "children": sorted(p.pid for p in multiprocessing.active_children()),
             "threads_at_fork": threads_at_fork}
    with open(os.path.join(where, f"rank-{rank}.json"), "w") as f:
        json.dump(state, f)
