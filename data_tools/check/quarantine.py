"""The quarantine: rejected records' bytes (TFRecord shards) and why (reasons.jsonl).

Per-record problems are quarantined while scanning. Duplicates and leakage are only known once
every file is scanned, so those records are moved afterwards from the clean shard to the
quarantine shard: both shards are rewritten through the writer's temp-file-and-rename, so an
interruption leaves the old pair intact.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path

from appliance.core.manifest import atomic_write_text
from data_tools.tfrecord import TFRecordWriter, read_records

REASONS_HEADER = {"made_by": "appliance data check",
                  "fields": "file, offset, record_number, check, detail, quarantine_shard, quarantine_position; "
                            "check=framing lines are byte ranges [offset, end) that held no readable record"}


def move_to_quarantine(result, out_dir: Path, shard_name: str, move: set[int]) -> list[bytes]:
    """Move records (by original record number) of one file from its clean shard to its quarantine shard.

    Updates result.clean_records / quarantined_records in place; returns the moved bytes.
    """
    clean_path = out_dir / "clean" / shard_name
    quarantine_path = out_dir / "quarantine" / shard_name
    kept, moved, kept_numbers, moved_numbers = [], [], [], []
    for number, data in zip(result.clean_records, read_records(clean_path, strict=True)):
        if number in move:
            moved.append(bytes(data))
            moved_numbers.append(number)
        else:
            kept.append(bytes(data))
            kept_numbers.append(number)
    old_quarantine = list(read_records(quarantine_path, strict=True)) if result.quarantined_records else []
    with TFRecordWriter(quarantine_path) as writer:
        for data in [*old_quarantine, *moved]:
            writer.write(bytes(data))
    if kept:
        with TFRecordWriter(clean_path) as writer:
            for data in kept:
                writer.write(data)
    else:
        clean_path.unlink()
    result.clean_records = array("q", kept_numbers)
    result.quarantined_records.extend(moved_numbers)
    return moved


def write_reasons(path: Path, results, shard_names) -> int:
    """reasons.jsonl: a header line, then one line per (record, check) and per damaged range."""
    lines = [json.dumps(REASONS_HEADER)]
    for result, shard in zip(results, shard_names):
        position = {n: i for i, n in enumerate(result.quarantined_records)}
        for reason in sorted(result.reasons, key=lambda r: r["record_number"]):
            number = reason["record_number"]
            lines.append(json.dumps({
                "file": result.path, "offset": result.offset(number), "record_number": number,
                "check": reason["check"], "detail": reason["detail"],
                "quarantine_shard": f"quarantine/{shard}", "quarantine_position": position[number]}))
        for damage in result.damaged:
            lines.append(json.dumps({
                "file": result.path, "offset": damage["start"], "end": damage["end"],
                "record_number": None, "next_record_number": damage["record_number"],
                "check": "framing", "detail": damage["reason"]}))
    atomic_write_text(path, "\n".join(lines) + "\n")
    return len(lines) - 1
