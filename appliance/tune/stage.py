"""`appliance tune` and the pipeline's tune stage: an Optuna study whose every trial is a real training run.

OUT/study.journal is the study (Optuna's journal file storage: an append-only file, no database
server); OUT/trials/NNNN/ is trial NNNN's run directory. Starting again on the same OUT continues the
study: a trial left running by a killed tuner resumes from its newest checkpoint (exactly, as
`appliance train` resumes), keeping its number, so no trial is counted twice. The budget counts
trials that finished: complete, pruned or failed. Every trial trains with the config's [run] seed.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import TrialState

from appliance.core.dirlock import directory_lock
from appliance.core.errors import ApplianceError, ConfigError
from appliance.core.manifest import atomic_write_text, write_manifest
from appliance.core.progress import quiet
from appliance.core.stage import read_result_json
from appliance.train.launcher import Interrupted, gpu_count
from appliance.train.stage import train_sections
from appliance.tune.report import REPORT_HTML, REPORT_JSON, write_report
from appliance.tune.space import TuneSpec, parse_tune, with_values
from appliance.tune.trials import GATE_FAILED, TrialRun

JOURNAL_NAME = "study.journal"
BEST_CONFIG = "best.toml"
STUDY_NAME = "tune"
POLL_S = 0.5
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


@dataclass(frozen=True)
class TuneResult:
    out_dir: Path
    report_json: Path
    report_html: Path
    best_config: Path | None
    best_params: dict
    best_value: float | None
    objective: str
    counts: dict  # state -> trials

    def tuned(self, training: dict) -> dict:
        """The training sections with the best trial's values set."""
        return with_values(training, self.best_params)

    def figures(self) -> dict:
        return {f"best_{self.objective}": self.best_value, "best_params": self.best_params,
                **{f"trials_{state}": n for state, n in self.counts.items()}}

    @classmethod
    def load(cls, out_dir: Path) -> "TuneResult":
        out_dir = Path(out_dir)
        report = read_result_json(out_dir / REPORT_JSON)
        best = report.get("best") or {}
        return cls(out_dir=out_dir, report_json=out_dir / REPORT_JSON, report_html=out_dir / REPORT_HTML,
                   best_config=out_dir / BEST_CONFIG if best else None, best_params=best.get("params", {}),
                   best_value=best.get("value"), objective=report["objective"], counts=report["counts"])


