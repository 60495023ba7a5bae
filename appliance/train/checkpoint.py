"""Checkpoints that survive kills, full disks and tampering, and make resume exact.

Layout of CHECKPOINTS/step-00000120/ (one directory per optimizer step):
  model.safetensors, model.json   the trained-model directory files (export reads them)
  optimizer.safetensors + .json   optimizer tensors / the rest (per rank with ZeRO: optimizer-rank1.*)
  trainer.json                    step, epoch, sampler position, scheduler, scaler, metrics, config hash
  rng-rank0.json, rng-rank1.json  every RNG stream of every rank
  SHA256SUMS                      `sha256sum -c` format, over all of the above
  COMMITTED                       written last; a directory without it does not exist for us

Writing: all files go to .tmp-step-N/, each rank writes only the files it owns, rank 0 checksums,
fsyncs and renames the directory, then writes COMMITTED. A kill at any moment leaves either the
previous checkpoints untouched or a new complete one. Loading reads JSON and safetensors only:
nothing is ever unpickled. A checkpoint with any file unreadable, malformed or failing its
checksum is moved aside to damaged-step-N with a warning naming the file, and the previous good
one is used. A step directory without COMMITTED (a write killed before its marker, or a marker
deleted) is moved aside to uncommitted-step-N with a warning, never silently overwritten.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from appliance.errors import EnvironmentProblem
from appliance.values import human_bytes
from appliance.manifest import sha256_file
from appliance.train import faults

COMMIT_MARKER = "COMMITTED"
CHECKSUMS = "SHA256SUMS"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_SUMS_LINE = re.compile(r"^([0-9a-f]{64})  ([A-Za-z0-9._-]+)$")


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


# --- optimizer state <-> (safetensors tensors, JSON rest) -------------------------------------

def split_optimizer_state(state_dict: dict) -> tuple[dict, dict]:
    tensors, rest = {}, {}
    for index, per_param in state_dict["state"].items():
        for key, value in per_param.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                rest.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": state_dict["param_groups"], "state": rest}


def join_optimizer_state(tensors: dict, rest: dict) -> dict:
    state: dict[int, dict] = {int(i): dict(v) for i, v in rest["state"].items()}
    for name, value in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    return {"state": dict(sorted(state.items())), "param_groups": rest["param_groups"]}


# --- small file helpers --------------------------------------------------------------------

def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _broadcast_int(value: int) -> int:
    """Rank 0's value on every rank (so all ranks take the same branch)."""
    if not _dist():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.broadcast(t, src=0)
    return int(t.item())


def _max_int(value: int) -> int:
    """The largest value over all ranks (a barrier that also says whether any rank failed)."""
    if not _dist():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


# Why a rank's part of a save failed, agreed over all ranks (the largest wins).
_SAVE_OK, _SAVE_OTHER, _SAVE_NO_SPACE = 0, 1, 2


def _is_no_space(err: BaseException) -> bool:
    # safetensors wraps the OSError in its own error whose text carries the Rust io kind.
    return getattr(err, "errno", None) == errno.ENOSPC or "No space left" in str(err) or "StorageFull" in str(err)


