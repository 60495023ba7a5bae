"""One run per directory: an exclusive flock on DIR/.lock, released by the kernel when we die.

The holder writes its PID, start time and command into the lock file, so the refusal can say
who holds it, and removes the file when it is done. A file left by a killed process is no lock:
flock only holds while the file is open, so a killed run never needs cleaning up after.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from appliance.core.errors import ApplianceError

LOCK_NAME = ".lock"


class DirectoryInUse(ApplianceError):
    """Another process holds the directory's lock."""

    exit_code = 75  # EX_TEMPFAIL: try again when the other run has finished


@dataclass(frozen=True)
class HeldLock:
    path: Path
    fd: int  # pass to a child (Popen pass_fds) that must keep the lock if we are killed first


@contextlib.contextmanager
def directory_lock(directory: str | Path, what: str = "directory", name: str = LOCK_NAME):
    """Hold the lock of `directory` (created if missing) for the with-block; DirectoryInUse if held.

    `name` tells apart holders that may share a directory (the nodes of one run on a shared filesystem)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ApplianceError(f"{directory}: the {what} exists and is not a directory")
    lock_path = directory / name
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ApplianceError(f"{err.filename or directory}: cannot create the {what}: {err.strerror or err}") from None
    fd = _acquire(lock_path, directory, what)
    try:
        started = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)  # what a killed holder left
        os.pwrite(fd, f"pid {os.getpid()}\nstarted {started}\ncommand {' '.join(sys.argv)}\n".encode(), 0)
        yield HeldLock(lock_path, fd)
    finally:
        # Removed while still held, so the directory keeps no trace of us; a process that opened
        # the old file meanwhile sees it is gone (_acquire) and tries again.
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        os.close(fd)


def _acquire(lock_path: Path, directory: Path, what: str) -> int:
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise ApplianceError(f"{directory}: cannot use it as the {what}: {err.strerror or err}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise DirectoryInUse(f"{directory}: the {what} is in use by another run ({holder}); "
                                 "wait for it to finish or use another directory") from None
        try:
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder removed it as we opened it: lock the new one


def _read_holder(fd: int) -> str:
    try:
        fields = dict(line.split(" ", 1) for line in os.pread(fd, 4096, 0).decode(errors="replace").splitlines()
                      if " " in line)
    except OSError:
        fields = {}
    if "pid" not in fields:
        return "its PID is not written yet"
    return f"PID {fields['pid']}, started {fields.get('started', 'at an unknown time')}"