def toml_text(sections: dict, header: str) -> str:
    """Training sections as TOML (plain values, lists and inline tables are all training configs hold)."""
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(str(k))} = {value(x)}" for k, x in v.items()) + "}"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v) if isinstance(v, (int, float)) else json.dumps(v)

    lines = [f"# {line}" for line in header.splitlines()]
    for name, table in sections.items():
        lines += ["", f"[{name}]", *(f"{k} = {value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


def trial_slots(parallel: int, nproc_per_node: str) -> list[tuple[dict, str]]:
    """(environment, --nproc-per-node) per trial slot: a share of the GPUs each, or of the CPU cores."""
    gpus = gpu_count()
    if not gpus:
        if parallel == 1:
            return [({}, nproc_per_node)]
        nproc = 1 if nproc_per_node == "auto" else int(nproc_per_node)
        threads = max(1, (os.cpu_count() or 1) // parallel // nproc)
        return [({"OMP_NUM_THREADS": str(threads)}, str(nproc))] * parallel
    if parallel > gpus:
        raise ConfigError(f"--parallel {parallel} needs a GPU per trial at least; this machine has {gpus}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if os.environ.get("CUDA_VISIBLE_DEVICES") else \
        [str(i) for i in range(gpus)]
    share = gpus // parallel
    return [({"CUDA_VISIBLE_DEVICES": ",".join(visible[i * share:(i + 1) * share])},
             str(share) if nproc_per_node == "auto" else nproc_per_node) for i in range(parallel)]


def sampler_for(spec: TuneSpec, trial_number: int) -> optuna.samplers.BaseSampler:
    """The sampler that picks trial_number's values, seeded by [tune] seed and the trial's number: with the
    same finished trials before it, a trial gets the same values whether or not the study was restarted."""
    seed = (spec.seed + 1_000_003 * trial_number) % 2**32
    return (optuna.samplers.TPESampler(seed=seed, n_startup_trials=spec.startup_trials)
            if spec.sampler == "tpe" else optuna.samplers.RandomSampler(seed=seed))


def open_study(out_dir: Path, spec: TuneSpec) -> optuna.Study:
    sampler = sampler_for(spec, 0)
    pruner = {"median": lambda: optuna.pruners.MedianPruner(n_startup_trials=spec.prune_startup_trials),
              "successive-halving": lambda: optuna.pruners.SuccessiveHalvingPruner(min_resource=1),
              "none": lambda: optuna.pruners.NopPruner()}[spec.pruner]()
    storage = JournalStorage(JournalFileBackend(str(out_dir / JOURNAL_NAME)))
    study = optuna.create_study(storage=storage, study_name=STUDY_NAME, sampler=sampler, pruner=pruner,
                                direction=spec.direction, load_if_exists=True)
    saved = study.user_attrs.get("spec")
    if saved is None:
        study.set_user_attr("spec", spec.to_dict())
    elif json.dumps(saved, sort_keys=True) != json.dumps(json.loads(json.dumps(spec.to_dict())), sort_keys=True):
        raise ConfigError(f"{out_dir}: holds a study of another [tune] section; give another --out or remove it")
    return study


class Tuner:
    """The study loop: start trials into free slots, report each epoch, prune, record the outcome."""

    def __init__(self, study, spec: TuneSpec, out_dir: Path, training: dict, source: Path, files: dict, slots):
        self.study, self.spec, self.out_dir, self.training, self.source = study, spec, out_dir, training, source
        self.files, self.slots = files, slots
        self.free = list(range(len(slots)))
        self.running: list[TrialRun] = []
        self.stop_signal = ""

    def say(self, line: str) -> None:
        if not quiet():
            print(f"tune: {line}", file=sys.stderr, flush=True)

    def start(self, trial: optuna.trial.Trial, resumed=None) -> None:
        """Start trial's run; resumed: its FrozenTrial when it was left running by a killed tuner."""
        values = {}
        for p in self.spec.params:
            if p.kind == "choice":
                values[p.key] = trial.suggest_categorical(p.key, list(p.choices))
            elif p.kind == "int":
                values[p.key] = trial.suggest_int(p.key, p.low, p.high, step=p.step or 1, log=p.log)
            else:
                values[p.key] = trial.suggest_float(p.key, p.low, p.high, step=p.step, log=p.log)
        run_dir = self.out_dir / "trials" / f"{trial.number:04d}"
        run_dir.mkdir(parents=True, exist_ok=True)
        sections = train_sections(with_values(self.training, values), run_dir, self.files["train"], self.files["val"],
                                  self.files["check_report"], self.source)
        seed = sections.get("run", {}).get("seed", 0)
        atomic_write_text(run_dir / "config.toml", toml_text(sections, f"Written by `appliance tune` from {self.source}: "
                                                             f"trial {trial.number}."))
        trial.set_user_attr("seed", seed)
        trial.set_user_attr("run_dir", str(run_dir))
        slot = self.free.pop(0)
        env, nproc = self.slots[slot]
        run = TrialRun(trial, run_dir, self.spec.objective, env, nproc, slot=slot)
        if resumed is not None:
            run.reported.update(resumed.intermediate_values)
            run.earlier_seconds = float(resumed.user_attrs.get("seconds", 0.0))
            trial.set_user_attr("resumed", int(resumed.user_attrs.get("resumed", 0)) + 1)
        run.start()
        trial.set_user_attr("launched_at", time.time())
        self.running.append(run)
        shown = ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in values.items())
        self.say(f"trial {trial.number} {'resumed from its newest checkpoint' if resumed is not None else 'started'}: {shown} "
                 f"(seed {seed}, {run_dir})")

    def poll(self, run: TrialRun) -> bool:
        """Report new epochs, prune; True once the run's process has exited and its outcome is recorded."""
        for epoch, value in run.new_values():
            if math.isfinite(value):
                run.trial.report(value, epoch)
            if not run.pruned and self.spec.pruner != "none" and run.trial.should_prune():
                run.pruned = True
                self.say(f"trial {run.trial.number} pruned after epoch {epoch} ({self.spec.objective} {value:.4g})")
                run.stop()
        if not run.finished():
            return False
        if self.stop_signal and not run.pruned and run.proc.returncode not in (0, GATE_FAILED):
            return True  # stopped with the tuner: it stays running in the study and resumes next time
        run.trial.set_user_attr("seconds", run.earlier_seconds + run.seconds)
        run.trial.set_user_attr("exited_at", time.time())
        if run.pruned:
            self.study.tell(run.trial, state=TrialState.PRUNED)
            return True
        value, reason = run.outcome()
        if value is None:
            run.trial.set_user_attr("fail_reason", reason)
            self.study.tell(run.trial, state=TrialState.FAIL)
            self.say(f"trial {run.trial.number} failed: {reason}")
        else:
            self.study.tell(run.trial, value)
            self.say(f"trial {run.trial.number} complete: {self.spec.objective} {value:.4g} in {run.seconds:.1f} s")
        return True

    def on_signal(self, signum, frame) -> None:
        self.stop_signal = self.stop_signal or signal.Signals(signum).name
        for run in self.running:
            run.stop()

    def run(self) -> None:
        deadline = time.monotonic() + self.spec.max_minutes * 60 if self.spec.max_minutes else math.inf
        # Trials a killed tuner left running: resumed first, as slots free up, and counted in the budget.
        left = list(self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))
        while True:
            while left and self.free and not self.stop_signal and time.monotonic() < deadline:
                frozen = left.pop(0)
                self.study.sampler = sampler_for(self.spec, frozen.number)  # for values it had not drawn yet
                self.start(optuna.trial.Trial(self.study, frozen._trial_id), resumed=frozen)
            done = len(self.study.get_trials(deepcopy=False, states=FINISHED))
            while (self.free and not left and not self.stop_signal and time.monotonic() < deadline
                   and done + len(self.running) < self.spec.trials):
                self.study.sampler = sampler_for(self.spec, len(self.study.get_trials(deepcopy=False)))
                self.start(self.study.ask())
            if not self.running:
                return
            if time.monotonic() >= deadline and not self.stop_signal:
                self.say(f"[tune] max_minutes {self.spec.max_minutes:g} reached: stopping; the running trials resume "
                         "from their checkpoints next time")
                self.on_signal(signal.SIGTERM, None)
                self.stop_signal = "max_minutes"
            for run in list(self.running):
                if self.poll(run):
                    self.running.remove(run)
                    self.free.append(run.slot)
            time.sleep(POLL_S)


def tune_stage(training: dict, source: Path, tune: dict, out_dir: Path, *, train_files, val_files,
               check_report: Path | None = None, nproc_per_node: str = "auto", parallel: int = 1) -> TuneResult:
    """Search training's hyperparameters as [tune] says, into out_dir; returns the study's result.
    Raises ConfigError naming the [tune] key for a bad section, ApplianceError when no trial completed."""
    source, out_dir = Path(source).resolve(), Path(out_dir).resolve()
    spec = parse_tune(tune, training, source)
    if parallel < 1:
        raise ConfigError(f"--parallel must be at least 1, got {parallel}")
    slots = trial_slots(parallel, nproc_per_node)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    files = {"train": list(map(str, train_files)), "val": list(map(str, val_files)), "check_report": check_report}
    with directory_lock(out_dir, "tune directory"):
        study = open_study(out_dir, spec)
        tuner = Tuner(study, spec, out_dir, training, source, files, slots)
        previous = {s: signal.signal(s, tuner.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            tuner.run()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        report = write_report(study, spec, out_dir, source, nproc=slots[0][1], parallel=parallel)
        best = report["best"]
        outputs = [out_dir / REPORT_JSON, out_dir / REPORT_HTML, out_dir / JOURNAL_NAME]
        if best:
            run = training.get("run", {})
            tuned_dir = _run_out_dir(run, source) / f"{run.get('name', 'run')}-tuned"
            sections = train_sections(with_values(training, best["params"]), tuned_dir, files["train"], files["val"],
                                      check_report, source)
            atomic_write_text(out_dir / BEST_CONFIG, toml_text(sections, (
                f"Written by `appliance tune` from {source}: trial {best['number']}'s values "
                f"({spec.objective} {best['value']:.6g}, seed {best['seed']}).\nReproduce it: appliance train "
                f"{out_dir / BEST_CONFIG} --nproc-per-node {slots[0][1]}")))
            outputs.append(out_dir / BEST_CONFIG)
        write_manifest(out_dir, "tune", [*files["train"], *files["val"]],
                       {"tune": spec.to_dict(), "parallel": parallel, "nproc_per_node": nproc_per_node}, outputs)
    if tuner.stop_signal and tuner.stop_signal != "max_minutes":
        raise Interrupted(f"stopped by {tuner.stop_signal}; run the same command to continue the study "
                          f"(the running trials resume from their checkpoints)",
                          exit_code=128 + getattr(signal, tuner.stop_signal))
    if not best and tuner.stop_signal == "max_minutes":
        raise ApplianceError(f"[tune] max_minutes {spec.max_minutes:g} ran out before a trial completed; "
                             f"{report['counts']['running']} trial(s) stopped at their checkpoints: run the same "
                             "command to continue the study")
    if not best:
        raise ApplianceError(f"no trial completed ({report['counts']}); the reasons are in {out_dir / REPORT_HTML}")
    return TuneResult.load(out_dir)


def _run_out_dir(run: dict, source: Path) -> Path:
    """[run] out_dir of the tuned config, as the source config meant it (relative to its file)."""
    out = run.get("out_dir", "runs")
    return Path(out) if Path(out).is_absolute() else (source.parent / out).resolve()
