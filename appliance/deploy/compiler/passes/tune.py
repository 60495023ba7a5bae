"""Tuning: the MetaSchedule schedules of a tuning database applied to TVM's generic kernels.

`--tune N` tunes now (this CPU, or the device behind `--rpc`) into a database and applies it;
`--tuning-db DIR` reuses one; otherwise the installed databases made for this target and CPU
(appliance.assets.tuning_db) are applied where they hold records of this model's kernels. Our
own kernels are scheduled already and never tuned (tuning/search.py: `tunable_tasks`).
"""

from __future__ import annotations

from pathlib import Path

from appliance.core.errors import DataError
from appliance.core.manifest import sha256_file
from appliance.deploy.compiler.targets import CROSS_COMPILER
from appliance.deploy.compiler.tuning import search


def run(mod, build):
    """The pass: (mod, {"tuned_tasks", "tuning": summary or None, "installed": [...]}); the
    build's TVM target may gain the core count the schedules were made for."""
    options = build.options
    if options["tune_trials"] or options["tuning_db"]:
        mod, build.tvm_target, tuning = _tuned(mod, build)
        return mod, {"tuned_tasks": tuning["tasks"], "tuning": tuning, "installed": []}
    if options["installed_tuning"]:
        mod, build.tvm_target, installed, tuned = search.apply_installed(mod, build.target_name, build.tvm_target,
                                                                         build.log)
        return mod, {"tuned_tasks": tuned, "tuning": None, "installed": installed}
    return mod, {"tuned_tasks": 0, "tuning": None, "installed": []}


def _tuned(mod, build):
    """Apply the tuning database (made now by tuning, or reused as it is): (mod, target, summary)."""
    options, target, target_name = build.options, build.tvm_target, build.target_name
    trials, rpc, log = options["tune_trials"], options["rpc"], build.log
    db_dir = Path(options["tuning_db"]) if options["tuning_db"] else build.out_dir / "tuning"
    model_sha = sha256_file(build.model_path)
    reused = (db_dir / search.HEADER).exists() or not trials
    if reused:
        target = search.tuning_target(target)
        header = search.check_database(db_dir, model_sha, target_name, target)
    elif rpc:
        # late: rpc.py imports TVM's RPC and MetaSchedule at its top; only when --rpc asks
        from appliance.deploy.compiler.tuning.rpc import connect, remote_cores

        target = {**target, "num-cores": remote_cores(connect(rpc, options["rpc_key"]))}  # the device's, not this host's
        header = search.tune(mod, target_name, target, db_dir, trials, model_sha, log=log, rpc=rpc,
                             rpc_key=options["rpc_key"],
                             cross_compiler=CROSS_COMPILER if target_name.startswith("aarch64") else None)
    elif target_name != "x86_64":
        raise DataError(f"{build.model_path}: --tune measures candidates on this CPU, so it tunes the x86_64 target "
                        f"only; tune {target_name} on the device with --rpc HOST:PORT, or pass its database with "
                        "--tuning-db")
    else:
        target = search.tuning_target(target)
        header = search.tune(mod, target_name, target, db_dir, trials, model_sha, log=log)
    mod = search.apply_database(mod, target, db_dir)
    return mod, target, {"database": str(db_dir), "reused": reused, "trials_per_task": header["trials_per_task"],
                         "tasks": header["tasks"], "records": header["records"],
                         "tuned_in_seconds": header["tuning_seconds"], "tvm_ffi": header["tvm_ffi"],
                         "measured_on": header.get("measured_on", "this host")}
