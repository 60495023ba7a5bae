"""Fetch exactly the locked wheels of a profile: binary only, each sha256 checked.

The lock holds only names, versions and hashes; the index (its PEP 691 JSON API: PyPI by default,
or PIP_INDEX_URL for a mirror such as devpi) says which file of that version fits the profile's platform. Every missing or
mismatched wheel is collected, so the build fails once with the whole list, before the gap.
Downloads land in a cache keyed by sha256, so a second build re-hashes instead of re-downloading.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from appliance.bundle.profiles import Pin, Profile
from appliance.manifest import sha256_file

DEFAULT_INDEX = "https://pypi.org/simple"
PROGRESS_EVERY_S = 3.0


@dataclass(frozen=True)
class Wheel:
    """One file to put in the bundle."""

    name: str
    version: str
    filename: str
    url: str
    allowed: frozenset[str]  # the lock's hashes for this pin; the file must have one of them
    size: int | None


def index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX).rstrip("/")


def _get_json(url: str) -> dict:
    request = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    for attempt in range(3):
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.load(response)
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return {"files": []}
            if attempt == 2:
                raise
        except (urllib.error.URLError, TimeoutError, ConnectionError):
            if attempt == 2:
                raise
        time.sleep(1 + attempt)
    raise AssertionError("unreachable")


def choose_wheels(profile: Profile, pins: list[Pin], problems: list[str], index: str) -> list[Wheel]:
    """The best wheel for the profile's platform of every pin; problems get one line per gap."""
    from packaging.tags import compatible_tags, cpython_tags
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename
    from packaging.version import Version

    major, minor = (int(x) for x in profile.python.split("."))
    platforms = profile.wheel_platforms()
    tags = list(cpython_tags((major, minor), abis=[f"cp{major}{minor}"], platforms=platforms))
    tags += list(compatible_tags((major, minor), f"cp{major}{minor}", platforms))
    rank = {tag: i for i, tag in enumerate(tags)}
    where = f"{profile.name}"

    def lookup(pin: Pin) -> Wheel | None:
        page = f"{index}/{pin.name}/"
        try:
            files = _get_json(page)["files"]
        except (urllib.error.URLError, OSError, ValueError) as err:
            problems.append(f"missing: {where}: {pin.name}=={pin.version}: index {index} unreachable ({err})")
            return None
        fitting, other = [], []
        for f in files:
            if not f["filename"].endswith(".whl"):
                continue
            try:
                _, version, _, file_tags = parse_wheel_filename(f["filename"])
            except InvalidWheelFilename:
                continue
            if version != Version(pin.version):
                continue
            best = min((rank[t] for t in file_tags if t in rank), default=None)
            (fitting if best is not None else other).append((best, f))
        if not fitting:
            why = (f"the index has {len(other)} wheel(s) of it, none for this platform" if other else
                   "the index has no wheel of it: no such release, or source only (bundles are binary only)")
            problems.append(f"missing: {where}: {pin.name}=={pin.version}: no wheel for CPython {profile.python} "
                            f"{profile.platform}; {why}")
            return None
        fitting.sort(key=lambda pair: pair[0])
        for _, f in fitting:
            digest = f.get("hashes", {}).get("sha256")
            if digest is None or digest in pin.hashes:
                return Wheel(pin.name, pin.version, f["filename"], urllib.parse.urljoin(page, f["url"]), pin.hashes,
                             f.get("size"))
        f = fitting[0][1]
        problems.append(f"mismatch: {where}: {f['filename']}: index sha256 {f['hashes']['sha256']} "
                        f"is not one the lock allows ({profile.lock_file.name})")
        return None

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        found = list(pool.map(lookup, pins))
    return [w for w in found if w is not None]


class Progress:
    """Periodic progress lines with rate and ETA (long downloads must show progress)."""

    def __init__(self, total_files: int, total_bytes: int):
        self.total_files, self.total_bytes = total_files, total_bytes
        self.files = self.bytes = 0
        self.start = self.last = time.monotonic()
        self.lock = threading.Lock()

    def add(self, nbytes: int = 0, file_done: bool = False) -> None:
        with self.lock:
            self.bytes += nbytes
            self.files += file_done
            now = time.monotonic()
            if now - self.last >= PROGRESS_EVERY_S or (file_done and self.files == self.total_files):
                self.last = now
                rate = self.bytes / max(now - self.start, 1e-6)
                eta = (self.total_bytes - self.bytes) / rate if rate > 0 else 0
                pct = 100 * self.bytes / self.total_bytes if self.total_bytes else 100
                print(f"bundle: downloaded {self.bytes / 1e6:.1f}/{self.total_bytes / 1e6:.1f} MB ({pct:.0f}%), "
                      f"{self.files}/{self.total_files} files, {rate / 1e6:.1f} MB/s, ETA {eta:.0f} s",
                      file=sys.stderr, flush=True)


def fetch(wheels: list[Wheel], cache: Path, problems: list[str]) -> dict[str, tuple[Path, str]]:
    """Download (or reuse from cache) every wheel, check its sha256; filename -> (path, sha256)."""
    cache.mkdir(parents=True, exist_ok=True)
    todo, paths = [], {}
    for w in wheels:
        cached = [cache / h / w.filename for h in sorted(w.allowed) if (cache / h / w.filename).exists()]
        digest = sha256_file(cached[0]) if cached else None
        if digest in w.allowed:  # re-hashed: a cache is no reason to trust a file
            paths[w.filename] = (cached[0], digest)
        else:
            todo.append(w)
    total = sum(w.size or 0 for w in todo)
    if todo:
        print(f"bundle: downloading {len(todo)} wheels ({total / 1e6:.1f} MB); "
              f"{len(paths)} already in {cache}", file=sys.stderr, flush=True)
    progress = Progress(len(todo), total)

    def download(w: Wheel) -> None:
        part = cache / f".{w.filename}.part-{os.getpid()}-{threading.get_ident()}"
        h = hashlib.sha256()
        try:
            with urllib.request.urlopen(w.url, timeout=120) as response, open(part, "wb") as out:
                while block := response.read(1 << 20):
                    out.write(block)
                    h.update(block)
                    progress.add(len(block))
        except (urllib.error.URLError, OSError) as err:
            part.unlink(missing_ok=True)
            problems.append(f"missing: {w.filename}: download failed ({err})")
            return
        if h.hexdigest() not in w.allowed:
            part.unlink(missing_ok=True)
            problems.append(f"mismatch: {w.filename}: downloaded sha256 {h.hexdigest()} is not the locked one")
            return
        final = cache / h.hexdigest() / w.filename
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, final)
        paths[w.filename] = (final, h.hexdigest())
        progress.add(file_done=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(download, todo))
    return paths
