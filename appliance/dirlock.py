"""One run per directory: an exclusive flock on DIR/.lock, released by the kernel when we die.

The holder writes its PID, start time and command into the lock file, so the refusal can say
who holds it. A stale file left by a dead process is no lock: flock only holds while the file
is open, so a killed run never needs cleaning up after.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import os
import sys
from pathlib import Path

from appliance.errors import ApplianceError

LOCK_NAME = ".lock"


class DirectoryInUse(ApplianceError):
    """Another process holds the directory's lock."""

    exit_code = 75  # EX_TEMPFAIL: try again when the other run has finished


@contextlib.contextmanager
def directory_lock(directory: str | Path, what: str = "directory"):
    """Hold the lock of `directory` (created if missing) for the with-block; DirectoryInUse if held."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ApplianceError(f"{directory}: the {what} exists and is not a directory")
    lock_path = directory / LOCK_NAME
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise ApplianceError(f"{err.filename or directory}: cannot use it as the {what}: "
                             f"{err.strerror or err}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            raise DirectoryInUse(f"{directory}: the {what} is in use by another run ({holder}); "
                                 "wait for it to finish or use another directory") from None
        started = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\nstarted {started}\ncommand {' '.join(sys.argv)}\n".encode(), 0)
        yield lock_path
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race a new holder)


def _read_holder(fd: int) -> str:
    try:
        fields = dict(line.split(" ", 1) for line in os.pread(fd, 4096, 0).decode(errors="replace").splitlines()
                      if " " in line)
    except OSError:
        fields = {}
    if "pid" not in fields:
        return "its PID is not written yet"
    return f"PID {fields['pid']}, started {fields.get('started', 'at an unknown time')}"
