"""Checkpoints that survive kills, full disks and tampering, and make resume exact.

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

import errno
import json
import os
import hashlib
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load as load_tensor_bytes, save_file

from appliance.core.errors import ConfigError, EnvironmentProblem
from appliance.core.values import human_bytes
from appliance.core.manifest import sha256_file
from appliance.models import nonfinite_weights
from appliance.train import faults
from appliance.models import save_trained_model

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


def _on_backend(t: torch.Tensor) -> torch.Tensor:
    return t.cuda() if dist.get_backend() == "nccl" else t


def _broadcast_int(value: int, src: int = 0) -> int:
    """Rank src's value on every rank (so all ranks take the same branch)."""
    if not _dist():
        return value
    t = _on_backend(torch.tensor([value], dtype=torch.int64))
    dist.broadcast(t, src=src)
    return int(t.item())


def _reduce_int(value: int, op) -> int:
    if not _dist():
        return value
    t = _on_backend(torch.tensor([value], dtype=torch.int64))
    dist.all_reduce(t, op=op)
    return int(t.item())


def _max_int(value: int) -> int:
    """The largest value over all ranks (a barrier that also says whether any rank failed)."""
    return _reduce_int(value, dist.ReduceOp.MAX if _dist() else None)


def _min_int(value: int) -> int:
    return _reduce_int(value, dist.ReduceOp.MIN if _dist() else None)


def _all_gather_json(obj) -> list:
    """Every rank's JSON value, in rank order (JSON over the wire: nothing is unpickled)."""
    if not _dist():
        return [obj]
    data = json.dumps(obj).encode()
    size = _on_backend(torch.tensor([len(data)], dtype=torch.int64))
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = _on_backend(buf)
    bufs = [torch.zeros_like(buf) for _ in sizes]
    dist.all_gather(bufs, buf)
    return [json.loads(bytes(b[:int(s.item())].cpu().numpy())) for b, s in zip(bufs, sizes)]


def _broadcast_bytes(data: bytes, src: int) -> bytes:
    """Rank src's bytes on every rank."""
    size = _broadcast_int(len(data), src)
    buf = torch.zeros(size, dtype=torch.uint8)
    if dist.get_rank() == src and size:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = _on_backend(buf)
    dist.broadcast(buf, src=src)
    return bytes(buf.cpu().numpy())


# Why a rank's part of a save failed, agreed over all ranks (the largest wins).
_SAVE_OK, _SAVE_OTHER, _SAVE_NO_SPACE = 0, 1, 2


def _is_no_space(err: BaseException) -> bool:
    # safetensors wraps the OSError in its own error whose text carries the Rust io kind.
    return getattr(err, "errno", None) == errno.ENOSPC or "No space left" in str(err) or "StorageFull" in str(err)


