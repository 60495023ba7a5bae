"""Stage manifests: every stage writes `manifest.json` into its output directory.

`{"stage", "created", "inputs": [{"path","sha256"}], "params", "outputs": [{"path","sha256","bytes"}],
"versions": {package: version}}` (docs/dev/contracts.md), and the provenance every manifest carries:
`command` (the `appliance ...` line as typed) and `cwd`, `appliance_version`, `git` ({commit,
dirty} of the appliance code when it runs from a git checkout; absent otherwise), and `lineage`:
the manifests that made this stage's inputs, oldest first, each with its stage, directory,
command, inputs and params. The writer assembles the lineage itself, by finding, for each input,
the nearest manifest above it that lists the same file (same sha256) among its outputs, so the
edge package's manifest says what made it, from which data, with which settings, and how to
remake it; `appliance pipeline` compares manifests to skip work.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import os
import shlex
import stat
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from appliance.core.errors import ConfigError, DataError
from appliance.core.inputs import describe
from appliance import __version__

MANIFEST_NAME = "manifest.json"
_VERSIONED = ("appliance", "torch", "torchvision", "onnx", "onnxruntime", "apache-tvm", "numpy")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """sha256 of a regular file; a device or a pipe (a link to /dev/zero, a FIFO) is one line, never read
    forever or waited on (opened non-blocking, checked before the first read)."""
    import stat

    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DataError(f"{path}: not a regular file (a device, pipe or socket); refusing to read it")
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


def refuse_to_replace(path: Path) -> None:
    """A ConfigError when path is there and is neither a regular file nor a link (a device, a pipe, a
    directory): an atomic write renames a new file over it, which would replace the thing itself."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise ConfigError(f"{path}: is {describe(mode)}; refusing to replace it with a file")


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write text so that a crash leaves either the old file or the new one, never half of it.
    What it would replace must be a file (or a link): os.replace over /dev/null, as root, put a regular
    file in place of the device (`train slurm --out /dev/null` did)."""
    path = Path(path)
    refuse_to_replace(path)
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


COMMAND_ENV = "APPLIANCE_COMMAND"  # set by the CLI; torchrun workers inherit what the user typed
CWD_ENV = "APPLIANCE_COMMAND_CWD"


def remember_command(argv: list[str]) -> None:
    """Record `appliance ARGV` (and the directory it ran in) for every manifest this process and
    its children write."""
    # An environment value cannot hold NUL (argv from a shell never does; a caller's list may).
    os.environ[COMMAND_ENV] = shlex.join(["appliance", *argv]).replace("\0", "\\0")
    os.environ[CWD_ENV] = os.getcwd()


def command_line() -> tuple[str, str]:
    """(the command line as typed, its working directory); outside the CLI, this process's argv."""
    if COMMAND_ENV in os.environ:
        return os.environ[COMMAND_ENV], os.environ.get(CWD_ENV, os.getcwd())
    argv = [Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:]]
    return shlex.join(argv), os.getcwd()


