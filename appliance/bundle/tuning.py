"""`appliance bundle build --tuning-db DIR`: MetaSchedule tuning databases carried across the gap.

Each database made by `appliance compile --tune` goes into the bundle as tuning/<name>/ (the layout
and the lookup on the installed side are in appliance.assets.tuning_db), listed in bundle.json with the
target and CPU it was measured on, so a site sees what it carries before installing.
"""

from __future__ import annotations

from pathlib import Path

from appliance.core.errors import ConfigError, DataError
from appliance.core.manifest import sha256_file
from appliance.assets.tuning_db import FILES, RECORDS, cpu_of, database_name, read_header


def collect(db_dirs) -> tuple[list[dict], dict[str, Path]]:
    """(bundle.json entries, {arcname: file}) for the databases; one line naming the file that is wrong."""
    entries, files = [], {}
    for db_dir in map(Path, db_dirs):
        try:
            header = read_header(db_dir)
        except DataError as err:
            raise ConfigError(f"--tuning-db: {err}") from None
        for name in FILES:
            if not (db_dir / name).is_file():
                raise ConfigError(f"--tuning-db: {db_dir / name}: missing (a database holds {', '.join(FILES)})")
        records = len((db_dir / RECORDS).read_text().splitlines())
        if records != header.get("records"):
            raise ConfigError(f"--tuning-db: {db_dir / RECORDS}: has {records} records, tuning.json says "
                              f"{header.get('records')} (modified after tuning)")
        name = database_name(db_dir)
        if any(e["name"] == name for e in entries):
            continue  # the same database named twice
        where = f"tuning/{name}"
        entries.append({"name": name, "path": where, "target": header.get("target"),
                        "tvm_target": header.get("tvm_target"), "cpu": cpu_of(header.get("tvm_target")),
                        "tasks": header.get("tasks"), "records": records,
                        "trials_per_task": header.get("trials_per_task"), "tvm": header.get("tvm"),
                        "model_sha256": header.get("model_sha256"), "created": header.get("created"),
                        "files": [{"file": f"{where}/{f}", "sha256": sha256_file(db_dir / f)} for f in FILES]})
        files.update({f"{where}/{f}": db_dir / f for f in FILES})
    return entries, files