class CheckpointManager:
    def __init__(self, directory: str | Path, *, keep_last: int = 3, keep_best: int = 0,
                 monitor: str = "val_loss", mode: str = "min", min_free_bytes: int = 0,
                 rank: int = 0, world_size: int = 1, local_rank: int | None = None, node: int = 0, log=print):
        self.directory = Path(directory)
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
                if _STEP_DIR.match(path.name) and path.is_dir() and not (path / COMMIT_MARKER).is_file():
                    aside = self._move_aside(path, "uncommitted")
                    self._warn(f"warning: checkpoint {path} has no {COMMIT_MARKER} marker (its write was "
                               f"interrupted, or the marker was deleted): not loaded; moved to {aside.name}")
        _barrier()

    def _detect_shared(self) -> bool:
        """Whether every node sees the directory rank 0 sees (collective; one node: True)."""
        if not _dist() or self.world_size == 1:
            return True
        token = _broadcast_int(secrets.randbits(62) if self.rank == 0 else 0)
        probe = self.directory / f".shared-probe-{token:016x}"
        if self.rank == 0:
            _write_json(probe, {"written_by": "rank 0", "node": self.node})
        rank0_node = _broadcast_int(self.node)
        other_leader = self.local_rank == 0 and self.node != rank0_node
        seen = torch.tensor([int(other_leader and probe.is_file()), int(other_leader)], dtype=torch.int64)
        seen = _on_backend(seen)
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
            m = _STEP_DIR.match(path.name)
            if m and (path / COMMIT_MARKER).is_file():
                found.append((int(m.group(1)), path))
        return sorted(found)

    def any_committed(self) -> bool:
        """Whether any node holds a committed checkpoint (collective: every rank gets the same answer)."""
        return bool(_max_int(int(self.writer and bool(self.committed()))))

    def any_set_aside(self) -> bool:
        """Whether any node moved a checkpoint aside (damaged, uncommitted, partial); collective."""
        mine = self.writer and any(any(self.directory.glob(f"{p}-step-*")) for p in ("damaged", "uncommitted", "partial"))
        return bool(_max_int(int(bool(mine))))

    # --- saving --------------------------------------------------------------------------------

    def save(self, step: int, *, model, card, optimizer_state: dict, optimizer_sharded: bool,
             trainer: dict, rng: dict) -> Path:
        """Write checkpoint `step` (collective: every rank calls it with its own state).

        A full disk or another write error on any rank is an EnvironmentProblem on every rank, with
        the temporary directory removed and the previous checkpoints untouched."""
        final = self.directory / f"step-{step:08d}"
        tmp = self.directory / f".tmp-step-{step:08d}"
        if _min_int(int((final / COMMIT_MARKER).is_file())):
            return final  # already saved at this step on every node (e.g. a signal right after a periodic save)
        self._check_free_disk(model, optimizer_state)
        if self.writer:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        failure, sums = None, {}
        try:
            written = self._write_own_files(tmp, step, model, card, optimizer_state, optimizer_sharded, trainer)
            _write_json(tmp / f"rng-rank{self.rank}.json", rng)
            _fsync_path(tmp / f"rng-rank{self.rank}.json")
            sums = {p.name: sha256_file(p) for p in [*written, tmp / f"rng-rank{self.rank}.json"]}
        except (OSError, SafetensorError) as err:  # safetensors wraps the OSError in its own
            failure = err
        faults.maybe_die("checkpoint-write", step, self.rank)
        self._agree_on_write(step, tmp, failure)
        # Every rank's part is on its disk, fsynced; its hashes reach every writer.
        parts = _all_gather_json({"node": self.node, "sums": sums})

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
        _barrier()
        return final

    def _agree_on_write(self, step: int, tmp: Path, failure: BaseException | None) -> None:
        """Raise the same one-line error on every rank when any rank's write failed."""
        code = _SAVE_OK if failure is None else _SAVE_NO_SPACE if _is_no_space(failure) else _SAVE_OTHER
        code = _max_int(code)
        if code == _SAVE_OK:
            return
        if self.writer:
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
                         optimizer_sharded: bool, trainer: dict) -> list[Path]:
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
        return owned

    def _commit(self, step: int, tmp: Path, final: Path, parts: list[dict], metrics: dict) -> None:
        """A writer, every rank's part written and hashed: checksums, rename, then the marker."""
        listed = {name: digest for part in parts for name, digest in part["sums"].items()}
        here = sorted(name for part in parts if self.shared or part["node"] == self.node for name in part["sums"])
        with open(tmp / CHECKSUMS, "w") as f:
            f.write("".join(f"{listed[name]}  {name}\n" for name in sorted(listed)))
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
        if final.exists():  # moved aside at start-up; only a concurrent writer could put it back
            aside = self._move_aside(final, "uncommitted")
            self._warn(f"warning: checkpoint {final} appeared without a {COMMIT_MARKER} marker while saving it; "
                       f"moved to {aside.name}")
        os.rename(tmp, final)
        _write_json(final / COMMIT_MARKER, {"step": step, "files": len(here) + 1, "world_size": self.world_size,
                                            "storage": self.storage, "here": here, "metrics": metrics})
        _fsync_path(final)
        _fsync_path(self.directory)

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
        short = _min_int(self.world_size if ok else self.rank)  # the first writer short of space
        if short < self.world_size:
            free, need = _broadcast_int(free, short), _broadcast_int(need, short)
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

    # --- loading ---------------------------------------------------------------------------------

    def _read(self, path: Path, verify: bool) -> Checkpoint:
        if verify:
            self._verify(path)
        return self._parse(path, lambda name: _read_bytes(path / name))

    def _parse(self, path: Path, get) -> Checkpoint:
        """A checkpoint from its files' bytes (get(name) -> bytes, CheckpointDamaged when missing)."""
        trainer = _parse_json("trainer.json", get("trainer.json"), dict)
        for key, kind in _TRAINER_KEYS.items():
            if not isinstance(trainer.get(key), kind) or isinstance(trainer.get(key), bool) and kind is int:
                raise CheckpointDamaged(f"trainer.json: {key!r} is missing or not {kind.__name__}")
        if trainer["world_size"] != self.world_size:
            raise _other_world(path, trainer["world_size"], self.world_size)
        rng = _parse_json(f"rng-rank{self.rank}.json", get(f"rng-rank{self.rank}.json"), dict)
        model_state = _parse_tensors("model.safetensors", get("model.safetensors"))
        nonfinite = nonfinite_weights(model_state)  # never saved so (the NaN stop): changed after saving
        if nonfinite:
            raise CheckpointDamaged(f"model.safetensors: {nonfinite}")
        name = f"optimizer-rank{self.rank}" if trainer["optimizer_sharded"] else "optimizer"
        rest = _parse_json(f"{name}.json", get(f"{name}.json"), dict)
        try:
            optimizer_state = join_optimizer_state(_parse_tensors(f"{name}.safetensors", get(f"{name}.safetensors")), rest)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CheckpointDamaged(f"{name}.json: not optimizer state ({type(err).__name__}: {err})") from None
        return Checkpoint(path, trainer["step"], trainer, rng, model_state, optimizer_state)

    def _verify(self, path: Path) -> list[str]:
        """Check this node's part of a checkpoint; the names of the files it holds."""
        marker = _read_json(path / COMMIT_MARKER, dict)
        if marker.get("step") != int(path.name.rsplit("-", 1)[1]):
            raise CheckpointDamaged(f"{COMMIT_MARKER} names step {marker.get('step')!r}, not this directory's")
        if isinstance(marker.get("world_size"), int) and marker["world_size"] != self.world_size:
            raise _other_world(path, marker["world_size"], self.world_size)
        listed = read_sums(path)
        present = {p.name for p in path.iterdir() if p.is_file()} - {CHECKSUMS, COMMIT_MARKER}
        if present - set(listed):
            raise CheckpointDamaged(f"unexpected files {sorted(present - set(listed))}")
        here = marker.get("here", sorted(listed))  # a checkpoint made before per-node storage: all of it
        if not isinstance(here, list) or not all(isinstance(n, str) and n in listed for n in here):
            raise CheckpointDamaged(f"{COMMIT_MARKER} lists files that {CHECKSUMS} does not")
        for name in here:
            file = path / name
            if not file.is_file():
                raise CheckpointDamaged(f"{name} is missing (listed in {CHECKSUMS})")
            if sha256_file(file) != listed[name]:
                raise CheckpointDamaged(f"{name} fails its sha256 check (damaged or changed after saving)")
        if present - set(here):
            raise CheckpointDamaged(f"unexpected files {sorted(present - set(here))}")
        for name in ("trainer.json", "model.safetensors"):
            if name not in listed:
                raise CheckpointDamaged(f"{name} is missing (not listed in {CHECKSUMS})")
        return here

    def load_latest(self) -> Checkpoint | None:
        """Newest committed checkpoint that verifies (collective). None when there is none."""
        if not self.shared:
            return self._load_agreed()
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

    def _load_agreed(self, only: Path | None = None) -> Checkpoint | None:
        """Per-node storage: the newest step every node holds verified, loaded (collective).

        only: a given checkpoint (--resume DIR), which every node must hold; CheckpointDamaged if not."""
        verified: dict[int, list[str]] = {}
        bound = 1 << 62
        while True:
            mine = bound  # a rank that is not a writer constrains nothing
            if self.writer:
                mine = -1
                candidates = [(int(only.name.rsplit("-", 1)[1]), only)] if only is not None else reversed(self.committed())
                for step, path in candidates:
                    if step > bound:
                        continue
                    try:
                        verified[step] = verified.get(step) or self._verify(path)
                        mine = step
                        break
                    except CheckpointDamaged as err:
                        if only is not None:
                            self._warn(f"warning: checkpoint {path} on node {self.node}: {err}")
                            break
                        aside = self._move_aside(path, "damaged")
                        self._warn(f"warning: checkpoint {path} skipped: {err}; moved to {aside.name}, "
                                   "trying the previous one")
            low, high = _min_int(mine), _max_int(mine if self.writer else -1)
            if low == high:
                break
            bound = low
        if low < 0:
            if only is not None:
                raise CheckpointDamaged(f"{only} is not a good checkpoint on every node (see the warnings above)")
            return None
        if self.writer and only is None:
            for step, path in self.committed():
                if step > low:  # this node's part of a step another node lacks: training redoes it
                    aside = self._move_aside(path, "partial")
                    self._warn(f"warning: checkpoint {path} is not held by every node (another node's part is "
                               f"missing or damaged): not loaded; moved to {aside.name}")
        path = self.directory / f"step-{low:08d}"
        files = self._gather_files(path, verified.get(low) if self.writer else None)
        try:
            return self._parse(path, lambda name: _get_file(files, name))
        except CheckpointDamaged as err:
            raise EnvironmentProblem(f"{path}: {err} on rank {self.rank}; its checksums matched") from None

    def _gather_files(self, path: Path, here: list[str] | None) -> dict[str, bytes]:
        """The bytes of the files this rank loads: from its node's disk, or broadcast by a node holding them."""
        table = _all_gather_json({"node": self.node, "here": here})
        holders: dict[int, tuple[int, set]] = {}  # node -> (its writer's rank, the files it holds)
        for rank, entry in enumerate(table):
            if entry["here"] is not None:
                holders[entry["node"]] = (rank, set(entry["here"]))
        node_of = [entry["node"] for entry in table]
        listed = read_sums(path)
        common = {"trainer.json", "model.safetensors", "optimizer.safetensors", "optimizer.json"}
        files: dict[str, bytes] = {}
        for name in sorted(listed):
            own = re.match(r"^(?:rng|optimizer)-rank(\d+)\.", name)
            needers = range(self.world_size) if name in common else [int(own.group(1))] if own else []
            holding = {node for node, (_, held) in holders.items() if name in held}
            if not needers:
                continue
            if not holding:
                raise EnvironmentProblem(f"{path}: {name} is held by no node (listed in {CHECKSUMS})")
            remote = [r for r in needers if node_of[r] not in holding]
            if self.rank in needers and node_of[self.rank] in holding:
                files[name] = (path / name).read_bytes()
            if remote:
                src = holders[min(holding)][0]
                data = _broadcast_bytes((path / name).read_bytes() if self.rank == src else b"", src)
                if self.rank in remote:
                    files[name] = data
        for name, data in files.items():
            if hashlib.sha256(data).hexdigest() != listed[name]:
                raise EnvironmentProblem(f"{path}: {name} changed after it verified (rank {self.rank})")
        return files

    def load(self, path: str | Path) -> Checkpoint:
        """A given checkpoint directory, verified; CheckpointDamaged if it is not good."""
        path = Path(path)
        if not self.shared:
            return self._load_agreed(only=path)
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


