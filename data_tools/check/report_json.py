"""report.json: the machine-readable result of `appliance data check` (contract in docs/dev/contracts.md).

records_total = records_valid + records_quarantined = every record whose framing could be read;
bytes that held no readable record are listed in damaged_ranges.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections import Counter
from pathlib import Path

from appliance import __version__
from appliance.core.manifest import atomic_write_text

CLEAN_OUTPUT = ("clean/NAME holds the records of input NAME that passed every check, in their original "
                "order, uncompressed, with clean/NAME.index (one '<offset> <size>' line per record); "
                "train on clean/")


def build_report(*, results, names, schema, schema_source, labels, statistics, outliers, exact, near,
                 params, command) -> dict:
    checks: Counter = Counter()
    for r in results:
        checks.update(r.checks)
    valid = sum(len(r.clean_records) for r in results)
    quarantined = sum(len(r.quarantined_records) for r in results)
    total = valid + quarantined
    damaged = [{"file": r.path, **d} for r in results for d in r.damaged]

    def rid(file_index, number):
        return {"file": results[file_index].path, "record_number": number,
                "split": results[file_index].split}

    across = [g for g in near if len({results[f].split for f, _ in g} & {"train", "val"}) == 2]
    metrics = {
        "corrupt": len(damaged) + checks["parse"],
        "quarantined": quarantined,
        "quarantined_fraction": quarantined / total if total else 0.0,
        "imbalance": labels["imbalance"],
        "duplicates": checks["duplicate"],
        "near_duplicates": len(near),
        "leakage": checks["leakage"],
        "outliers": len({(o["file"], o["record_number"]) for o in outliers}),
        "unreadable_files": sum(1 for r in results if r.error),
    }
    return {
        "made_by": f"appliance data check {__version__}",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "params": params,
        "records_total": total,
        "records_valid": valid,
        "records_quarantined": quarantined,
        "damaged_ranges": damaged,
        "damaged_bytes": sum(d["end"] - d["start"] for d in damaged),
        "files": [{
            "path": r.path, "split": r.split, "compression": r.compression, "bytes": r.bytes,
            "error": r.error, "records": len(r.clean_records) + len(r.quarantined_records),
            "valid": len(r.clean_records), "quarantined": len(r.quarantined_records),
            "damaged_ranges": len(r.damaged), "checks": dict(sorted(r.checks.items())),
            "clean_shard": f"clean/{name}" if r.clean_records else None,
            "quarantine_shard": f"quarantine/{name}" if r.quarantined_records else None,
        } for r, name in zip(results, names)],
        "checks": dict(sorted(checks.items())),
        "labels": labels,
        "schema_source": schema_source,
        "schema": schema,
        "statistics": statistics,
        "outliers": outliers,
        "notes": [{"file": r.path, "record_number": n, "check": c, "detail": d}
                  for r in results for n, c, d in r.notes],
        "duplicates": {
            "exact_groups": [[rid(*m) for m in g] for g in exact],
            "near_groups": [[rid(*m) for m in g] for g in near],
            "near_groups_across_splits": len(across),
        },
        "clean_output": CLEAN_OUTPUT,
        "quarantine": {"reasons": "quarantine/reasons.jsonl",
                       "shards": [f"quarantine/{n}" for r, n in zip(results, names) if r.quarantined_records]},
        "metrics": metrics,
    }


def write_json(path: Path, report: dict) -> None:
    atomic_write_text(path, json.dumps(report, indent=1, default=_jsonable) + "\n")


def _jsonable(value):
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
