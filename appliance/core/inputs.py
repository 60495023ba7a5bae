"""Checks on the paths a user names, so a wrong one is one line before any work starts, and the
one way to read a small file whole: bounded, so /dev/zero or a 200 MB "config" costs nothing."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from appliance.core.errors import ApplianceError, DataError
from appliance.core.values import human_bytes

MAX_CONFIG_BYTES = 4 << 20  # a TOML config, a schema, a report: text a person writes or reads


def describe(mode: int) -> str:
    """What a non-regular file is, in the words `ls -l` would suggest."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def require_file(path: str | Path, what: str = "file") -> Path:
    """path must be an existing regular file (not a directory, a device or a pipe)."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise DataError(f"{path}: no such {what}") from None
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        raise DataError(f"{str(path)!r}: cannot read the {what}: {getattr(err, 'strerror', None) or err}") from None
    if stat.S_ISDIR(mode):
        raise DataError(f"{path}: is a directory, not a {what}")
    if not stat.S_ISREG(mode):
        raise DataError(f"{path}: is {describe(mode)}, not a {what}")
    return p


def open_regular(path: str | Path, what: str = "file"):
    """path opened for reading in binary, when it is a regular file; a pipe, a device or a directory
    is a DataError before a byte is read. (A plain open() of a FIFO blocks until a writer comes:
    `data check` of a pipe hung.) Failures to open (no such file, no permission) are OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise DataError(f"{path}: is {describe(mode)}, not a {what}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | Path, what: str, limit: int = MAX_CONFIG_BYTES,
                 error: type[ApplianceError] = DataError) -> bytes:
    """The whole of a regular file of at most `limit` bytes; anything else is one `error` line.

    Devices and pipes are refused before a byte is read, and a file that grows past the limit
    while being read is refused too (no more than limit + 1 bytes are ever held)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, not a {what}") from None
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        raise error(f"{str(path)!r}: cannot read the {what}: {getattr(err, 'strerror', None) or err}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise error(f"{path}: is a directory, not a {what}")
        raise error(f"{path}: is {describe(mode)}, not a {what}")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as err:
            raise error(f"{path}: cannot read the {what}: {err.strerror or err}") from None
    if len(data) > limit:
        raise error(f"{path}: a {what} of more than {human_bytes(limit)} (the limit for one read whole)")
    return data