def _other_world(path: Path, made_by: int, now: int) -> ConfigError:
    # Not damage: the checkpoint is good for a run of its own size, so it is never moved aside
    # (an elastic run that lost a node must not discard the checkpoints the full run resumes from).
    return ConfigError(f"{path}: made by {made_by} processes, this run has {now}; resume with the same number "
                       "of processes (with --nnodes MIN:MAX, once every node is back)")


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path.name} is missing") from None
    except OSError as err:
        raise CheckpointDamaged(f"{path.name} is unreadable ({err.strerror})") from None


def _get_file(files: dict, name: str) -> bytes:
    if name not in files:
        raise CheckpointDamaged(f"{name} is missing")
    return files[name]


def _read_json(path: Path, kind: type):
    """A checkpoint's JSON file of the given top-level type; CheckpointDamaged naming it otherwise."""
    return _parse_json(path.name, _read_bytes(path), kind)


def _parse_json(name: str, data: bytes, kind: type):
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise CheckpointDamaged(f"{name} is unreadable (byte {err.start} is not UTF-8)") from None
    except ValueError as err:
        raise CheckpointDamaged(f"{name} is unreadable (not JSON: {err})") from None
    if not isinstance(value, kind):
        raise CheckpointDamaged(f"{name} holds a JSON {type(value).__name__}, expected a {kind.__name__}")
    return value


def _parse_tensors(name: str, data: bytes) -> dict:
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
        match = _SUMS_LINE.match(line)
        if not match:
            raise CheckpointDamaged(f"{CHECKSUMS} line {number} is not 'SHA256  NAME': {line[:80]!r}")
        listed[match.group(2)] = match.group(1)
    return listed
