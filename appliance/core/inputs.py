"""Checks on the paths a user names, so a wrong one is one line before any work starts."""

from __future__ import annotations

from pathlib import Path

from appliance.core.errors import DataError


def require_file(path: str | Path, what: str = "file") -> Path:
    """path must be an existing regular file (not a directory)."""
    p = Path(path)
    if p.is_dir():
        raise DataError(f"{path}: is a directory, not a {what}")
    if not p.is_file():
        raise DataError(f"{path}: no such {what}")
    return p
