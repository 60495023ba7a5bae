"""Fetch exactly the locked wheels of a (profile, Python) through pip, then check them against the lock.

pip does the talking to the index (`pip download --no-deps --only-binary=:all: --platform ...
--python-version ... --implementation cp --require-hashes -r LOCK`), so an HTML-only PEP 503
mirror, a proxy, client certificates, netrc and pip.conf work exactly as they do for pip itself.
We keep our own check of the result: every pin must end with one wheel for the target's tags whose
sha256 the lock allows. When pip fails, each pin is retried alone so that the build fails once with
the whole list of missing or mismatched wheels, before anything is written.
Downloads land in one directory per target under the cache; pip re-checks the hash of a file it
finds there instead of downloading it again, and we re-hash every file we take.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from appliance.bundle.profiles import Pin, Profile, read_lock
from appliance.core.manifest import sha256_file

DEFAULT_INDEX = "https://pypi.org/simple"


@dataclass(frozen=True)
class Target:
    """One (profile, CPython version): one lock, one set of wheel tags."""

    profile: Profile
    python: str

    @property
    def key(self) -> tuple[str, str]:
        return self.profile.name, self.python

    @property
    def lock_file(self) -> Path:
        return self.profile.lock_file(self.python)

    @property
    def label(self) -> str:
        return f"{self.profile.name} (CPython {self.python})"

    def pins(self) -> list[Pin]:
        return read_lock(self.profile, self.python)


@dataclass(frozen=True)
class Wheel:
    """One checked file to put in the bundle."""

    name: str
    version: str
    filename: str
    path: Path
    sha256: str


def configured_index() -> str:
    """The index pip will use: PIP_INDEX_URL, else pip.conf's index-url (last one wins), else PyPI."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"].rstrip("/")
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    found = re.findall(r"(?m)^\S*\.index-url='([^']+)'$", proc.stdout)
    return (found[-1] if found else DEFAULT_INDEX).rstrip("/")


def pip_download_cmd(target: Target, requirements: Path, dest: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--implementation", "cp",
           "--python-version", target.python, "--require-hashes", "--disable-pip-version-check",
           "-d", str(dest), "-r", str(requirements)]
    for platform in target.profile.wheel_platforms():
        cmd += ["--platform", platform]
    return cmd


def _tag_rank(target: Target) -> dict:
    from packaging.tags import compatible_tags, cpython_tags

    major, minor = (int(x) for x in target.python.split("."))
    platforms = target.profile.wheel_platforms()
    tags = list(cpython_tags((major, minor), abis=[f"cp{major}{minor}"], platforms=platforms))
    tags += list(compatible_tags((major, minor), f"cp{major}{minor}", platforms))
    return {tag: i for i, tag in enumerate(tags)}


def _diagnose(target: Target, pin: Pin, dest: Path) -> str | None:
    """pip alone on one pin: None when it succeeds, else one problem line naming the pin."""
    req = dest / f".requirement-{pin.name}.txt"
    req.write_text(f"{pin.name}=={pin.version} " + " ".join(f"--hash=sha256:{h}" for h in sorted(pin.hashes)) + "\n")
    try:
        proc = subprocess.run(pip_download_cmd(target, req, dest) + ["--progress-bar", "off"],
                              capture_output=True, text=True)
    finally:
        req.unlink(missing_ok=True)
    if proc.returncode == 0:
        return None
    out = proc.stdout + proc.stderr
    where = f"{target.label}: {pin.name}=={pin.version}"
    if "DO NOT MATCH THE HASHES" in out:
        url = re.search(r"(?m)^\s*\S+ from (\S+)", out)
        got = re.search(r"(?m)^\s*Got\s+([0-9a-f]{64})", out)
        filename = url.group(1).split("#")[0].rstrip(":").rsplit("/", 1)[-1] if url else "the file"
        return (f"mismatch: {where}: {filename} from the index has sha256 {got.group(1) if got else '(not shown)'}, "
                f"not one the lock allows ({target.lock_file.name})")
    if "No matching distribution found" in out:
        versions = re.search(r"\(from versions: ([^)]*)\)", out)
        why = (f"the index has none of that version for these tags (versions it has: {versions.group(1)})"
               if versions and versions.group(1) != "none" else
               "the index has no wheel of it for these tags: no such release, no wheel for this Python or platform, "
               "or source only (bundles are binary only)")
        return f"missing: {where}: no wheel for CPython {target.python} {target.profile.platform}; {why}"
    errors = [line.strip() for line in out.splitlines() if line.startswith("ERROR:")] or out.strip().splitlines()[-1:]
    return f"missing: {where}: pip download failed: {(errors or ['no output'])[-1]}"


def fetch(target: Target, pins: list[Pin], cache: Path, problems: list[str]) -> list[Wheel]:
    """Every pin's wheel for the target, fetched with pip and checked; problems get one line per gap."""
    dest = cache / target.profile.platform  # shared by the Pythons of a platform: a py3 wheel is fetched once
    dest.mkdir(parents=True, exist_ok=True)
    print(f"bundle: {target.label}: pip download of {len(pins)} locked wheels from {target.lock_file.name} "
          f"into {dest}", file=sys.stderr, flush=True)
    # pip's own output (its progress bars included) goes straight to our stderr: long downloads show progress.
    proc = subprocess.run(pip_download_cmd(target, target.lock_file, dest), stdout=sys.stderr.fileno(),
                          stderr=sys.stderr.fileno())
    if proc.returncode != 0:
        print(f"bundle: {target.label}: pip download failed; retrying each pin alone to list every problem",
              file=sys.stderr, flush=True)
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            found = [p for p in pool.map(lambda pin: _diagnose(target, pin, dest), pins) if p is not None]
        problems.extend(found)
        if found:
            return []
    return check(target, pins, dest, problems)


def check(target: Target, pins: list[Pin], dest: Path, problems: list[str]) -> list[Wheel]:
    """Our own check of what pip left: for each pin, the best-fitting wheel whose sha256 the lock allows."""
    from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
    from packaging.version import Version

    rank = _tag_rank(target)
    by_pin: dict[tuple[str, Version], list[tuple[int, Path]]] = {}
    for path in dest.glob("*.whl"):
        try:
            name, version, _, tags = parse_wheel_filename(path.name)
        except InvalidWheelFilename:
            continue
        best = min((rank[t] for t in tags if t in rank), default=None)
        if best is not None:
            by_pin.setdefault((canonicalize_name(name), version), []).append((best, path))
    wheels = []
    for pin in pins:
        where = f"{target.label}: {pin.name}=={pin.version}"
        candidates = sorted(by_pin.get((canonicalize_name(pin.name), Version(pin.version)), []))
        if not candidates:
            problems.append(f"missing: {where}: pip reported success but left no wheel for CPython {target.python} "
                            f"{target.profile.platform}")
            continue
        digests = [(path, sha256_file(path)) for _, path in candidates]  # re-hashed: a cache is no reason to trust
        ok = [(path, digest) for path, digest in digests if digest in pin.hashes]
        if not ok:
            path, digest = digests[0]
            problems.append(f"mismatch: {where}: {path.name} has sha256 {digest}, not one the lock allows "
                            f"({target.lock_file.name})")
            continue
        path, digest = ok[0]
        wheels.append(Wheel(pin.name, pin.version, path.name, path, digest))
    return wheels
