"""Where MetaSchedule tuning databases live on an installed appliance (contract between compile, bundle and installer).

A tuning database is a directory made by `appliance compile --tune`: `tuning.json` (what made it: target,
TVM target with its CPU, tasks, records, TVM version), `database_workload.json` and
`database_tuning_record.json` (MetaSchedule's JSON database). A bundle built with
`appliance bundle build --tuning-db DIR ...` carries each one as `tuning/<name>/` (name from
`database_name`), hashed in SHA256SUMS and listed in bundle.json under `tuning_databases`. The installer
puts `tuning/` next to the release's venv (PREFIX/releases/REL/tuning). `appliance compile` looks in
$APPLIANCE_TUNING_DIR first, then in tuning/ next to the running venv, and applies the records of every
database made for its target and CPU (MetaSchedule matches them to kernels by workload hash).
"""

import hashlib
import json
from pathlib import Path

from appliance import beside_venv
from appliance.core.errors import DataError

TUNING_ENV = "APPLIANCE_TUNING_DIR"
HEADER = "tuning.json"
WORKLOADS, RECORDS = "database_workload.json", "database_tuning_record.json"
FILES = (HEADER, WORKLOADS, RECORDS)
MADE_BY = "appliance compile --tune"


def read_header(db_dir) -> dict:
    """tuning.json of a database, checked to be ours; one line naming the file otherwise."""
    path = Path(db_dir) / HEADER
    try:
        header = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: not found; {db_dir} is not a tuning database made by `{MADE_BY}`") from None
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: not a tuning database header ({err})") from None
    if not isinstance(header, dict) or header.get("made_by") != MADE_BY:
        raise DataError(f"{path}: not a tuning database header made by `{MADE_BY}`")
    return header


def cpu_of(tvm_target) -> str:
    """The CPU a TVM target is for, in words: its mcpu, else its attributes, else 'generic'."""
    if not isinstance(tvm_target, dict):
        return "?"
    return tvm_target.get("mcpu") or ",".join(tvm_target.get("mattr", [])) or "generic"


def same_kind(a, b) -> bool:
    """Two TVM targets whose schedules are interchangeable: equal but for the core count, which shapes
    the search and not whether its schedules run."""
    def kind(t):
        return {k: v for k, v in t.items() if k != "num-cores"} if isinstance(t, dict) else t

    return kind(a) == kind(b)


def database_name(db_dir) -> str:
    """The folder name a database gets in a bundle: target, CPU and the start of its records' sha256."""
    header = read_header(db_dir)
    digest = hashlib.sha256((Path(db_dir) / RECORDS).read_bytes()).hexdigest()[:12]
    cpu = "".join(c if c.isalnum() or c in "-_." else "_" for c in cpu_of(header.get("tvm_target")))
    return f"{header.get('target', 'unknown')}-{cpu}-{digest}"


def tuning_dirs() -> list[Path]:
    """The directories searched, in order: $APPLIANCE_TUNING_DIR, then tuning/ next to the running venv."""
    return beside_venv("tuning", TUNING_ENV)


def installed_databases() -> list[Path]:
    """Every database in the searched directories: a directory holding tuning.json, or its sub-directories that do."""
    found = []
    for directory in tuning_dirs():
        if (directory / HEADER).is_file():
            found.append(directory)
        elif directory.is_dir():
            found += sorted(d for d in directory.iterdir() if (d / HEADER).is_file())
    return list(dict.fromkeys(found))
