"""Exact duplicates (same encoded bytes) and near duplicates (perceptual hashes within a distance).

Records are named by a record id, any sortable key such as (file position, record number);
"first" means smallest id, so the result does not depend on which worker finished first.
Near duplicates are found with banded hashing: split the 64-bit hash into max_distance + 1
pieces; two hashes within max_distance bits share at least one piece exactly (pigeonhole), so
only records sharing a piece are compared, instead of every pair.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Hashable, Iterable

import numpy as np


def exact_groups(items: Iterable[tuple[Hashable, bytes]]) -> list[list]:
    """Groups (sorted ids, two or more) of records whose content hash is equal."""
    by_hash: dict[bytes, list] = defaultdict(list)
    for rid, digest in items:
        by_hash[digest].append(rid)
    return sorted(sorted(ids) for ids in by_hash.values() if len(ids) > 1)


def near_groups(items: Iterable[tuple[Hashable, int, bytes]], max_distance: int = 4) -> list[list]:
    """Groups of records whose perceptual hashes are within max_distance bits, with 2+ distinct contents.

    items: (record id, 64-bit perceptual hash, content hash). Exact copies are one member here
    (their smallest id); they are already reported as exact duplicates.
    """
    if not 0 <= max_distance <= 7:
        raise ValueError("max_distance must be 0..7 bits")
    representative: dict[bytes, tuple] = {}
    for rid, phash, digest in items:
        if digest not in representative or rid < representative[digest][0]:
            representative[digest] = (rid, phash)
    reps = sorted(representative.values())
    # max_distance + 1 bands: as wide as possible, so buckets stay small (13 bits for distance 4).
    bands = max_distance + 1
    cuts = [round(64 * b / bands) for b in range(bands + 1)]
    buckets: dict[tuple[int, int], list[int]] = defaultdict(list)
    for pos, (_, phash) in enumerate(reps):
        for band in range(bands):
            width = cuts[band + 1] - cuts[band]
            buckets[(band, (phash >> cuts[band]) & ((1 << width) - 1))].append(pos)

    parent = list(range(len(reps)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    hashes = np.array([phash for _, phash in reps], dtype=np.uint64)
    for members in buckets.values():
        if len(members) < 2:
            continue
        members = np.array(members)
        # Pairwise distances of one bucket, a block of rows at a time (bounded memory).
        for start in range(0, len(members), 512):
            rows = members[start:start + 512]
            distance = np.bitwise_count(hashes[rows][:, None] ^ hashes[members][None, :])
            for i, j in zip(*np.nonzero(distance <= max_distance)):
                a, b = int(rows[i]), int(members[j])
                if a < b:
                    parent[find(a)] = find(b)
    groups: dict[int, list] = defaultdict(list)
    for pos, (rid, _) in enumerate(reps):
        groups[find(pos)].append(rid)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def copies_to_quarantine(groups: list[list], split_of) -> list[tuple]:
    """(record id, check, detail, kept id) for every copy that is not the first of its group.

    A copy in the validation split of an image that is also in the training split is
    'leakage' (the model would be scored on data it trained on); any other later copy is a
    'duplicate'. One copy per split is kept, the first in record-id order.
    """
    rejected = []
    for ids in groups:
        train_ids = [r for r in ids if split_of(r) == "train"]
        first_in_split: dict = {}
        for rid in ids:
            split = split_of(rid)
            if split == "val" and train_ids:
                rejected.append((rid, "leakage", train_ids[0]))
            elif split in first_in_split:
                rejected.append((rid, "duplicate", first_in_split[split]))
            else:
                first_in_split[split] = rid
    return rejected
