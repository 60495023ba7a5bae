"""A training worker's one-line error, left for the launcher: RUN_DIR/.worker-error.

torchrun reports a failed worker with its own ~30-line ChildFailedError stack; the launcher
prints this file's line instead. The first rank to fail writes it (O_EXCL); the worker then
exits with EXIT_STATUS, so a failure with a line is told apart from a crash (1) or a signal.
"""

from __future__ import annotations

import os
from pathlib import Path

FILE_NAME = ".worker-error"
# Beside it when the error is of the data or the config (DataError, ConfigError): it would recur on every
# attempt, so torchrun's --max-restarts must not restart the workers for it (agent.py reads it).
FINAL_NAME = ".worker-error-final"
EXIT_STATUS = 3
# Set by `appliance train` to the file's path: the workers then leave the printing to the launcher
# (one line, not one per rank), and the agent drops torchrun's failure records once a line exists.
LAUNCHER_ENV = "APPLIANCE_WORKER_ERROR_FILE"


def record(run_dir: str | Path, line: str, final: bool = False) -> bool:
    """Write line unless a rank already did; False when another rank's line is there or no disk.
    final: the same error would come back on a restart (FINAL_NAME is written too)."""
    if final:
        try:
            (Path(run_dir) / FINAL_NAME).touch()
        except OSError:
            pass
    try:
        fd = os.open(Path(run_dir) / FILE_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return False
    try:
        os.write(fd, (line.strip() + "\n").encode())
    finally:
        os.close(fd)
    return True


def read(run_dir: str | Path) -> str | None:
    """The recorded line, or None."""
    try:
        return (Path(run_dir) / FILE_NAME).read_text(errors="replace").strip() or None
    except OSError:
        return None


def clear(run_dir: str | Path) -> None:
    """Before a run starts (a line from an earlier run would be misleading)."""
    for name in (FILE_NAME, FINAL_NAME):
        try:
            (Path(run_dir) / name).unlink()
        except FileNotFoundError:
            pass


FINISHED_NAME = ".finished"  # RUN_DIR: every rank committed the run (loop.py writes it, the launcher reads it)
