"""What the launcher checks before any process starts (and `train --dry-run` checks too): every
refusal a worker would make of the config is made here, in the launcher's one process, in one line.

The data-check gate; every data file opened and frame-checked (its index built, which the workers
reuse); the first record's keys; the model built as a worker builds it, with [model] init, reset
and frozen_prefixes applied (ddp.prepare_model) and [optimizer] lr_mult matched against its
parameters (optimizer.param_groups); and the run directory a directory we can write.
"""

from __future__ import annotations

import argparse

from appliance.core.errors import ConfigError, DataError
from appliance.core.values import output_dir, shown
from appliance.train.config import check_data_report
from appliance.train.ddp import prepare_model
from appliance.train.optimizer import param_groups
from data_tools.example import decode_example
from data_tools.index import build_index, read_index_file
from data_tools.tfrecord import read_records


def check_before_start(cfg) -> None:
    """Everything that can be checked before a process starts (see the module's docstring)."""
    check_run_dir(cfg)
    check_data_report(cfg)
    for key, files in (("train", cfg.data.train), ("val", cfg.data.val)):
        for path in files:
            damage = []
            records = len(read_index_file(build_index(path, on_damage=damage.append)))
            if records == 0:
                why = f"{damage[0].reason} at byte {damage[0].start}" if damage else "no record"
                raise DataError(f"{path}: not a TFRecord file ({why}); listed in {cfg.source} [data] {key}")
    if cfg.task.kind == "classification" and cfg.data.train:  # a key no record has: refused before, not by every worker
        first = next(iter(read_records(cfg.data.train[0])), None)
        try:
            features = decode_example(first) if first is not None else {}
        except DataError:  # a damaged record: the worker that reads it names it
            features = {}
        for key in ("image_key", "label_key"):
            if features and getattr(cfg.data, key) not in features:
                raise ConfigError(f"{cfg.source}: [data] {key} {shown(getattr(cfg.data, key))} is no feature of the first "
                                  f"record of {cfg.data.train[0]} (it has {', '.join(map(repr, sorted(features)))})")
    # The model as every worker builds it: weights of another architecture, an unconvertible ONNX
    # operator, a reset or frozen prefix or lr_mult pattern that names no parameter: one line, no process.
    model, _ = prepare_model(cfg, log=lambda line: None)
    param_groups(cfg, model)


def check_run_dir(cfg) -> None:
    """[run] out_dir / name must be (or become) a directory we can write: a file in its place was
    refused by every worker after start-up."""
    try:
        output_dir(str(cfg.run_dir))
    except argparse.ArgumentTypeError as err:
        raise ConfigError(f"{cfg.source}: [run] out_dir and name make the run directory {cfg.run_dir}: {err}") from None
    for parent in cfg.run_dir.parents:
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"{cfg.source}: [run] out_dir and name make the run directory {cfg.run_dir}: "
                              f"{parent} is a file, not a directory")
