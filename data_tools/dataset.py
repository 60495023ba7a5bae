"""PyTorch access to TFRecord files: a map-style Dataset over many files, and the sampler that shards it.

`TFRecordDataset` maps a global sample number to (file, record) through each file's index, reads
the record with both CRCs checked, and decodes the features a spec asks for. Memory maps open
lazily, so the dataset pickles cheaply into DataLoader worker processes.

`ShardedSampler` gives every DDP rank a disjoint slice of one permutation of the whole dataset,
seeded by (seed, epoch). The DataLoader's main process iterates the sampler and hands each index to
exactly one worker, so across ranks and workers every record is read once per epoch, none twice.
Its `position` (samples of this rank's slice the training loop has consumed) is the resumable
state: a loop that calls `advance(n)` after each batch and saves `state_dict()` with its
checkpoint resumes on the exact next sample after `load_state_dict()`.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from appliance.core.errors import ConfigError, DataError
from data_tools.example import decode_example
from data_tools.image_decode import ImageProblem, decode_image as bounded_decode
from data_tools.index import RecordFile, load_index

# Feature kinds a spec may ask for: a single value, or a whole list ("[]").
# "raw": the feature exactly as decode_example gives it, None when absent (the caller judges it).
KINDS = ("bytes", "str", "int", "float", "image", "bytes[]", "str[]", "int64[]", "float32[]", "raw")
CLASSIFICATION_FEATURES = {"image/encoded": "image", "image/class/label": "int"}


def decode_image(encoded: bytes, mode: str | None = None):
    """JPEG/PNG bytes -> a loaded PIL image (converted to mode, e.g. "RGB" or "L", when given), through
    the bounded decoder (data_tools.image_decode); its ImageProblem is a ValueError of the feature here."""
    try:
        return bounded_decode(encoded, mode)
    except ImageProblem as err:
        raise ValueError(f"{err.check}: {err.detail}") from None


def _one(values, kind):
    if len(values) != 1:
        raise ValueError(f"expected one {kind} value, found {len(values)}")
    return values[0]


def _convert(value, kind: str, image_mode: str | None):
    """One decoded feature (list[bytes] or numpy array) -> the kind the spec asked for."""
    is_bytes = isinstance(value, list)
    want_bytes = kind in ("bytes", "str", "image", "bytes[]", "str[]")
    if len(value) and is_bytes != want_bytes:
        found = "bytes" if is_bytes else f"{value.dtype} numbers"
        raise ValueError(f"expected {kind}, found {found}")
    if kind == "bytes":
        return _one(value, kind)
    if kind == "str":
        return _one(value, kind).decode()
    if kind == "image":
        return decode_image(_one(value, kind), image_mode)
    if kind == "int":
        return int(_one(value, kind))
    if kind == "float":
        return float(_one(value, kind))
    if kind == "bytes[]":
        return list(value)
    if kind == "str[]":
        return [v.decode() for v in value]
    if kind == "int64[]":
        return np.asarray(value, dtype=np.int64)
    return np.asarray(value, dtype=np.float32)


class TFRecordDataset(Dataset):
    """Map-style dataset over many plain TFRecord files, decoded by a feature spec.

    features: {key: kind} with kinds from KINDS, or None for every feature as decode_example gives.
    image_key/label_key: when both are set the sample is (image, label); transform applies to the
    image. Otherwise the sample is the decoded dict, and transform (if any) applies to the dict.
    """

    def __init__(
        self,
        files: Sequence[str | os.PathLike],
        features: Mapping[str, str] | None = None,
        image_key: str | None = None,
        label_key: str | None = None,
        transform: Callable[[Any], Any] | None = None,
        image_mode: str | None = None,
        cache_dir: str | os.PathLike | None = None,
    ):
        if not files:
            raise ConfigError("TFRecordDataset: no files given")
        for key, kind in (features or {}).items():
            if kind not in KINDS:
                raise ConfigError(f"feature {key!r}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
        self.files = [str(f) for f in files]
        if features is None and (image_key or label_key):
            features = {}  # decode just the image and label
        self.features = dict(features) if features is not None else None
        if image_key:
            self.features.setdefault(image_key, "image")
        if label_key:
            self.features.setdefault(label_key, "int")
        self.image_key, self.label_key = image_key, label_key
        self.transform = transform
        self.image_mode = image_mode
        self._records = [RecordFile(f, load_index(f, cache_dir)) for f in self.files]
        sizes = np.array([len(r) for r in self._records], dtype=np.int64)
        self._ends = np.cumsum(sizes)  # sample i lives in the first file whose end exceeds i
        self._keys = set(self.features) if self.features is not None else None

    @classmethod
    def for_classification(cls, files, transform=None, image_mode: str | None = "RGB", **kw) -> "TFRecordDataset":
        """(image, label) samples from the TF-slim/TFDS keys image/encoded and image/class/label."""
        return cls(files, features=dict(CLASSIFICATION_FEATURES), image_key="image/encoded",
                   label_key="image/class/label", transform=transform, image_mode=image_mode, **kw)

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def locate(self, index: int) -> tuple[str, int]:
        """(file, record number in that file) of global sample `index`."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range (dataset has {len(self)})")
        f = int(np.searchsorted(self._ends, index, side="right"))
        return self.files[f], index - (int(self._ends[f - 1]) if f else 0)

    def record(self, index: int) -> bytes:
        """The verified raw bytes of sample `index`."""
        self.locate(index)  # range check with a clear message
        return self._record(index)

    def _record(self, index: int) -> bytes:
        f = int(np.searchsorted(self._ends, index, side="right"))
        return self._records[f][index - (int(self._ends[f - 1]) if f else 0)]

    def __getitem__(self, index: int):
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range (dataset has {len(self)})")
        data = self._record(index)
        try:
            decoded = decode_example(data, self._keys)
            if self.features is None:
                sample = decoded
            else:
                sample = {}
                for key, kind in self.features.items():
                    if kind == "raw":
                        sample[key] = decoded.get(key)
                        continue
                    if key not in decoded:
                        raise ValueError(f"feature {key!r} is missing")
                    try:
                        sample[key] = _convert(decoded[key], kind, self.image_mode)
                    except Exception as err:
                        raise ValueError(f"feature {key!r}: {err}") from None
        except (ValueError, DataError) as err:
            file, number = self.locate(index)
            raise DataError(f"{file}: record {number}: {err}") from None
        if self.image_key and self.label_key:
            image = sample[self.image_key]
            return (self.transform(image) if self.transform else image), sample[self.label_key]
        return self.transform(sample) if self.transform else sample


