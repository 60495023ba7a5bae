"""Loading checkpoints (appliance.train.checkpoint): the newest committed step every node holds
verified, its files checked against SHA256SUMS and parsed without unpickling; a damaged one is
moved aside and the one before it is used. CheckpointManager inherits this half; it relies on the
manager's directory, rank, node and model_state attributes, `committed()`, `_warn` and `_move_aside`.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from appliance.core.errors import EnvironmentProblem
from appliance.core.manifest import sha256_file
from appliance.models import mismatched_weights, nonfinite_weights
from appliance.train.checkpoint_files import (CHECKSUMS, COMMIT_MARKER, STEP_DIR, TRAINER_KEYS, Checkpoint,
                                              CheckpointDamaged, get_file, other_world, parse_json, parse_tensors,
                                              read_bytes, read_json, read_sums)
from appliance.train.collectives import all_gather_json, broadcast_bytes, broadcast_int, max_int, min_int
from appliance.train.optimizer_state import join_optimizer_state


class CheckpointLoader:
    """The loading half of CheckpointManager (see the module docstring for what it relies on)."""

    def _read(self, path: Path, verify: bool) -> Checkpoint:
        if verify:
            self._verify(path)
        return self._parse(path, lambda name: read_bytes(path / name))

    def _parse(self, path: Path, get) -> Checkpoint:
        """A checkpoint from its files' bytes (get(name) -> bytes, CheckpointDamaged when missing)."""
        trainer = parse_json("trainer.json", get("trainer.json"), dict)
        for key, kind in TRAINER_KEYS.items():
            if not isinstance(trainer.get(key), kind) or isinstance(trainer.get(key), bool) and kind is int:
                raise CheckpointDamaged(f"trainer.json: {key!r} is missing or not {kind.__name__}")
        if trainer["world_size"] != self.world_size:
            raise other_world(path, trainer["world_size"], self.world_size)
        rng = parse_json(f"rng-rank{self.rank}.json", get(f"rng-rank{self.rank}.json"), dict)
        model_state = parse_tensors("model.safetensors", get("model.safetensors"))
        # Never saved so (the NaN stop; the model's own dtypes): changed after saving, sums rewritten.
        problem = nonfinite_weights(model_state) or (mismatched_weights(model_state, self.model_state)
                                                      if self.model_state is not None else None)
        if problem:
            raise CheckpointDamaged(f"model.safetensors: {problem}")
        self._check_card(get("model.json"))
        name = f"optimizer-rank{self.rank}" if trainer["optimizer_sharded"] else "optimizer"
        rest = parse_json(f"{name}.json", get(f"{name}.json"), dict)
        try:
            optimizer_state = join_optimizer_state(parse_tensors(f"{name}.safetensors", get(f"{name}.safetensors")), rest)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CheckpointDamaged(f"{name}.json: not optimizer state ({type(err).__name__}: {err})") from None
        return Checkpoint(path, trainer["step"], trainer, rng, model_state, optimizer_state)

    def _check_card(self, data: bytes) -> None:
        """model.json must be the card this run writes (export reads it from a checkpoint): a key added
        or a value changed, sums rewritten, resumed silently before."""
        card = parse_json("model.json", data, dict)
        expected = getattr(self, "card", None)
        if expected is None:
            return
        want = json.loads(expected.to_json())
        for where, got, wanted in (("", card, want), ("extra.", card.get("extra"), want.get("extra"))):
            if isinstance(got, dict) and isinstance(wanted, dict) and set(got) != set(wanted):
                added, dropped = sorted(set(got) - set(wanted)), sorted(set(wanted) - set(got))
                raise CheckpointDamaged(f"model.json: keys {', '.join(where + k for k in added) or 'none'} added, "
                                        f"{', '.join(where + k for k in dropped) or 'none'} missing against the card "
                                        "this run writes (changed after saving)")
        # extra.run names the run that wrote it: --resume may take another run's checkpoint.
        changed = sorted([k for k in want if k != "extra" and card.get(k) != want[k]]
                         + [f"extra.{k}" for k in want.get("extra", {}) if k != "run"
                            and card.get("extra", {}).get(k) != want["extra"][k]])
        if changed:
            raise CheckpointDamaged(f"model.json: {', '.join(changed)} differ from the card this run writes "
                                    "(changed after saving)")

    def _verify(self, path: Path) -> list[str]:
        """Check this node's part of a checkpoint; the names of the files it holds."""
        marker = read_json(path / COMMIT_MARKER, dict)
        if marker.get("step") != int(path.name.rsplit("-", 1)[1]):
            raise CheckpointDamaged(f"{COMMIT_MARKER} names step {marker.get('step')!r}, not this directory's")
        if isinstance(marker.get("world_size"), int) and marker["world_size"] != self.world_size:
            raise other_world(path, marker["world_size"], self.world_size)
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
        for name in ("trainer.json", "model.safetensors", "model.json"):
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
        chosen = broadcast_int(chosen)
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
            low, high = min_int(mine), max_int(mine if self.writer else -1)
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
            return self._parse(path, lambda name: get_file(files, name))
        except CheckpointDamaged as err:
            raise EnvironmentProblem(f"{path}: {err} on rank {self.rank}; its checksums matched") from None

    def _gather_files(self, path: Path, here: list[str] | None) -> dict[str, bytes]:
        """The bytes of the files this rank loads: from its node's disk, or broadcast by a node holding them."""
        table = all_gather_json({"node": self.node, "here": here})
        holders: dict[int, tuple[int, set]] = {}  # node -> (its writer's rank, the files it holds)
        for rank, entry in enumerate(table):
            if entry["here"] is not None:
                holders[entry["node"]] = (rank, set(entry["here"]))
        node_of = [entry["node"] for entry in table]
        listed = read_sums(path)
        common = {"trainer.json", "model.safetensors", "model.json", "optimizer.safetensors", "optimizer.json"}
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
                data = broadcast_bytes((path / name).read_bytes() if self.rank == src else b"", src)
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
        if not STEP_DIR.match(path.name):
            raise CheckpointDamaged(f"{path} is not a checkpoint directory (step-NNNNNNNN)")
        if not (path / COMMIT_MARKER).is_file():
            raise CheckpointDamaged(f"{path} has no {COMMIT_MARKER} marker (its write never finished)")
        return self._read(path, verify=True)