class CheckpointManager:
    def __init__(self, directory: str | Path, *, keep_last: int = 3, keep_best: int = 0,
                 monitor: str = "val_loss", mode: str = "min", min_free_bytes: int = 0,
                 rank: int = 0, world_size: int = 1, log=print):
        self.directory = Path(directory)
        self.keep_last, self.keep_best = keep_last, keep_best
        self.monitor, self.mode = monitor, mode
        self.min_free_bytes = min_free_bytes
        self.rank, self.world_size = rank, world_size
        self.log = log
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Leftovers of a write that was killed: never committed, safe to drop now that no
            # other writer runs (we are starting up).
            for stale in self.directory.glob(".tmp-step-*"):
                shutil.rmtree(stale, ignore_errors=True)
            for path in sorted(self.directory.glob("step-*")):
                if _STEP_DIR.match(path.name) and path.is_dir() and not (path / COMMIT_MARKER).is_file():
                    aside = self._move_aside(path, "uncommitted")
                    self.log(f"warning: checkpoint {path} has no {COMMIT_MARKER} marker (its write was "
                             f"interrupted, or the marker was deleted): not loaded; moved to {aside.name}")
        _barrier()

    def _move_aside(self, path: Path, prefix: str) -> Path:
        """Keep a checkpoint we will not load for inspection, under a name we never load."""
        aside = path.with_name(f"{prefix}-{path.name}")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(path, aside)
        return aside

    # --- what exists ---------------------------------------------------------------------------

    def committed(self) -> list[tuple[int, Path]]:
        """(step, dir) of every committed checkpoint, oldest first."""
        found = []
        for path in self.directory.glob("step-*"):
            m = _STEP_DIR.match(path.name)
            if m and (path / COMMIT_MARKER).is_file():
                found.append((int(m.group(1)), path))
        return sorted(found)

    # --- saving --------------------------------------------------------------------------------

    def save(self, step: int, *, model, card, optimizer_state: dict, optimizer_sharded: bool,
             trainer: dict, rng: dict) -> Path:
        """Write checkpoint `step` (collective: every rank calls it with its own state).

        A full disk or another write error on any rank is an EnvironmentProblem on every rank, with
        the temporary directory removed and the previous checkpoints untouched."""
        final = self.directory / f"step-{step:08d}"
        tmp = self.directory / f".tmp-step-{step:08d}"
        if _broadcast_int(int((final / COMMIT_MARKER).is_file())):
            return final  # already saved at this step (e.g. a signal right after a periodic save)
        self._check_free_disk(model, optimizer_state)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        failure = None
        try:
            self._write_own_files(tmp, step, model, card, optimizer_state, optimizer_sharded, trainer)
            _write_json(tmp / f"rng-rank{self.rank}.json", rng)
            _fsync_path(tmp / f"rng-rank{self.rank}.json")
        except (OSError, SafetensorError) as err:  # safetensors wraps the OSError in its own
            failure = err
        faults.maybe_die("checkpoint-write", step, self.rank)
        self._agree_on_write(step, tmp, failure)

        failure = None
        if self.rank == 0:
            try:
                self._commit(step, tmp, final)
            except OSError as err:
                failure = err
                shutil.rmtree(final, ignore_errors=True)  # never committed: its marker is the last write
        self._agree_on_write(step, tmp, failure)
        if self.rank == 0:
            self.apply_retention()
        _barrier()
        return final

    def _agree_on_write(self, step: int, tmp: Path, failure: BaseException | None) -> None:
        """Raise the same one-line error on every rank when any rank's write failed."""
        code = _SAVE_OK if failure is None else _SAVE_NO_SPACE if _is_no_space(failure) else _SAVE_OTHER
        code = _max_int(code)
        if code == _SAVE_OK:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        found = self.committed() if self.rank == 0 else []
        newest = _broadcast_int(found[-1][0] if found else -1)  # rank 0's directory is the one we resume from
        previous = f"the previous checkpoint step-{newest:08d} is intact" if newest >= 0 else "no earlier checkpoint exists"
        if code == _SAVE_NO_SPACE:
            raise EnvironmentProblem(f"{self.directory}: no space left on device while writing "
                                     f"step-{step:08d}: {previous}; free space, then resume with the same command")
        if failure is not None:
            where = getattr(failure, "filename", None) or tmp
            what = getattr(failure, "strerror", None) or str(failure).strip().splitlines()[-1]
            raise EnvironmentProblem(f"{where}: cannot write checkpoint step-{step:08d}: {what}; {previous}")
        raise EnvironmentProblem(f"{self.directory}: another process could not write its part of checkpoint "
                                 f"step-{step:08d} (its error is above); {previous}")

    def _write_own_files(self, tmp: Path, step: int, model, card, optimizer_state: dict,
                         optimizer_sharded: bool, trainer: dict) -> None:
        from appliance.models import save_trained_model

        owned: list[Path] = []
        if self.rank == 0:
            save_trained_model(tmp, model, card)
            owned += [tmp / "model.safetensors", tmp / "model.json"]
            _write_json(tmp / "trainer.json", {**trainer, "step": step, "world_size": self.world_size,
                                                   "optimizer_sharded": optimizer_sharded})
            owned.append(tmp / "trainer.json")
        if self.rank == 0 or optimizer_sharded:
            name = f"optimizer-rank{self.rank}" if optimizer_sharded else "optimizer"
            tensors, rest = split_optimizer_state(optimizer_state)
            save_file(tensors, str(tmp / f"{name}.safetensors"))
            _write_json(tmp / f"{name}.json", rest)
            owned += [tmp / f"{name}.safetensors", tmp / f"{name}.json"]
        for path in owned:
            _fsync_path(path)

    def _commit(self, step: int, tmp: Path, final: Path) -> None:
        """Rank 0, every rank's files written: checksums, rename, then the marker."""
        files = sorted(p for p in tmp.iterdir() if p.is_file())
        sums = "".join(f"{sha256_file(p)}  {p.name}\n" for p in files)
        with open(tmp / CHECKSUMS, "w") as f:
            f.write(sums)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
        if final.exists():  # moved aside at start-up; only a concurrent writer could put it back
            aside = self._move_aside(final, "uncommitted")
            self.log(f"warning: checkpoint {final} appeared without a {COMMIT_MARKER} marker while saving it; "
                     f"moved to {aside.name}")
        os.rename(tmp, final)
        _write_json(final / COMMIT_MARKER, {"step": step, "files": len(files) + 1})
        _fsync_path(final)
        _fsync_path(self.directory)

    def _check_free_disk(self, model, optimizer_state: dict) -> None:
        need = 0
        if self.rank == 0:
            newest = self.committed()
            if newest:
                need = sum(p.stat().st_size for p in newest[-1][1].iterdir() if p.is_file())
            else:  # first save: estimate from the tensors (optimizer sharded or not, an upper bound)
                need = sum(t.numel() * t.element_size() for t in model.state_dict().values())
                need += sum(t.numel() * t.element_size() for s in optimizer_state["state"].values()
                            for t in s.values() if torch.is_tensor(t)) * self.world_size
            need = int(need * 1.1) + self.min_free_bytes
            free = shutil.disk_usage(self.directory).free
            ok = free >= need
        else:
            free, ok = 0, True
        if not _broadcast_int(int(ok)):
            free, need = _broadcast_int(free), _broadcast_int(need)
            raise EnvironmentProblem(
                f"{self.directory}: not enough free disk for a checkpoint: {human_bytes(free)} free, "
                f"need {human_bytes(need)} (checkpoint + [checkpoint] min_free_gb); nothing was written. "
                "Free space or lower keep_last/keep_best.")

    # --- retention -------------------------------------------------------------------------------

    def _metric(self, path: Path):
        try:
            return json.loads((path / "trainer.json").read_text())["metrics"].get(self.monitor)
        except (OSError, ValueError, KeyError, AttributeError):
            return None

    def apply_retention(self) -> list[Path]:
        """Delete committed checkpoints outside keep-last N + best k; never the newest. Rank 0 only."""
        found = self.committed()
        if not found:
            return []
        keep = {step for step, _ in found[-self.keep_last:]} | {found[-1][0]}
        scored = [(m, step) for step, path in found if isinstance(m := self._metric(path), (int, float))]
        scored.sort(key=lambda ms: ms[0] if self.mode == "min" else -ms[0])
        keep |= {step for _, step in scored[: self.keep_best]}
        removed = []
        for step, path in found:
            if step not in keep:
                (path / COMMIT_MARKER).unlink()  # uncommitted first: a half-deleted dir is never loaded
                shutil.rmtree(path)
                removed.append(path)
        return removed

    # --- loading ---------------------------------------------------------------------------------

    def _read(self, path: Path, verify: bool) -> Checkpoint:
        if verify:
            self._verify(path)
        trainer = _read_json(path / "trainer.json", dict)
        for key, kind in _TRAINER_KEYS.items():
            if not isinstance(trainer.get(key), kind) or isinstance(trainer.get(key), bool) and kind is int:
                raise CheckpointDamaged(f"trainer.json: {key!r} is missing or not {kind.__name__}")
        if trainer["world_size"] != self.world_size:
            raise CheckpointDamaged(
                f"made by {trainer['world_size']} processes, this run has {self.world_size} "
                "(resume with the same number of processes)")
        rng = _read_json(path / f"rng-rank{self.rank}.json", dict)
        model_state = _read_tensors(path / "model.safetensors")
        name = f"optimizer-rank{self.rank}" if trainer["optimizer_sharded"] else "optimizer"
        rest = _read_json(path / f"{name}.json", dict)
        try:
            optimizer_state = join_optimizer_state(_read_tensors(path / f"{name}.safetensors"), rest)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CheckpointDamaged(f"{name}.json: not optimizer state ({type(err).__name__}: {err})") from None
        return Checkpoint(path, trainer["step"], trainer, rng, model_state, optimizer_state)

    def _verify(self, path: Path) -> None:
        marker = _read_json(path / COMMIT_MARKER, dict)
        if marker.get("step") != int(path.name.rsplit("-", 1)[1]):
            raise CheckpointDamaged(f"{COMMIT_MARKER} names step {marker.get('step')!r}, not this directory's")
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
            match = _SUMS_LINE.match(line)
            if not match:
                raise CheckpointDamaged(f"{CHECKSUMS} line {number} is not 'SHA256  NAME': {line[:80]!r}")
            listed[match.group(2)] = match.group(1)
        for name, digest in listed.items():
            file = path / name
            if not file.is_file():
                raise CheckpointDamaged(f"{name} is missing (listed in {CHECKSUMS})")
            if sha256_file(file) != digest:
                raise CheckpointDamaged(f"{name} fails its sha256 check (damaged or changed after saving)")
        present = {p.name for p in path.iterdir() if p.is_file()} - {CHECKSUMS, COMMIT_MARKER}
        if present - set(listed):
            raise CheckpointDamaged(f"unexpected files {sorted(present - set(listed))}")
        for name in ("trainer.json", "model.safetensors"):
            if name not in listed:
                raise CheckpointDamaged(f"{name} is missing (not listed in {CHECKSUMS})")

    def load_latest(self) -> Checkpoint | None:
        """Newest committed checkpoint that verifies (collective). None when there is none."""
        chosen = -1
        if self.rank == 0:
            for step, path in reversed(self.committed()):
                try:
                    self._read(path, verify=True)
                    chosen = step
                    break
                except CheckpointDamaged as err:
                    # Kept for inspection under a name we never load; training will redo this step.
                    aside = self._move_aside(path, "damaged")
                    self.log(f"warning: checkpoint {path} skipped: {err}; moved to {aside.name}, "
                             "trying the previous one")
        chosen = _broadcast_int(chosen)
        if chosen < 0:
            return None
        path = self.directory / f"step-{chosen:08d}"
        try:
            return self._read(path, verify=False)
        except CheckpointDamaged as err:  # this rank's own files (rank 0 verified them on its node)
            raise EnvironmentProblem(f"{path}: {err} on rank {self.rank}; it verified on rank 0") from None

    def load(self, path: str | Path) -> Checkpoint:
        """A given checkpoint directory, verified; CheckpointDamaged if it is not good."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointDamaged(f"{path} is not a checkpoint directory (it does not exist or is a file)")
        if not _STEP_DIR.match(path.name):
            raise CheckpointDamaged(f"{path} is not a checkpoint directory (step-NNNNNNNN)")
        if not (path / COMMIT_MARKER).is_file():
            raise CheckpointDamaged(f"{path} has no {COMMIT_MARKER} marker (its write never finished)")
        return self._read(path, verify=True)


# trainer.json keys the loop reads, with their JSON types
_TRAINER_KEYS = {"step": int, "epoch": int, "batches_done": int, "world_size": int, "optimizer_sharded": bool,
                 "sampler": dict, "scheduler": dict, "scaler": dict, "metrics": dict, "config_hash": str}


def _read_json(path: Path, kind: type):
    """A checkpoint's JSON file of the given top-level type; CheckpointDamaged naming it otherwise."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path.name} is missing") from None
    except OSError as err:
        raise CheckpointDamaged(f"{path.name} is unreadable ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise CheckpointDamaged(f"{path.name} is unreadable (byte {err.start} is not UTF-8)") from None
    except ValueError as err:
        raise CheckpointDamaged(f"{path.name} is unreadable (not JSON: {err})") from None
    if not isinstance(value, kind):
        raise CheckpointDamaged(f"{path.name} holds a JSON {type(value).__name__}, expected a {kind.__name__}")
    return value


def _read_tensors(path: Path) -> dict:
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path.name} is missing") from None
    except (OSError, SafetensorError) as err:
        raise CheckpointDamaged(f"{path.name} is unreadable tensors ({err})") from None
