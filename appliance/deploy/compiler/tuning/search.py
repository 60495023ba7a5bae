"""MetaSchedule tuning for `appliance compile --tune N [--tuning-db DIR]`: a reusable database.

Tune once (on this host, measuring candidates on its CPU), keep the records as a directory of
MetaSchedule JSON files plus `tuning.json` saying what made them, and apply them offline with
`relax.transform.MetaScheduleApplyDatabase` on every later compile of the same model and target.

Everything runs in this process: the popen-pool builder/runner would need psutil and re-import
TVM per worker (the 30 s `tvm.s_tir.tensor_intrin` import made every build time out), and
the random cost model needs no xgboost. apache-tvm-ffi 0.1.15.x segfaults in ToJSONGraph when
the JSON database saves a PrimFunc, hence the 0.1.14.post1 pin in the locks.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from appliance.core.errors import DataError, EnvironmentProblem
from appliance.assets.tuning_db import HEADER, RECORDS, WORKLOADS, cpu_of, installed_databases, read_header, same_kind
from appliance.deploy.compiler.runtime import cpu_tensor_intrinsics


def prepare_meta_schedule() -> None:
    """Make MetaSchedule usable in-process, fast, without psutil.

    TuneContext imports `tvm.s_tir.tensor_intrin`: only its CPU submodules are loaded
    (cpu_tensor_intrinsics). MetaSchedule
    asks psutil for the core count; the CPUs this process may run on are the right answer."""
    import tvm_ffi

    cpu_tensor_intrinsics()
    tvm_ffi.register_global_func("s_tir.meta_schedule.cpu_count",
                                 lambda logical=True: len(os.sched_getaffinity(0)), override=True)


def tuning_target(target: dict) -> dict:
    """MetaSchedule needs the core count in the target; the database records it too."""
    return {**target, "num-cores": len(os.sched_getaffinity(0))}


def _versions() -> dict:
    import tvm
    import tvm_ffi

    return {"tvm": tvm.__version__, "tvm_ffi": tvm_ffi.__version__}


def check_database(db_dir, model_sha256: str, target_name: str, tvm_target: dict) -> dict:
    """The header of an existing database, after checking it was made for this model, target
    and TVM, and that every record line parses; one line naming the file otherwise."""
    db_dir = Path(db_dir)
    header_path = db_dir / HEADER
    header = read_header(db_dir)
    if header.get("model_sha256") != model_sha256:
        raise DataError(f"{header_path}: tuned for another model (sha256 {str(header.get('model_sha256'))[:12]}..., "
                        f"this one is {model_sha256[:12]}...); tune this model with --tune N")
    if header.get("target") != target_name or not same_kind(header.get("tvm_target"), tvm_target):
        raise DataError(f"{header_path}: tuned for target {header.get('tvm_target')}, not {tvm_target}; "
                        "tune on a host of that kind with --tune N")
    if header.get("tvm") != _versions()["tvm"]:
        raise DataError(f"{header_path}: made with TVM {header.get('tvm')}, this is {_versions()['tvm']}; re-tune")
    for name in (WORKLOADS, RECORDS):
        path = db_dir / name
        try:
            lines = path.read_text().splitlines()
        except OSError as err:
            raise DataError(f"{path}: cannot read the tuning database ({err.strerror})") from None
        for number, line in enumerate(lines, 1):
            try:
                json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: line {number}: not a MetaSchedule JSON record ({err.msg})") from None
        if name == RECORDS and len(lines) != header.get("records"):
            raise DataError(f"{path}: has {len(lines)} records, {HEADER} says {header.get('records')} "
                            "(modified after tuning)")
    return header


def open_database(db_dir):
    from tvm.s_tir import meta_schedule as ms

    db_dir = Path(db_dir)
    try:
        return ms.database.JSONDatabase(str(db_dir / WORKLOADS), str(db_dir / RECORDS), allow_missing=False)
    except Exception as err:  # TVM raises its own error types; the user gets the file and the reason
        first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise DataError(f"{db_dir / RECORDS}: TVM cannot load the tuning database ({first})") from None


def apply_database(mod, tvm_target: dict, db_dir):
    """The Relax module with each tuned kernel replaced by its best measured schedule."""
    import tvm
    from tvm import relax

    prepare_meta_schedule()
    mod = relax.get_pipeline("zero")(mod)
    with tvm.target.Target(tvm_target), open_database(db_dir):
        return relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)


def apply_installed(mod, target_name: str, tvm_target: dict, log=print):
    """Apply every installed database (appliance.assets.tuning_db) made for this target and CPU with this TVM.

    Returns (mod, target, found, tuned): found has one entry per database seen, applied or not and
    why, and the tasks of this model it holds records for; tuned counts tasks with a record in any. The module and target are unchanged when
    nothing applies, so an untuned build stays exactly the default build."""
    found, usable = [], []
    for db_dir in installed_databases():
        entry = {"database": str(db_dir), "applied": False, "tuned_tasks": 0, "reason": None}
        try:
            header = read_header(db_dir)
        except DataError as err:
            entry["reason"] = str(err)
            found.append(entry)
            continue
        entry.update(target=header.get("target"), cpu=cpu_of(header.get("tvm_target")))
        wanted = f"{target_name} {cpu_of(tvm_target)}"
        if header.get("target") != target_name or not same_kind(header.get("tvm_target"), tvm_target):
            entry["reason"] = f"made for {entry['target']} {entry['cpu']}, this build is {wanted}"
        elif header.get("tvm") != _versions()["tvm"]:
            entry["reason"] = f"made with TVM {header.get('tvm')}, this is {_versions()['tvm']}"
        else:
            usable.append((entry, db_dir))
        found.append(entry)
    if not usable:
        for entry in found:
            log(f"tuning database {entry['database']}: not applied ({entry['reason']})")
        return mod, tvm_target, found, 0

    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    prepare_meta_schedule()
    target = tuning_target(tvm_target)
    tuned_mod = relax.get_pipeline("zero")(mod)
    tasks = tunable_tasks(ms.relax_integration.extract_tasks(tuned_mod, tvm.target.Target(target)))
    tuned = set()  # tasks with a record in any applied database
    for entry, db_dir in usable:
        database = open_database(db_dir)
        with tvm.target.Target(target) as t:
            hits = {i for i, task in enumerate(tasks)
                    if database.query_tuning_record(task.dispatched[0], t, task.task_name) is not None}
        entry["tuned_tasks"] = len(hits)
        tuned |= hits
        if entry["tuned_tasks"] == 0:
            entry["reason"] = "no records for this model's kernels"
            continue
        with tvm.target.Target(target), database:
            tuned_mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(tuned_mod)
        entry["applied"] = True
    for entry in found:
        if entry["applied"]:
            log(f"tuning database {entry['database']} ({entry['target']} {entry['cpu']}): "
                f"{entry['tuned_tasks']} of {len(tasks)} tasks tuned")
        else:
            log(f"tuning database {entry['database']}: not applied ({entry['reason']})")
    if not tuned:
        return mod, tvm_target, found, 0
    return tuned_mod, target, found, len(tuned)


def tunable_tasks(tasks) -> list:
    """The extracted tasks minus the kernels scheduled by hand (kernels/: every kernel of ours is
    `tirx.is_scheduled`), which MetaSchedule would otherwise search, and fail to (it cannot count
    the FLOPs of their vector intrinsic)."""
    def scheduled(task):
        return any(func.attrs is not None and bool(func.attrs.get("tirx.is_scheduled", False))
                   for func in task.dispatched[0].functions.values())

    return [task for task in tasks if not scheduled(task)]


def tune(mod, target_name: str, tvm_target: dict, db_dir, trials: int, model_sha256: str, *,
         log=print, seed: int = 0, rpc: str | None = None, rpc_key: str = "", cross_compiler: str | None = None) -> dict:
    """Tune every kernel of `mod` with `trials` measured candidates each; write the database to
    db_dir (built beside it, then renamed, so an interrupted run leaves no half database).

    rpc: HOST:PORT of a TVM RPC server that times the candidates (tuning/rpc.py) instead of this CPU;
    they are then built as shared libraries, with cross_compiler for an ARM device."""
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    # late: measure.py and rpc.py import TVM's MetaSchedule at their top: loaded only when tuning runs
    from appliance.deploy.compiler.tuning.measure import InProcessBuilder, InProcessRunner, progress_callback

    import tvm_ffi

    if tvm_ffi.__version__.startswith("0.1.15"):
        raise EnvironmentProblem(f"apache-tvm-ffi {tvm_ffi.__version__}: crashes in MetaSchedule tuning (ToJSONGraph); "
                                 "install 0.1.14.post1 as manifests/dev.lock pins it")
    prepare_meta_schedule()
    start = time.perf_counter()
    target = tvm.target.Target(tvm_target)
    db_dir = Path(db_dir)
    tmp = db_dir.with_name(f".{db_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mod = relax.get_pipeline("zero")(mod)
    tasks = tunable_tasks(ms.relax_integration.extract_tasks(mod, target))
    space = ms.space_generator.PostOrderApply(sch_rules="llvm", postprocs="llvm", mutator_probs="llvm")
    # Small populations: the random cost model cannot rank a large one, and it costs seconds.
    strategy = ms.search_strategy.EvolutionarySearch(population_size=max(64, 4 * trials),
                                                     init_min_unmeasured=min(50, 4 * trials), genetic_num_iters=2)
    logs = tmp / "logs"
    _quiet_meta_schedule_console()
    contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
        tasks, str(tmp), space=space, strategy=strategy, num_threads=len(os.sched_getaffinity(0)), seed=seed)
    if rpc:
        from appliance.deploy.compiler.tuning.rpc import RPCDeviceRunner  # late: TVM's RPC, only when --rpc asks

        runner = RPCDeviceRunner(rpc, rpc_key)
        builder = InProcessBuilder(tmp / "build", shared_library=True, cross_compiler=cross_compiler)
        where = f"the device at {rpc} over RPC ({tvm_target.get('num-cores')} cores, {cpu_of(tvm_target)})"
    else:
        runner, builder = InProcessRunner(), InProcessBuilder(tmp / "build")
        where = f"this CPU ({tvm_target.get('mcpu', '?')})"
    log(f"tuning {len(contexts)} tasks x {trials} trials on {where}")
    database = ms.database.JSONDatabase(str(tmp / WORKLOADS), str(tmp / RECORDS), allow_missing=True)
    callbacks = [*ms.MeasureCallback.create("default"),
                 progress_callback([c.task_name for c in contexts], trials, start, log)]
    ms.tune_tasks(tasks=contexts, task_weights=weights, work_dir=str(tmp), max_trials_global=trials * len(contexts),
                  max_trials_per_task=trials, num_trials_per_iter=min(trials, 32), builder=builder,
                  runner=runner, database=database, cost_model="random", measure_callbacks=callbacks,
                  task_scheduler="round-robin")
    kept = 0 if rpc and runner.lost else keep_untuned_where_faster(contexts, builder, runner, database, target, log)
    if rpc and runner.lost:
        shutil.rmtree(tmp, ignore_errors=True)
        raise runner.lost  # timings of a lost device would make a database of failures
    shutil.rmtree(logs, ignore_errors=True)
    shutil.rmtree(tmp / "build", ignore_errors=True)
    seconds = time.perf_counter() - start
    records = len((tmp / RECORDS).read_text().splitlines())
    header = {"made_by": "appliance compile --tune", "model_sha256": model_sha256, "target": target_name,
              "tvm_target": tvm_target, "trials_per_task": trials, "tasks": len(contexts), "records": records,
              "untuned_kept": kept,
              "tuning_seconds": round(seconds, 1), "search": "evolutionary, random cost model, "
              + (f"measured over RPC on {rpc}" if rpc else "in-process measuring"),
              "measured_on": {"rpc": rpc, "key": rpc_key, "candidates_timed": runner.measured} if rpc else "this host",
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **_versions()}
    (tmp / HEADER).write_text(json.dumps(header, indent=2) + "\n")
    if db_dir.exists():
        shutil.rmtree(db_dir)
    tmp.replace(db_dir)
    return header


def keep_untuned_where_faster(contexts, builder, runner, database, target, log) -> int:
    """Time each task's untuned kernel the way the candidates were timed and commit it as a record
    (untuned_trace): where no candidate beat it, the database's best record for that task
    is then the untuned kernel, and a tuned build is never slower than the untuned one kernel by
    kernel, as timed here (inside the whole model it still can be: benchmarks/README.md). With a
    handful of random-search trials a search often finds nothing better (measured: ResNet-18 int8
    tuned with 8 trials x2.25 of onnxruntime where untuned was x1.72). Returns how many tasks keep
    their untuned kernel."""
    from tvm.s_tir import meta_schedule as ms

    log(f"tuning: timing the {len(contexts)} untuned kernels, kept where no candidate was faster")
    kept = 0
    for context in contexts:
        mod = context.mod
        built = builder.build([ms.builder.BuilderInput(mod, target)])[0]
        if built.error_msg:
            continue
        args_info = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
        result = runner.run([ms.runner.RunnerInput(built.artifact_path, target.kind.name, args_info)])[0].result()
        shutil.rmtree(Path(built.artifact_path).parent, ignore_errors=True)
        if result.error_msg or not result.run_secs:
            continue
        untuned = _mean(result.run_secs)
        workload = database.commit_workload(mod)
        best = database.get_top_k(workload, 1)
        if not best or not best[0].run_secs or _mean(best[0].run_secs) > untuned:
            kept += 1
        database.commit_tuning_record(ms.database.TuningRecord(
            untuned_trace(mod), workload, result.run_secs, target, args_info))
    log(f"tuning: {kept} of {len(contexts)} tasks keep their untuned kernel (no candidate was faster)")
    return kept


def untuned_trace(mod):
    """A schedule trace that leaves the kernel as it is and that MetaSchedule takes as a record.

    An empty trace would be the obvious choice, but TVM's `TuningRecord::IsValid` drops records
    with no instruction, so the database never returned one and a slower candidate was applied
    instead (measured: MobileNetV2 FP32 tuned with 8 trials x1.41 of its untuned build, its
    pad/layout kernels 2-19x slower). One `get_sblock` of the root block changes nothing."""
    from tvm import s_tir

    schedule = s_tir.Schedule(mod)
    schedule.get_sblock("root")
    return schedule.trace


def _mean(run_secs) -> float:
    return sum(float(v) for v in run_secs) / len(run_secs)


def _quiet_meta_schedule_console() -> None:
    """MetaSchedule prints a task table per iteration; our progress lines replace it."""
    import logging

    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
