"""The [tune] section: what `appliance tune` searches, for what, and how long, validated into a TuneSpec.

    [tune]
    objective = "val_acc"          # the task's validation metric (default) or "val_loss"
    trials = 20                    # budget: trials finished (complete, pruned or failed)
    max_minutes = 0                # budget: wall time of one `appliance tune` run; 0 = none
    sampler = "tpe"                # or "random"; seeded by `seed`
    pruner = "median"              # or "successive-halving", "none"
    [tune.space]
    "optimizer.lr" = { low = 1e-4, high = 0.3, log = true }
    "train.batch_size" = { choices = [16, 32, 64] }

A space's key is any plain key of the training config ("section.key"); its kind (float, integer,
true/false, text) is that key's. Every bound and choice is checked against the training config's
own rules before a trial runs, so a bad space is one line naming its key, not a failed trial.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path

from appliance.core.errors import ConfigError
from appliance.core.values import shown
from appliance.tasks import task_for
from appliance.train.config import Config, config_from_dict

SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "successive-halving", "none")
MAX_TRIALS = 100_000
KEYS = ("objective", "trials", "max_minutes", "sampler", "pruner", "seed", "startup_trials", "prune_startup_trials",
        "space")
DEFAULTS = {"trials": 20, "seed": 0, "startup_trials": 5, "prune_startup_trials": 2}
# Keys that say where a run reads and writes, not how it trains.
NOT_SEARCHABLE = {"run": ("name", "out_dir"), "data": ("train", "val", "check_report")}


@dataclass(frozen=True)
class Param:
    key: str  # "optimizer.lr"
    kind: str  # "float", "int" or "choice"
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: int | float | None = None
    choices: tuple = ()

    def describe(self) -> str:
        if self.kind == "choice":
            return f"one of {', '.join(map(str, self.choices))}"
        return f"{self.kind} in [{self.low}, {self.high}]{' (log)' if self.log else ''}"


@dataclass(frozen=True)
class TuneSpec:
    params: tuple[Param, ...]
    objective: str
    direction: str  # "maximize" or "minimize"
    trials: int = 20
    max_minutes: float = 0.0
    sampler: str = "tpe"
    pruner: str = "median"
    seed: int = 0
    startup_trials: int = 5  # trials sampled at random before TPE models the others
    prune_startup_trials: int = 2  # complete trials before the median pruner stops any

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _field_types() -> dict[str, dict[str, type]]:
    """section -> key -> the key's type (Annotated stripped), from the training config's dataclasses."""
    out = {}
    for name, cls in typing.get_type_hints(Config).items():
        if dataclasses.is_dataclass(cls):
            out[name] = {k: (typing.get_args(t)[0] if typing.get_origin(t) is typing.Annotated else t)
                         for k, t in typing.get_type_hints(cls, include_extras=True).items()}
    return out


def _number(raw: dict, name: str, where: str, kind: type):
    value = raw[name]
    ok = isinstance(value, int) and not isinstance(value, bool) if kind is int else \
        isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(f"{where} {name} must be {'an integer' if kind is int else 'a finite number'}, got {shown(value)}")
    return value


def parse_param(key: str, raw, types: dict, where: str) -> Param:
    """One [tune.space] entry; ConfigError naming it when it is not a searchable key or an empty space."""
    section, _, name = key.partition(".")
    if section not in types or name not in types[section]:
        known = ", ".join(f"{section}.{k}" for k in types[section]) if section in types else ", ".join(types)
        raise ConfigError(f"{where}: unknown key of the training config (known {'keys' if section in types else 'sections'}: {known})")
    kind = types[section][name]
    if name in NOT_SEARCHABLE.get(section, ()) or kind not in (int, float, bool, str):
        raise ConfigError(f"{where}: not searchable (only single numbers, true/false and text; not paths or lists)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table: {{ low = ..., high = ..., log = true }} or {{ choices = [...] }}, got {shown(raw)}")
    unknown = set(raw) - {"low", "high", "log", "step", "choices"}
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: low, high, log, step, choices)")
    if "choices" in raw:
        if set(raw) - {"choices"}:
            raise ConfigError(f"{where}: choices cannot be combined with {sorted(set(raw) - {'choices'})[0]}")
        choices = raw["choices"]
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where} choices: an empty space (needs a non-empty list), got {shown(choices)}")
        if len({json.dumps(c, sort_keys=True) for c in choices}) != len(choices):
            raise ConfigError(f"{where} choices: a value is listed twice ({shown(choices)})")
        return Param(key, "choice", choices=tuple(choices))
    if kind not in (int, float):
        raise ConfigError(f"{where}: {key} is {'true/false' if kind is bool else 'text'}: give choices = [...]")
    for bound in ("low", "high"):
        if bound not in raw:
            raise ConfigError(f"{where}: missing {bound} (a range needs low and high, or give choices = [...])")
    low, high = _number(raw, "low", where, kind), _number(raw, "high", where, kind)
    log = raw.get("log", False)
    if not isinstance(log, bool):
        raise ConfigError(f"{where} log must be true or false, got {shown(log)}")
    if not low < high:
        raise ConfigError(f"{where}: an empty range (low {low} must be below high {high})")
    if log and low <= 0:
        raise ConfigError(f"{where}: a log range must not reach zero or below (low {low}; use a positive low or log = false)")
    step = None
    if "step" in raw:
        step = _number(raw, "step", where, kind)
        if log or not 0 < step <= high - low:
            raise ConfigError(f"{where} step must be positive, at most high - low, and not with log = true, got {shown(step)}")
    return Param(key, "int" if kind is int else "float", low=kind(low), high=kind(high), log=log, step=step)


def _check_values(param: Param, training: dict, source: Path, where: str) -> None:
    """Each bound or choice goes through the training config's own checks (its ranges, its known
    architectures, ...): a space the config would refuse is refused now, naming the tune key."""
    values = param.choices if param.kind == "choice" else (param.low, param.high)
    for value in values:
        try:
            config_from_dict(with_values(training, {param.key: value}), source)
        except ConfigError as err:
            reason = str(err).removeprefix(f"{source}: ")
            raise ConfigError(f"{where}: the value {shown(value)} is refused by the training config: {reason}") from None


def with_values(training: dict, values: dict) -> dict:
    """A deep copy of the training sections with "section.key" = value set."""
    out = json.loads(json.dumps(training))
    for key, value in values.items():
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = value
    return out


def parse_tune(raw, training: dict, source: Path) -> TuneSpec:
    """The [tune] table of `source` against its training sections; one ConfigError line per problem."""
    src = str(source)
    if not isinstance(raw, dict):
        raise ConfigError(f"{src}: [tune] must be a table, got {shown(raw)}")
    for key in raw:
        if key not in KEYS:
            raise ConfigError(f"{src}: [tune] unknown key {key!r} (known keys: {', '.join(KEYS)})")
    task = task_for(training.get("task"))
    objective = raw.get("objective", task.val_metric)
    allowed = (task.val_metric, "val_loss")
    if objective not in allowed:
        raise ConfigError(f"{src}: [tune] objective must be {' or '.join(allowed)} for a {task.kind} task, got {shown(objective)}")
    ints = {"trials": (1, MAX_TRIALS), "seed": (0, 2**32 - 1), "startup_trials": (0, MAX_TRIALS),
            "prune_startup_trials": (0, MAX_TRIALS)}
    for key, (low, high) in ints.items():
        value = raw.get(key, DEFAULTS[key])
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            what = "a budget of at least 1 trial" if key == "trials" else f"an integer in [{low}, {high}]"
            raise ConfigError(f"{src}: [tune] {key} must be {what}, got {shown(value)}")
    minutes = raw.get("max_minutes", 0)
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not (math.isfinite(minutes) and minutes >= 0):
        raise ConfigError(f"{src}: [tune] max_minutes must be a number of minutes, 0 for no limit, got {shown(minutes)}")
    for key, options in (("sampler", SAMPLERS), ("pruner", PRUNERS)):
        if raw.get(key, options[0]) not in options:
            raise ConfigError(f"{src}: [tune] {key} must be {', '.join(options)}, got {shown(raw[key])}")
    space = raw.get("space", {})
    if not isinstance(space, dict) or not space:
        raise ConfigError(f"{src}: [tune.space] is missing or empty: name at least one key to search, "
                          'e.g. "optimizer.lr" = { low = 1e-4, high = 0.1, log = true }')
    if not training.get("data", {}).get("val"):
        raise ConfigError(f"{src}: [data] val is required: each trial is judged on the validation set")
    # Checked as the trials' configs will be: each trial's run is named by the tuner (a pipeline config may
    # leave [run] name out: its train stage names the run too).
    training = with_values(training, {"run.name": training.get("run", {}).get("name", "trial")})
    config_from_dict(training, source)  # the training config's own mistakes are its own, not a tune key's
    types = _field_types()
    params = []
    for key, value in space.items():
        param = parse_param(key, value, types, f"{src}: [tune.space] {key}")
        _check_values(param, training, source, f"{src}: [tune.space] {key}")
        params.append(param)
    return TuneSpec(params=tuple(params), objective=objective,
                    direction="minimize" if objective.endswith("loss") else "maximize",
                    max_minutes=float(minutes), sampler=raw.get("sampler", "tpe"), pruner=raw.get("pruner", "median"),
                    **{key: raw.get(key, default) for key, default in DEFAULTS.items()})