@functools.lru_cache(maxsize=1)
def code_checkout() -> dict | None:
    """{"commit", "dirty"} of the git checkout the appliance code runs from; None when it is not
    one (an installed bundle) or git is missing, slow or refuses. Never touches the network."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, timeout=5,
                              check=True, env=env).stdout.strip()
    try:
        top = Path(git("rev-parse", "--show-toplevel"))
        if not (top / "appliance" / "core" / "manifest.py").is_file():
            return None  # appliance is installed inside someone else's repository
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def provenance() -> dict:
    """What every manifest says about how it was made (see the module docstring)."""
    command, cwd = command_line()
    found = {"command": command, "cwd": cwd, "appliance_version": __version__}
    checkout = code_checkout()
    if checkout is not None:
        found["git"] = checkout
    return found


def _outputs_of(directory: Path, cache: dict) -> tuple[dict, dict]:
    """(directory's manifest, {resolved output path: sha256}); empty when it has none (cached)."""
    if directory not in cache:
        manifest: dict = {}
        path = directory / MANIFEST_NAME
        if path.is_file():
            try:
                manifest = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                # A damaged upstream manifest would silently cut the edge package's lineage.
                raise DataError(f"{path}: damaged stage manifest ({err}); rerun that stage") from None
            except OSError:
                manifest = {}
        if not isinstance(manifest, dict):
            manifest = {}
        listed = {str((directory / e["path"]).resolve()): e.get("sha256")
                  for e in manifest.get("outputs", []) if isinstance(e, dict) and "path" in e}
        cache[directory] = (manifest, listed)
    return cache[directory]


def lineage_of(inputs: list[dict], out_dir: Path, levels: int = 3) -> list[dict]:
    """The stages that made these inputs ({path, sha256}), oldest first, one entry per directory:
    for each input, the nearest directory up to `levels` above it whose manifest lists that very
    file (same sha256) among its outputs, and that manifest's own lineage before it."""
    out_dir = Path(out_dir).resolve()
    cache: dict = {}
    steps: dict[str, dict] = {}
    for item in inputs:
        path = Path(item["path"]).resolve()
        directory = path.parent
        for _ in range(levels):
            manifest, listed = _outputs_of(directory, cache) if directory != out_dir else ({}, {})
            if listed.get(str(path)) == item["sha256"]:
                earlier = manifest.get("lineage") or manifest.get("params", {}).get("lineage", [])
                entry = {"stage": manifest.get("stage"), "dir": str(directory),
                         **{k: manifest.get(k) for k in ("command", "cwd", "appliance_version", "git") if k in manifest},
                         "inputs": manifest.get("inputs", []),
                         "params": {k: v for k, v in manifest.get("params", {}).items() if k != "lineage"}}
                for step in [*earlier, entry]:
                    steps.setdefault(step.get("dir") or json.dumps(step, sort_keys=True, default=str), step)
                break
            if directory.parent == directory:
                break
            directory = directory.parent
    return list(steps.values())


def write_manifest(out_dir: str | os.PathLike, stage: str, inputs, params: dict, outputs=None) -> dict:
    """Write out_dir/manifest.json. outputs defaults to every file under out_dir (manifest excluded)."""
    out_dir = Path(out_dir)
    if outputs is None:
        # A directory lock (.lock, .lock-node<R>) belongs to the run writing here, not to its outputs.
        outputs = sorted(p for p in out_dir.rglob("*") if p.is_file() and p.name != MANIFEST_NAME
                         and not p.name.startswith(".lock"))
    hashed_inputs = [{"path": str(p), "sha256": sha256_file(p)} for p in map(Path, inputs)]
    manifest = {
        "stage": stage,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **provenance(),
        "inputs": hashed_inputs,
        "params": params,
        "outputs": [
            {"path": str(Path(p).relative_to(out_dir)) if Path(p).is_relative_to(out_dir) else str(p),
             "sha256": sha256_file(p), "bytes": Path(p).stat().st_size}
            for p in map(Path, outputs)
        ],
        "versions": versions(),
        "lineage": lineage_of(hashed_inputs, out_dir),
    }
    atomic_write_text(out_dir / MANIFEST_NAME, json.dumps(manifest, indent=2, default=str) + "\n")
    return manifest


def read_manifest(out_dir: str | os.PathLike) -> dict:
    path = Path(out_dir) / MANIFEST_NAME
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: no manifest (is {out_dir} the output of an appliance stage?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise DataError(f"{path}: not valid JSON ({str(err)[:200]})") from None


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


def check_outputs(out_dir: str | os.PathLike, why: str = "") -> None:
    """A stage's directory whose every output still matches its manifest, else one line naming the
    first that does not (after `{out_dir}: {why}: `, why saying what that means here)."""
    problems = verify_outputs(out_dir)  # reads the manifest: its own problems are one line too
    if problems:
        raise DataError(f"{out_dir}: {why + ': ' if why else ''}{problems[0]}")