class ShardedSampler(Sampler[int]):
    """This rank's share of a (seed, epoch)-seeded permutation, from a resumable position.

    Rank r of W takes permutation[r::W]: the shares are disjoint and together cover the dataset.
    With drop_last=False (the default) every sample is used each epoch and shares differ in
    length by at most one; drop_last=True trims the permutation to a multiple of W first, so all
    ranks run the same number of steps (the trimmed samples change every epoch).

    len() is the full share of an epoch; iteration starts at `position`, so a resumed epoch yields
    len() - position indices. The training loop calls advance(n) for samples it has consumed.
    """

    def __init__(
        self,
        dataset_size: int | Dataset,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ):
        if not isinstance(dataset_size, int):
            dataset_size = len(dataset_size)
        if rank is None or world_size is None:
            ready = torch.distributed.is_available() and torch.distributed.is_initialized()
            rank = (torch.distributed.get_rank() if ready else 0) if rank is None else rank
            world_size = (torch.distributed.get_world_size() if ready else 1) if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise ConfigError(f"sampler: rank {rank} is not in 0..{world_size - 1}")
        self.dataset_size, self.rank, self.world_size = int(dataset_size), rank, world_size
        self.seed, self.shuffle, self.drop_last = int(seed), shuffle, drop_last
        self.epoch = 0
        self.position = 0

    def epoch_order(self, epoch: int | None = None) -> np.ndarray:
        """The global order of all samples in an epoch (the same on every rank)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return np.arange(self.dataset_size, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)

    def share(self, epoch: int | None = None) -> np.ndarray:
        """This rank's indices for a whole epoch, in order."""
        order = self.epoch_order(epoch)
        if self.drop_last:
            order = order[: len(order) // self.world_size * self.world_size]
        return order[self.rank:: self.world_size]

    def __len__(self) -> int:
        usable = self.dataset_size // self.world_size * self.world_size if self.drop_last else self.dataset_size
        return len(range(self.rank, usable, self.world_size))

    def __iter__(self):
        return iter(self.share()[self.position:].tolist())

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning, unless it is the epoch a resumed state is already in."""
        if epoch != self.epoch:
            self.epoch, self.position = int(epoch), 0

    def seek(self, epoch: int, position: int) -> None:
        """Start iterating `epoch` at sample `position` of this rank's share (e.g. batches done x batch size)."""
        if not 0 <= position <= len(self):
            raise ConfigError(f"sampler: position {position} is outside this rank's {len(self)} samples")
        self.epoch, self.position = int(epoch), int(position)

    def advance(self, samples: int) -> None:
        """Record that the training loop consumed `samples` more samples of this rank's share."""
        self.position = min(self.position + int(samples), len(self))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "world_size": self.world_size, "rank": self.rank, "dataset_size": self.dataset_size,
                "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved position; the data, seed and number of processes must be the same."""
        for key in ("seed", "world_size", "dataset_size", "shuffle", "drop_last"):
            if state.get(key) != getattr(self, key):
                raise ConfigError(
                    f"sampler state was saved with {key}={state.get(key)!r}, now {getattr(self, key)!r}: "
                    "an exact resume needs the same data, seed and number of processes"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
