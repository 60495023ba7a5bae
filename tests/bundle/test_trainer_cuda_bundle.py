"""The trainer-cuda bundle is complete, checked as a dry run: every pin of its lock has a binary
wheel for CPython 3.11 manylinux_2_28 x86_64 on the index whose sha256 the lock allows, without
downloading the multi-GB CUDA wheels (only the index's JSON pages are read)."""

import concurrent.futures
import json
import os
import re
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "manifests" / "trainer-cuda.lock"
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
PLATFORM_GLIBC, ARCH, PY = (2, 28), "x86_64", (3, 11)
LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def read_pins(lock: Path) -> dict[str, tuple[str, set[str]]]:
    """name -> (version, allowed sha256s) from a pip-tools/uv lock with --generate-hashes."""
    pins, current = {}, None
    for line in lock.read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9._-]+)==([^ \\]+)", line):
            current = re.sub(r"[-_.]+", "-", m.group(1)).lower()
            pins[current] = (m.group(2), set())
        for digest in re.findall(r"--hash=sha256:([0-9a-f]{64})", line):
            pins[current][1].add(digest)
    return pins


def wheel_fits(filename: str, version: str) -> bool:
    """Does this wheel of `version` install on CPython 3.11, glibc 2.28, x86_64 (the profile's platform)?"""
    if not filename.endswith(".whl"):
        return False
    parts = filename[:-4].split("-")
    if len(parts) not in (5, 6) or parts[1] != version:
        return False
    pys, abis, plats = (p.split(".") for p in parts[-3:])
    py_ok = any(t in (f"cp{PY[0]}{PY[1]}", f"py{PY[0]}", f"py{PY[0]}{PY[1]}")
                or (t.startswith("cp3") and "abi3" in abis and int(t[3:] or 0) <= PY[1]) for t in pys)
    abi_ok = any(a in ("none", "abi3", f"cp{PY[0]}{PY[1]}") for a in abis)

    def plat_ok(p: str) -> bool:
        if p == "any":
            return True
        if not p.endswith("_" + ARCH):
            return False
        base = p[: -len(ARCH) - 1]
        if base in LEGACY_MANYLINUX:
            return LEGACY_MANYLINUX[base] <= PLATFORM_GLIBC
        m = re.fullmatch(r"manylinux_(\d+)_(\d+)", base)
        return bool(m) and (int(m.group(1)), int(m.group(2))) <= PLATFORM_GLIBC

    return py_ok and abi_ok and any(plat_ok(p) for p in plats)


def index_files(name: str) -> list[dict]:
    request = urllib.request.Request(f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["files"]


def test_wheel_tag_matching_follows_the_profile_platform():
    assert wheel_fits("torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl", "2.14.1")
    assert wheel_fits("six-1.17.0-py2.py3-none-any.whl", "1.17.0")
    assert wheel_fits("numpy-2.4.6-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", "2.4.6")
    assert wheel_fits("cryptography-46.0.1-cp39-abi3-manylinux_2_28_x86_64.whl", "46.0.1")
    assert not wheel_fits("torch-2.14.1-cp312-cp312-manylinux_2_28_x86_64.whl", "2.14.1")  # other Python
    assert not wheel_fits("x-1.0-cp311-cp311-manylinux_2_34_x86_64.whl", "1.0")  # newer glibc than the floor
    assert not wheel_fits("x-1.0-cp311-cp311-manylinux_2_28_aarch64.whl", "1.0")
    assert not wheel_fits("x-1.0.tar.gz", "1.0")  # bundles are binary only
    assert not wheel_fits("x-1.1-py3-none-any.whl", "1.0")


def test_every_trainer_cuda_pin_has_a_fitting_wheel_with_a_locked_hash():
    pins = read_pins(LOCK)
    assert {"torch", "torchvision", "onnxruntime-gpu", "nvidia-nccl-cu13", "nvidia-cudnn-cu13"} <= pins.keys()
    assert "onnxruntime" not in pins  # the CPU build would shadow onnxruntime-gpu's module
    assert all(hashes for _, hashes in pins.values()), "a pin without --hash"

    def problems_of(item):
        name, (version, hashes) = item
        files = [f for f in index_files(name) if f["filename"].split("-")[1:2] == [version]
                 or f["filename"].startswith(f"{name.replace('-', '_')}-{version}")]
        fitting = [f for f in files if wheel_fits(f["filename"], version)]
        if not fitting:
            kinds = sorted({f["filename"].rsplit(".", 1)[-1] if not f["filename"].endswith(".tar.gz") else "sdist"
                            for f in files}) or ["nothing"]
            return [f"{name}=={version}: no wheel for cp311 manylinux_2_28 x86_64 (index has: {', '.join(kinds)})"], 0
        locked = [f for f in fitting if f["hashes"].get("sha256") in hashes]
        if not locked:
            return [f"{name}=={version}: the index's fitting wheels have no sha256 the lock allows"], 0
        return [], max(f.get("size") or 0 for f in locked)

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(problems_of, sorted(pins.items())))
    problems = [p for found, _ in results for p in found]
    assert problems == [], "\n".join(problems)
    total_gb = sum(size for _, size in results) / 1e9
    assert total_gb > 1  # the CUDA wheels are there, and were not downloaded to find out
    print(f"trainer-cuda: {len(pins)} wheels, {total_gb:.2f} GB, all present with locked hashes")
