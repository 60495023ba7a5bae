"""No process of a training run outlives `appliance train`, and a run that finished stays finished.

torchrun starts each worker in a session of its own, and a worker's DataLoader workers are forks
that carry no parent-death signal (the kernel clears it on fork) and ignore SIGTERM (data.py). A
process of the run that hangs while leaving would hold the launcher's stdout and stderr open after
torchrun is gone, and one that hangs before leaving would keep torchrun waiting for ever. So:

- the launcher is a child subreaper (Linux): an orphan of the run becomes our child, not init's;
- every process of the run carries `marker` in its environment (the worker-error file's path,
  which is the run's own), so the launcher can tell the run's processes from anyone else's;
- once the run's finished mark exists, the launcher gives the processes `late_hang_s` to leave;
  then it kills every process of the run and names the ones that hung (the run is finished: its
  model and manifest were committed before the mark);
- after torchrun exits, any process of the run still alive is killed and named.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphans of the processes we start become our children (Linux; elsewhere nothing happens)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process we can see (/proc/PID/stat: not every kernel has
    /proc/PID/task/TID/children)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return parents


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def run_processes(marker: tuple[str, str]) -> list[int]:
    """Our descendants (torchrun, its workers, their loader workers, adopted orphans) that carry the
    run's marker (NAME, VALUE) in their environment."""
    parents, ours = _parents(), {os.getpid()}
    grew = True
    while grew:
        found = {pid for pid, parent in parents.items() if parent in ours} - ours
        ours |= found
        grew = bool(found)
    return sorted(pid for pid in ours - {os.getpid()} if _environ(pid).get(marker[0]) == marker[1])


def describe(pid: int) -> str:
    """'rank R (pid P)' for a training worker, 'a loader worker of rank R (pid P)' for its forks."""
    env = _environ(pid)
    rank = env.get("RANK")
    if rank is None:
        return f"pid {pid}"
    parent = _parents().get(pid, 0)
    forked = _environ(parent).get("RANK") == rank and _environ(parent).get("LOCAL_RANK") == env.get("LOCAL_RANK")
    return f"{'a loader worker of ' if forked else ''}rank {rank} (pid {pid})"


def kill_run(marker: tuple[str, str], keep: int = 0) -> list[str]:
    """SIGKILL every process of the run still alive but keep (torchrun, which its Popen kills and
    reaps), and reap the ones that are our children by now; what each one was."""
    pids = [pid for pid in run_processes(marker) if pid != keep]
    named = [describe(pid) for pid in pids]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    reap(pids)
    return named


def reap(pids: list[int]) -> None:
    """Wait for those of pids that are our children (orphans we adopted); others are not ours to reap."""
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except OSError:
            pass


def wait_finished(proc: subprocess.Popen, finished: Path, marker: tuple[str, str], late_hang_s: float) -> list[str]:
    """Wait for torchrun; once `finished` exists, give the run late_hang_s to leave, then kill every
    process of it. What was killed for hanging after the finish (empty: nothing hung)."""
    since = None
    while True:
        try:
            proc.wait(timeout=1.0)
            return []
        except subprocess.TimeoutExpired:
            pass
        if since is None and finished.is_file():
            since = time.monotonic()
        if since is not None and time.monotonic() - since > late_hang_s:
            pids = [pid for pid in run_processes(marker) if pid != proc.pid]
            hung = kill_run(marker, keep=proc.pid)
            proc.kill()
            proc.wait()
            reap(pids)  # torchrun's workers are our children now that it is gone (a subreaper's)
            return hung
