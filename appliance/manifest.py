"""Stage manifests: every stage writes `manifest.json` into its output directory.

`{"stage", "created", "inputs": [{"path","sha256"}], "params", "outputs": [{"path","sha256","bytes"}],
"versions": {package: version}}` (see DESIGN.md). Chained manifests give the lineage of an
edge model back to the exact data files; `appliance pipeline` compares them to skip work.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

from appliance.errors import DataError

MANIFEST_NAME = "manifest.json"
_VERSIONED = ("appliance", "torch", "torchvision", "onnx", "onnxruntime", "apache-tvm", "numpy")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def versions(packages=_VERSIONED) -> dict[str, str]:
    found = {}
    for name in packages:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write text so that a crash leaves either the old file or the new one, never half of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_manifest(out_dir: str | os.PathLike, stage: str, inputs, params: dict, outputs=None) -> dict:
    """Write out_dir/manifest.json. outputs defaults to every file under out_dir (manifest excluded)."""
    out_dir = Path(out_dir)
    if outputs is None:
        # A directory lock (.lock, .lock-node<R>) belongs to the run writing here, not to its outputs.
        outputs = sorted(p for p in out_dir.rglob("*") if p.is_file() and p.name != MANIFEST_NAME
                         and not p.name.startswith(".lock"))
    manifest = {
        "stage": stage,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "inputs": [{"path": str(p), "sha256": sha256_file(p)} for p in map(Path, inputs)],
        "params": params,
        "outputs": [
            {"path": str(Path(p).relative_to(out_dir)) if Path(p).is_relative_to(out_dir) else str(p),
             "sha256": sha256_file(p), "bytes": Path(p).stat().st_size}
            for p in map(Path, outputs)
        ],
        "versions": versions(),
    }
    atomic_write_text(out_dir / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(out_dir: str | os.PathLike) -> dict:
    path = Path(out_dir) / MANIFEST_NAME
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: no manifest (is {out_dir} the output of an appliance stage?)") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err})") from None


def verify_outputs(out_dir: str | os.PathLike) -> list[str]:
    """Return one line per output whose file is missing or whose sha256 changed."""
    out_dir = Path(out_dir)
    problems = []
    for entry in read_manifest(out_dir)["outputs"]:
        p = out_dir / entry["path"]
        if not p.exists():
            problems.append(f"{p}: missing")
        elif sha256_file(p) != entry["sha256"]:
            problems.append(f"{p}: sha256 mismatch")
    return problems
