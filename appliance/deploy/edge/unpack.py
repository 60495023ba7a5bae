"""Unpacking an edge package for `appliance edge verify`: every member's name, type and size is
checked from the tar headers before one byte is written, then the signature of SHA256SUMS, then
every file against SHA256SUMS. Anything else is one line naming the package and the member.

What the headers bound: a package is files and folders under edge-package/ (no links, devices or
pipes: install.sh on the device refuses them too), at most MAX_MEMBERS of them holding at most
MAX_PACKAGE_BYTES together, so a small compressed tar cannot fill the disk before its signature
is looked at."""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

from appliance.core.errors import DataError
from appliance.core.manifest import sha256_file
from appliance.deploy.edge.signing import SIGNATURE, check_signature

MAX_SUMS_BYTES = 1 << 20  # SHA256SUMS of a package is a few KB
MAX_PACKAGE_BYTES = 4 << 30  # a --with-python package of a large model is a few hundred MB
MAX_MEMBERS = 100_000  # a package holds tens of files (a few hundred with --with-python)
ROOT = "edge-package"


def _extract(tar: tarfile.TarFile, into: Path) -> None:
    """PEP 706's data filter where Python has it (3.10.12+, 3.11.4+; Debian 12 ships 3.11.2),
    else its refusals by hand: only plain files and directories, all inside `into`."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(into, filter="data")
        return
    root = Path(into).resolve()
    members = tar.getmembers()
    for member in members:
        if not (member.isfile() or member.isdir()) or not (root / member.name).resolve().is_relative_to(root):
            raise tarfile.TarError(f"{member.name}: not a plain file or directory inside the package")
        member.mode &= 0o755
    tar.extractall(into, members=members)


def _kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return f"a symbolic link (to {member.linkname})"
    if member.islnk():
        return f"a hard link (to {member.linkname})"
    return "a device, pipe or other special file"


def check_member_names(tar: tarfile.TarFile, package: Path) -> None:
    """Every member is edge-package/ or a plain relative path under it, once: no `..`, no `.`,
    no absolute name, no second copy of a name (one of them would be what gets extracted); a file
    or a folder, never a link or a device; MAX_MEMBERS and MAX_PACKAGE_BYTES at most. Read header
    by header, so a bomb is refused at its first oversized member, not after decompressing it."""
    seen, total = set(), 0
    for member in tar:
        name = member.name.rstrip("/")
        parts = name.split("/")
        if parts[0] != ROOT or any(p in ("", ".", "..") for p in parts[1:]) or "\\" in name:
            raise DataError(f"{package}: member {member.name!r} is not a plain path inside {ROOT}/; refused")
        if name in seen:
            raise DataError(f"{package}: member {member.name!r} appears twice; refused")
        if not (member.isfile() or member.isdir()):
            raise DataError(f"{package}: member {member.name!r} is {_kind(member)}; an edge package holds only "
                            "files and folders; refused")
        seen.add(name)
        total += member.size if member.isfile() else 0
        if total > MAX_PACKAGE_BYTES or len(seen) > MAX_MEMBERS:
            raise DataError(f"{package}: more than {MAX_PACKAGE_BYTES >> 30} GiB or {MAX_MEMBERS} members (at "
                            f"{member.name!r}, {member.size} bytes); not an edge package `appliance package` "
                            "makes; refused")


def unpack_checked(package: Path, into: Path, pubkey: Path | None = None) -> Path:
    """Extract the tar, check the signature of SHA256SUMS with pubkey (when given) and every file
    against SHA256SUMS, and that nothing else is there; one line for the first problem."""
    if not package.is_file():
        raise DataError(f"{package}: no such file" if not package.exists() else f"{package}: not a regular file")
    try:
        with tarfile.open(package) as tar:
            check_member_names(tar, package)
            _extract(tar, into)
    except tarfile.ReadError:
        # tarfile's own message is one line per compression it tried.
        raise DataError(f"{package}: not an edge package (not a tar archive; make one with `appliance package`)") \
            from None
    except (tarfile.TarError, OSError, EOFError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(f"{package}: not a readable edge package tar ({first})") from None
    root = into / ROOT
    sums = root / "SHA256SUMS"
    if not sums.is_file():
        raise DataError(f"{package}: not an edge package (no {ROOT}/SHA256SUMS)")
    if sums.stat().st_size > MAX_SUMS_BYTES:
        raise DataError(f"{package}: {ROOT}/SHA256SUMS is {sums.stat().st_size} bytes (at most {MAX_SUMS_BYTES})")
    if pubkey is not None:
        check_signature(root, package, pubkey)
    listed = _check_sums(root, package)
    allowed = listed | {"SHA256SUMS", SIGNATURE}
    # Members outside the package's root were refused by check_member_names before extraction;
    # `into` may hold other files (the tar itself, a caller's), which are not the package's.
    extra = sorted(str(p.relative_to(root)) for p in root.rglob("*")
                   if not p.is_dir() and str(p.relative_to(root)) not in allowed)
    if extra:
        raise DataError(f"{package}: {extra[0]} is not listed in SHA256SUMS (added after packaging)")
    return root


def _check_sums(root: Path, package: Path) -> set[str]:
    """The names SHA256SUMS lists, each checked; what install.sh on the device accepts, no more: one
    '<sha256>  <path>' per line ending in \\n alone, each name once."""
    listed = set()
    for number, line in enumerate((root / "SHA256SUMS").read_bytes().decode("utf-8", "replace").split("\n"), 1):
        if not line:
            continue
        digest, _, name = line.partition("  ")
        parts = name.split("/")
        if not re.fullmatch(r"[0-9a-f]{64}", digest) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+/-]*", name) \
                or any(p in ("", ".", "..") for p in parts):
            raise DataError(f"{package}: SHA256SUMS line {number} is not '<sha256>  <relative path>'")
        if name in listed:
            raise DataError(f"{package}: SHA256SUMS line {number}: {name} is listed twice")
        listed.add(name)
        path = root / name
        if not path.is_file() or path.is_symlink():
            raise DataError(f"{package}: {name} is listed in SHA256SUMS but missing")
        if sha256_file(path) != digest:
            raise DataError(f"{package}: {name}: sha256 does not match SHA256SUMS (modified after packaging)")
    return listed
