"""Checkpoints that survive kills, full disks and tampering, and make resume exact.

This module writes them and applies retention (CheckpointManager); loading is
appliance/train/checkpoint_loader.py, the files' names and verified reads checkpoint_files.py, the
optimizer's storage optimizer_state.py and the collectives collectives.py.

Layout of CHECKPOINTS/step-00000120/ (one directory per optimizer step):
  model.safetensors, model.json   the trained-model directory files (export reads them)
  optimizer.safetensors + .json   optimizer tensors / the rest (per rank with ZeRO: optimizer-rank1.*)
  trainer.json                    step, epoch, sampler position, scheduler, scaler, metrics, config hash
  rng-rank0.json, rng-rank1.json  every RNG stream of every rank
  SHA256SUMS                      `sha256sum -c` format, over all of the above
  COMMITTED                       written last; a directory without it does not exist for us

Writing: all files go to .tmp-step-N/, each rank writes only the files it owns and fsyncs them,
then hashes them; one collective gathers every rank's hashes (so every part is durable before
anything commits), and each directory's writer writes the complete SHA256SUMS, renames the
directory, then writes COMMITTED last. A kill at any moment leaves either the previous
checkpoints untouched or a new complete one. Loading reads JSON and safetensors only:
nothing is ever unpickled. A checkpoint with any file unreadable, malformed or failing its
checksum is moved aside to damaged-step-N with a warning naming the file, and the previous good
one is used. A step directory without COMMITTED (a write killed before its marker, or a marker
deleted) is moved aside to uncommitted-step-N with a warning, never silently overwritten.

Several machines, with or without a shared filesystem. At start-up global rank 0 writes a probe
file with a random name and every other node's first process looks for it: seen by all, the
directory is shared ("shared": one writer, rank 0, as on one machine); seen by none, each node
has its own ("per-node"). Per node, each node's local rank 0 creates the directory on its disk
and commits it; every rank writes what it owns into its node's directory; every node's
SHA256SUMS lists all files of all ranks, and its COMMITTED marker lists the files that node
holds ("here"). Files only global rank 0 writes (weights, the unsharded optimizer, trainer.json)
stay on rank 0's node and are broadcast from there at load, not written on every node: the ranks
do not hold bit-identical copies of them (BatchNorm buffers differ between ranks between
forwards, DDP syncs them only at the next forward), so a copy per node would be another
checkpoint, and a broadcast costs one transfer per resume instead of disk and time per save.
The same mechanism ships a rank's own files when the rendezvous placed it on another node than
the one that wrote them. At resume each node verifies its own parts; the step loaded is the
newest one that every node holds verified (the minimum over nodes of the newest verified step,
repeated until all agree), and newer steps some nodes hold alone are moved aside to partial-step-N.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file

from appliance.core.errors import EnvironmentProblem
from appliance.core.manifest import sha256_file
from appliance.core.values import human_bytes
from appliance.models import save_trained_model
from appliance.train import faults
from appliance.train.checkpoint_files import (CHECKSUMS, COMMIT_MARKER, STEP_DIR, CheckpointDamaged, fsync_path,
                                              is_no_space, write_json)
from appliance.train.checkpoint_loader import CheckpointLoader
from appliance.train.collectives import (all_gather_json, barrier, broadcast_int, distributed, max_int, min_int,
                                         on_backend)
from appliance.train.optimizer_state import split_optimizer_state

__all__ = ["CHECKSUMS", "COMMIT_MARKER", "CheckpointDamaged", "CheckpointManager"]  # what callers catch and read

# Why a rank's part of a save failed, agreed over all ranks (the largest wins).
_SAVE_OK, _SAVE_OTHER, _SAVE_NO_SPACE = 0, 1, 2


class CheckpointManager(CheckpointLoader):
    def __init__(self, directory: str | Path, *, keep_last: int = 3, keep_best: int = 0,
                 monitor: str = "val_loss", mode: str = "min", min_free_bytes: int = 0,
                 rank: int = 0, world_size: int = 1, local_rank: int | None = None, node: int = 0, log=print,
                 model_state: dict | None = None, card=None):
        self.directory = Path(directory)
        self.model_state = model_state  # the model's own state dict: a checkpoint's weights must fit it
        self.card = card  # the ModelCard this run writes: a checkpoint's model.json must be it
        self.keep_last, self.keep_best = keep_last, keep_best
        self.monitor, self.mode = monitor, mode
        self.min_free_bytes = min_free_bytes
        self.rank, self.world_size = rank, world_size
        self.local_rank = rank if local_rank is None else local_rank
        self.node = node  # torchrun's GROUP_RANK: which machine this process runs on
        self.log = log
        if rank == 0 or self.local_rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
        self.shared = self._detect_shared()
        self.storage = "shared" if self.shared else "per-node"
        # The process that creates, commits and prunes this process's checkpoint directory.
        self.writer = rank == 0 if self.shared else self.local_rank == 0
        if self.writer:
            # Leftovers of a write that was killed: never committed, safe to drop now that no
            # other writer runs (we are starting up).
            for stale in [*self.directory.glob(".tmp-step-*"), *self.directory.glob(".shared-probe-*")]:
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
            for path in sorted(self.directory.glob("step-*")):
                if STEP_DIR.match(path.name) and path.is_dir() and not (path / COMMIT_MARKER).is_file():
                    aside = self._move_aside(path, "uncommitted")
                    self._warn(f"warning: checkpoint {path} has no {COMMIT_MARKER} marker (its write was "
                               f"interrupted, or the marker was deleted): not loaded; moved to {aside.name}")
        barrier()

    def _detect_shared(self) -> bool:
        """Whether every node sees the directory rank 0 sees (collective; one node: True)."""
        if not distributed() or self.world_size == 1:
            return True
        token = broadcast_int(secrets.randbits(62) if self.rank == 0 else 0)
        probe = self.directory / f".shared-probe-{token:016x}"
        if self.rank == 0:
            write_json(probe, {"written_by": "rank 0", "node": self.node})
        rank0_node = broadcast_int(self.node)
        other_leader = self.local_rank == 0 and self.node != rank0_node
        seen = torch.tensor([int(other_leader and probe.is_file()), int(other_leader)], dtype=torch.int64)
        seen = on_backend(seen)
        dist.all_reduce(seen)
        if self.rank == 0:
            probe.unlink(missing_ok=True)
        saw, leaders = int(seen[0].item()), int(seen[1].item())
        if 0 < saw < leaders:
            raise EnvironmentProblem(f"{self.directory}: {saw} of the other {leaders} nodes see rank 0's checkpoint "
                                     "directory and the rest do not: give every node the same kind of storage "
                                     "(all shared, or each its own disk)")
        return saw == leaders

    def _warn(self, line: str) -> None:
        # The loop's log prints on rank 0 only; another node's writer speaks for its own disk.
        self.log(line) if self.rank == 0 else print(line, flush=True)

    def _move_aside(self, path: Path, prefix: str) -> Path:
        """Keep a checkpoint we will not load for inspection, under a name we never load."""
        aside = path.with_name(f"{prefix}-{path.name}")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(path, aside)
        return aside

    # --- what exists ---------------------------------------------------------------------------

    def committed(self) -> list[tuple[int, Path]]:
        """(step, dir) of every committed checkpoint in this node's directory, oldest first."""
        found = []
        for path in self.directory.glob("step-*"):
            m = STEP_DIR.match(path.name)
            if m and (path / COMMIT_MARKER).is_file():
                found.append((int(m.group(1)), path))
        return sorted(found)

    def any_committed(self) -> bool:
        """Whether any node holds a committed checkpoint (collective: every rank gets the same answer)."""
        return bool(max_int(int(self.writer and bool(self.committed()))))

    def any_set_aside(self) -> bool:
        """Whether any node moved a checkpoint aside (damaged, uncommitted, partial); collective."""
        mine = self.writer and any(any(self.directory.glob(f"{p}-step-*")) for p in ("damaged", "uncommitted", "partial"))
        return bool(max_int(int(bool(mine))))

    # --- saving --------------------------------------------------------------------------------

    def save(self, step: int, *, model, card, optimizer_state: dict, optimizer_sharded: bool,
             trainer: dict, rng: dict) -> Path:
        """Write checkpoint `step` (collective: every rank calls it with its own state).

        A full disk or another write error on any rank is an EnvironmentProblem on every rank, with
        the temporary directory removed and the previous checkpoints untouched."""
        final = self.directory / f"step-{step:08d}"
        tmp = self.directory / f".tmp-step-{step:08d}"
        if min_int(int((final / COMMIT_MARKER).is_file())):
            return final  # already saved at this step on every node (e.g. a signal right after a periodic save)
        self._check_free_disk(model, optimizer_state)
        if self.writer:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        barrier()
        failure, sums = None, {}
        try:
            written = self._write_own_files(tmp, step, model, card, optimizer_state, optimizer_sharded, trainer)
            write_json(tmp / f"rng-rank{self.rank}.json", rng)
            fsync_path(tmp / f"rng-rank{self.rank}.json")
            sums = {p.name: sha256_file(p) for p in [*written, tmp / f"rng-rank{self.rank}.json"]}
        except (OSError, SafetensorError) as err:  # safetensors wraps the OSError in its own
            failure = err
        faults.maybe_die("checkpoint-write", step, self.rank)
        self._agree_on_write(step, tmp, failure)
        # Every rank's part is on its disk, fsynced; its hashes reach every writer.
        parts = all_gather_json({"node": self.node, "sums": sums})

        failure = None
        if self.writer:
            try:
                self._commit(step, tmp, final, parts, trainer.get("metrics", {}))
            except OSError as err:
                failure = err
                shutil.rmtree(final, ignore_errors=True)  # never committed: its marker is the last write
        self._agree_on_write(step, tmp, failure)
        if self.writer:
            self.apply_retention()
        barrier()
        return final

    def _agree_on_write(self, step: int, tmp: Path, failure: BaseException | None) -> None:
        """Raise the same one-line error on every rank when any rank's write failed."""
        code = _SAVE_OK if failure is None else _SAVE_NO_SPACE if is_no_space(failure) else _SAVE_OTHER
        code = max_int(code)
        if code == _SAVE_OK:
            return
        if self.writer:
            shutil.rmtree(tmp, ignore_errors=True)
        found = self.committed() if self.rank == 0 else []
        newest = broadcast_int(found[-1][0] if found else -1)  # rank 0's directory is the one we resume from
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
                         optimizer_sharded: bool, trainer: dict) -> list[Path]:
        owned: list[Path] = []
        if self.rank == 0:
            save_trained_model(tmp, model, card)
            owned += [tmp / "model.safetensors", tmp / "model.json"]
            write_json(tmp / "trainer.json", {**trainer, "step": step, "world_size": self.world_size,
                                                   "optimizer_sharded": optimizer_sharded})
            owned.append(tmp / "trainer.json")
        if self.rank == 0 or optimizer_sharded:
            name = f"optimizer-rank{self.rank}" if optimizer_sharded else "optimizer"
            tensors, rest = split_optimizer_state(optimizer_state)
            save_file(tensors, str(tmp / f"{name}.safetensors"))
            write_json(tmp / f"{name}.json", rest)
            owned += [tmp / f"{name}.safetensors", tmp / f"{name}.json"]
        for path in owned:
            fsync_path(path)
        return owned

    def _commit(self, step: int, tmp: Path, final: Path, parts: list[dict], metrics: dict) -> None:
        """A writer, every rank's part written and hashed: checksums, rename, then the marker."""
        listed = {name: digest for part in parts for name, digest in part["sums"].items()}
        here = sorted(name for part in parts if self.shared or part["node"] == self.node for name in part["sums"])
        with open(tmp / CHECKSUMS, "w") as f:
            f.write("".join(f"{listed[name]}  {name}\n" for name in sorted(listed)))
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        if final.exists():  # moved aside at start-up; only a concurrent writer could put it back
            aside = self._move_aside(final, "uncommitted")
            self._warn(f"warning: checkpoint {final} appeared without a {COMMIT_MARKER} marker while saving it; "
                       f"moved to {aside.name}")
        os.rename(tmp, final)
        write_json(final / COMMIT_MARKER, {"step": step, "files": len(here) + 1, "world_size": self.world_size,
                                            "storage": self.storage, "here": here, "metrics": metrics})
        fsync_path(final)
        fsync_path(self.directory)

    def _check_free_disk(self, model, optimizer_state: dict) -> None:
        need, free, ok = 0, 0, True
        if self.writer:
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
        short = min_int(self.world_size if ok else self.rank)  # the first writer short of space
        if short < self.world_size:
            free, need = broadcast_int(free, short), broadcast_int(need, short)
            raise EnvironmentProblem(
                f"{self.directory}: not enough free disk for a checkpoint: {human_bytes(free)} free, "
                f"need {human_bytes(need)} (checkpoint + [checkpoint] min_free_gb); nothing was written. "
                "Free space or lower keep_last/keep_best.")

    # --- retention -------------------------------------------------------------------------------

    def _metric(self, path: Path):
        for name in (COMMIT_MARKER, "trainer.json"):  # every node has the marker; trainer.json only rank 0's
            try:
                return json.loads((path / name).read_text())["metrics"].get(self.monitor)
            except (OSError, ValueError, KeyError, AttributeError):
                continue
        return None

    def apply_retention(self) -> list[Path]:
        """Delete committed checkpoints outside keep-last N + best k; never the newest. Writers only."""
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
