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
nothing is ever unpickled. A checkpoint whose checksums or contents are wrong is skipped with a
warning naming what was wrong, and the previous good one is used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from appliance.errors import EnvironmentProblem
from appliance.manifest import sha256_file
from appliance.train import faults

COMMIT_MARKER = "COMMITTED"
CHECKSUMS = "SHA256SUMS"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


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
        _barrier()

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
        """Write checkpoint `step` (collective: every rank calls it with its own state)."""
        final = self.directory / f"step-{step:08d}"
        tmp = self.directory / f".tmp-step-{step:08d}"
        if _broadcast_int(int((final / COMMIT_MARKER).is_file())):
            return final  # already saved at this step (e.g. a signal right after a periodic save)
        self._check_free_disk(model, optimizer_state)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier()

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
        _write_json(tmp / f"rng-rank{self.rank}.json", rng)
        owned.append(tmp / f"rng-rank{self.rank}.json")
        for path in owned:
            _fsync_path(path)
        faults.maybe_die("checkpoint-write", step, self.rank)
        _barrier()

        if self.rank == 0:
            files = sorted(p for p in tmp.iterdir() if p.is_file())
            sums = "".join(f"{sha256_file(p)}  {p.name}\n" for p in files)
            (tmp / CHECKSUMS).write_text(sums)
            _fsync_path(tmp / CHECKSUMS)
            _fsync_path(tmp)
            if final.exists():  # an uncommitted directory of the same step: never loaded, replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
            _write_json(final / COMMIT_MARKER, {"step": step, "files": len(files) + 1})
            _fsync_path(final)
            _fsync_path(self.directory)
            self.apply_retention()
        _barrier()
        return final

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
            raise EnvironmentProblem(
                f"{self.directory}: not enough free disk for a checkpoint: {free / 2**30:.2f} GiB free, "
                f"need {need / 2**30:.2f} GiB (checkpoint + [checkpoint] min_free_gb); nothing was written. "
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
        try:
            trainer = json.loads((path / "trainer.json").read_text())
            if trainer.get("world_size") != self.world_size:
                raise CheckpointDamaged(
                    f"made by {trainer.get('world_size')} processes, this run has {self.world_size} "
                    "(resume with the same number of processes)")
            rng = json.loads((path / f"rng-rank{self.rank}.json").read_text())
            model_state = load_file(str(path / "model.safetensors"))
            name = f"optimizer-rank{self.rank}" if trainer["optimizer_sharded"] else "optimizer"
            optimizer_state = join_optimizer_state(load_file(str(path / f"{name}.safetensors")),
                                                   json.loads((path / f"{name}.json").read_text()))
        except CheckpointDamaged:
            raise
        except FileNotFoundError as err:
            raise CheckpointDamaged(f"missing {Path(err.filename).name}") from None
        except (ValueError, KeyError, TypeError, OSError) as err:  # JSON/safetensors parse errors
            raise CheckpointDamaged(f"unreadable state ({type(err).__name__}: {err})") from None
        except Exception as err:  # safetensors' own SafetensorError
            raise CheckpointDamaged(f"unreadable tensors ({err})") from None
        return Checkpoint(path, trainer["step"], trainer, rng, model_state, optimizer_state)

    def _verify(self, path: Path) -> None:
        sums_path = path / CHECKSUMS
        if not sums_path.is_file():
            raise CheckpointDamaged(f"no {CHECKSUMS}")
        listed = {}
        for line in sums_path.read_text().splitlines():
            digest, _, name = line.partition("  ")
            listed[name] = digest
        for name, digest in listed.items():
            file = path / name
            if not file.is_file():
                raise CheckpointDamaged(f"{name} is missing")
            if sha256_file(file) != digest:
                raise CheckpointDamaged(f"{name} fails its sha256 check (damaged or changed after saving)")
        present = {p.name for p in path.iterdir() if p.is_file()} - {CHECKSUMS, COMMIT_MARKER}
        if present - set(listed):
            raise CheckpointDamaged(f"unexpected files {sorted(present - set(listed))}")

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
                    aside = path.with_name(f"damaged-{path.name}")
                    shutil.rmtree(aside, ignore_errors=True)
                    os.rename(path, aside)
                    self.log(f"warning: checkpoint {path} skipped: {err}; moved to {aside.name}, "
                             "trying the previous one")
        chosen = _broadcast_int(chosen)
        if chosen < 0:
            return None
        return self._read(self.directory / f"step-{chosen:08d}", verify=False)

    def load(self, path: str | Path) -> Checkpoint:
        """A given checkpoint directory, verified; CheckpointDamaged if it is not good."""
        path = Path(path)
        if not (path / COMMIT_MARKER).is_file():
            raise CheckpointDamaged(f"{path} has no {COMMIT_MARKER} marker (its write never finished)")
        return self._read(path, verify=True)
