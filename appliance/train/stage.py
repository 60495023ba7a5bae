"""Training as a pipeline stage: the pipeline's training sections and resolved data files in,
a TrainResult out, through the same typed launcher `appliance train` uses."""

from __future__ import annotations

import json
from pathlib import Path

from appliance.core.errors import ConfigError
from appliance.core.manifest import atomic_write_text
from appliance.train.launcher import LaunchSpec, launch_command, launch_training
from appliance.train.result import TrainResult

CONFIG_NAME = "config.toml"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table: [optimizer] lr_mult, [distributed] env
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise ConfigError(f"cannot write {value!r} into the training config")


def write_train_config(path: Path, sections: dict, source: str) -> None:
    """A training config TOML from sections (dicts of plain values); says what made it."""
    lines = [f"# Written by `appliance pipeline` from {source}; remade on every run."]
    for name, table in sections.items():
        lines.append(f"\n[{name}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in table.items())
    atomic_write_text(path, "\n".join(lines) + "\n")


def train_sections(training: dict, run_dir: Path, train_files, val_files, check_report: Path | None,
                   source: str | Path = ".") -> dict:
    """The pipeline's training sections as `appliance train` reads them, for the files given."""
    sections = json.loads(json.dumps(training))  # a deep copy
    init = sections.get("model", {}).get("init", "")
    if isinstance(init, str) and init and not init.startswith("torchvision:") and not Path(init).is_absolute():
        # The config is written into run_dir: a relative init is the pipeline config's, resolved here.
        sections["model"]["init"] = str((Path(source).resolve().parent / init).resolve())
    sections.setdefault("data", {})
    sections["data"]["train"] = [str(p) for p in train_files]
    sections["data"]["val"] = [str(p) for p in val_files]
    if check_report is not None:
        sections["data"]["check_report"] = str(check_report)
    sections.setdefault("run", {})
    sections["run"]["out_dir"], sections["run"]["name"] = str(run_dir.parent), run_dir.name
    return sections


def stage_config(training: dict, source: Path, run_dir: Path, *, train_files, val_files,
                 check_report: Path | None) -> Path:
    """The pipeline's training sections written as run_dir/config.toml, the config `train_stage` reads."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / CONFIG_NAME
    write_train_config(config, train_sections(training, run_dir, train_files, val_files, check_report, source), str(source))
    return config


def train_stage(config: Path, **launch) -> TrainResult:
    """`appliance train` and the pipeline's train stage: train as config says (resuming its newest good
    checkpoint) and return the run's result. launch: the other fields of LaunchSpec (nproc_per_node,
    nnodes, max_restarts, resume, ...). Raises ApplianceError with one line. The quality gate is the
    gate's (appliance.train.quality)."""
    return launch_training(LaunchSpec(config=Path(config), **launch))


def train_command_line(config: Path, **launch) -> str:
    """`appliance train --dry-run`: the command train_stage would run, after the same checks."""
    return launch_command(LaunchSpec(config=Path(config), **launch))
