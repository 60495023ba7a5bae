"""A checkpoint's files: their names, the durable writes (fsync), and the verified reads (JSON of a
given type, safetensors, SHA256SUMS) that raise CheckpointDamaged naming the file, never unpickling.
"""

from __future__ import annotations

import errno
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load as load_tensor_bytes

from appliance.core.errors import ConfigError
from appliance.core.values import shown


COMMIT_MARKER = "COMMITTED"


CHECKSUMS = "SHA256SUMS"


STEP_DIR = re.compile(r"^step-(\d{8})$")


SUMS_LINE = re.compile(r"^([0-9a-f]{64})  ([A-Za-z0-9._-]+)$")


class CheckpointDamaged(Exception):
    """A checkpoint that must not be loaded; str() says what is wrong."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    trainer: dict  # step, epoch, sampler, scheduler, scaler, metrics, config_hash, world_size
    rng: dict  # this rank's RNG streams
    model_state: dict
    optimizer_state: dict


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


# trainer.json keys the loop reads, with their JSON types
TRAINER_KEYS = {"step": int, "epoch": int, "batches_done": int, "world_size": int, "optimizer_sharded": bool,
                 "sampler": dict, "scheduler": dict, "scaler": dict, "metrics": dict, "config_hash": str}


def other_world(path: Path, made_by: int, now: int) -> ConfigError:
    # Not damage: the checkpoint is good for a run of its own size, so it is never moved aside
    # (an elastic run that lost a node must not discard the checkpoints the full run resumes from).
    return ConfigError(f"{path}: made by {made_by} processes, this run has {now}; resume with the same number "
                       "of processes (with --nnodes MIN:MAX, once every node is back)")


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path.name} is missing") from None
    except OSError as err:
        raise CheckpointDamaged(f"{path.name} is unreadable ({err.strerror})") from None


def get_file(files: dict, name: str) -> bytes:
    if name not in files:
        raise CheckpointDamaged(f"{name} is missing")
    return files[name]


def read_json(path: Path, kind: type):
    """A checkpoint's JSON file of the given top-level type; CheckpointDamaged naming it otherwise."""
    return parse_json(path.name, read_bytes(path), kind)


def parse_json(name: str, data: bytes, kind: type):
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise CheckpointDamaged(f"{name} is unreadable (byte {err.start} is not UTF-8)") from None
    except ValueError as err:
        raise CheckpointDamaged(f"{name} is unreadable (not JSON: {err})") from None
    if not isinstance(value, kind):
        raise CheckpointDamaged(f"{name} holds a JSON {type(value).__name__}, expected a {kind.__name__}")
    return value


def parse_tensors(name: str, data: bytes) -> dict:
    try:
        return load_tensor_bytes(data)
    except (OSError, SafetensorError) as err:
        raise CheckpointDamaged(f"{name} is unreadable tensors ({err})") from None


def read_sums(path: Path) -> dict[str, str]:
    """SHA256SUMS as {name: sha256}; CheckpointDamaged when missing or malformed."""
    sums_path = path / CHECKSUMS
    if not sums_path.is_file():
        raise CheckpointDamaged(f"{CHECKSUMS} is missing")
    try:
        text = sums_path.read_bytes().decode("utf-8")
    except OSError as err:
        raise CheckpointDamaged(f"{CHECKSUMS} is unreadable ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise CheckpointDamaged(f"{CHECKSUMS} is not text (byte {err.start} is not UTF-8)") from None
    if not text.endswith("\n"):
        raise CheckpointDamaged(f"{CHECKSUMS} is truncated (no newline at its end)")
    listed = {}
    for number, line in enumerate(text.splitlines(), start=1):
        match = SUMS_LINE.match(line)
        if not match:
            raise CheckpointDamaged(f"{CHECKSUMS} line {number} is not 'SHA256  NAME': {line[:80]!r}")
        listed[match.group(2)] = match.group(1)
    return listed


def is_no_space(err: BaseException) -> bool:
    # safetensors wraps the OSError in its own error whose text carries the Rust io kind.
    return getattr(err, "errno", None) == errno.ENOSPC or "No space left" in str(err) or "StorageFull" in str(err)


def check_resume(resume: str) -> None:
    """--resume auto, none, or a checkpoint directory (step-NNNNNNNN): what the workers would refuse,
    refused before torchrun (and by --dry-run). Its files are verified by the workers, on every node."""
    if resume in ("auto", "none"):
        return
    path = Path(resume)
    try:
        is_dir = path.is_dir()
    except (OSError, ValueError):  # a NUL byte, a name too long
        is_dir = False
    if not is_dir or not STEP_DIR.match(path.name):
        raise ConfigError(f"--resume {shown(resume)}: expected auto, none or a checkpoint directory "
                          f"(RUN_DIR/checkpoints/step-NNNNNNNN){'' if is_dir else ' that exists'}")
