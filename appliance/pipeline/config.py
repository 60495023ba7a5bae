"""The pipeline config: a training config plus one section per later stage.

A PIPELINE.toml holds the training sections exactly as `appliance train` reads them
([run], [data], [model], [optimizer], [schedule], [train], [checkpoint], [augment]) and the sections
below for the other stages. The pipeline writes the training sections out as the train
stage's config, with the data files replaced by the check stage's clean shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from appliance.core.errors import ConfigError
from appliance.core.tomlconfig import parse_section, read_toml
from appliance.core.values import (EPOCHS_AT_LEAST_ONE, FRACTION, PATH, QAT_LR_SCALE, SAMPLES, SAMPLES_OR_ALL,
                                   SMALL_COUNT, TOLERANCE, Range, nproc_problem, shown)
from appliance.deploy.compiler.options import RUNTIMES
from appliance.deploy.compiler.targets import TARGETS
from appliance.deploy import openvino_route
from appliance.deploy.options import ENGINES, METHODS, OPSETS
from data_tools.check.gate import parse_fail_on
from appliance.train.config import config_from_dict
from appliance.tune.space import parse_tune

STAGES = ("check", "tune", "train", "gate", "export", "quantize", "compile", "package", "verify")  # in the order they run
TRAIN_SECTIONS = ("run", "data", "model", "optimizer", "schedule", "train", "checkpoint", "augment", "distributed",
                  "profile", "task")


@dataclass(frozen=True)
class PipelineSection:
    out: Annotated[str, PATH] = "pipeline-out"  # each stage writes OUT/<stage>/; relative to the config file
    nproc_per_node: str = "auto"
    max_restarts: Annotated[int, SMALL_COUNT] = 3  # elastic restarts of training after a crash
    tune: bool = False  # search [tune]'s hyperparameters (appliance tune) before train; train uses the best


@dataclass(frozen=True)
class CheckSection:
    enabled: bool = True
    fail_on: str = "corrupt>0,quarantined_fraction>0.05"


@dataclass(frozen=True)
class ExportSection:
    opset: Annotated[int, OPSETS] = 17
    max_rel_error: Annotated[float, TOLERANCE] = 1e-5


@dataclass(frozen=True)
class QuantizeSection:
    mode: str = "int8"  # "int8" | "fp16" | "none"
    method: str = "minmax"
    per_channel: bool = True
    calib_samples: Annotated[int, SAMPLES] = 256
    max_drop: Annotated[float, Range(ge=0, le=100)] = 1.0  # top-1 points
    fallback: str = "auto"  # "auto": other calibrations, then sensitive layers in float; "none": stop at once
    engine: str = "ours"  # "ours" | "nncf": NNCF's PTQ and accuracy control ship, ours measured beside it
    max_float_layers: Annotated[int, SMALL_COUNT] = 10
    qat: bool = False  # INT8 still over max_drop after fallback: quantization-aware fine-tuning (appliance.pipeline.qat)
    qat_epochs: Annotated[int, EPOCHS_AT_LEAST_ONE] = 2
    qat_lr_scale: Annotated[float, QAT_LR_SCALE] = 0.1  # QAT lr = the training lr times this


@dataclass(frozen=True)
class CompileSection:
    targets: tuple[str, ...] = ("x86_64", "aarch64")
    device_estimate: bool = True  # aarch64 builds: estimated Cortex-A76/A55 cycles in compile.json (edge/cycles.py)
    runtime: str = "auto"  # what the edge package runs: auto (the faster of TVM and onnxruntime), tvm, onnxruntime


@dataclass(frozen=True)
class PackageSection:
    target: str = "aarch64"  # or "x86_64-openvino" (a server package of the [compile] target "openvino")


@dataclass(frozen=True)
class VerifySection:
    samples: Annotated[int, SAMPLES_OR_ALL] = 0  # 0: every validation sample
    min_agreement: Annotated[float, FRACTION] = 0.995


@dataclass(frozen=True)
class DeploySection:
    latency_budget_ms: Annotated[float, Range(ge=0, le=3_600_000)] = 0.0  # 0: none; else the estimate must meet it before training
    latency_core: str = "cortex-a76"  # the core the budget is for (cortex-a76 at 2.4 GHz, cortex-a55 at 1.8 GHz)


@dataclass(frozen=True)
class PipelineConfig:
    source: Path
    training: dict  # the training sections, as read (validated by appliance.train.config at load)
    train_files: tuple[Path, ...] = ()  # [data] train, resolved against the config's directory
    val_files: tuple[Path, ...] = ()
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    check: CheckSection = field(default_factory=CheckSection)
    export: ExportSection = field(default_factory=ExportSection)
    quantize: QuantizeSection = field(default_factory=QuantizeSection)
    compile: CompileSection = field(default_factory=CompileSection)
    package: PackageSection = field(default_factory=PackageSection)
    verify: VerifySection = field(default_factory=VerifySection)
    deploy: DeploySection = field(default_factory=DeploySection)
    tune: dict = field(default_factory=dict)  # the [tune] section, as read (checked by appliance.tune.space at load)

    @property
    def out_dir(self) -> Path:
        return (self.source.parent / self.pipeline.out).resolve()


_STAGE_SECTIONS = {"pipeline": PipelineSection, "check": CheckSection, "export": ExportSection,
                   "quantize": QuantizeSection, "compile": CompileSection, "package": PackageSection,
                   "verify": VerifySection, "deploy": DeploySection}


def load_pipeline_config(path: str | Path) -> PipelineConfig:
    source = Path(path).resolve()
    raw = read_toml(path, "pipeline config")
    unknown = set(raw) - set(TRAIN_SECTIONS) - set(_STAGE_SECTIONS) - {"tune"}
    if unknown:
        raise ConfigError(f"{path}: unknown section [{sorted(unknown)[0]}] (known: "
                          f"{', '.join(TRAIN_SECTIONS + tuple(_STAGE_SECTIONS))}, tune)")
    for name in _STAGE_SECTIONS:
        if not isinstance(raw.get(name, {}), dict):
            raise ConfigError(f"{path}: [{name}] must be a table")
    sections = {name: parse_section(cls, raw.get(name, {}), str(source), name)
                for name, cls in _STAGE_SECTIONS.items()}
    q = sections["quantize"]
    if q.mode not in ("int8", "fp16", "none"):
        raise ConfigError(f"{path}: [quantize] mode must be int8, fp16 or none, got {q.mode!r}")
    if q.method not in METHODS:  # else refused by the quantize stage, after training
        raise ConfigError(f"{path}: [quantize] method must be {', '.join(METHODS)}, got {shown(q.method)}")
    if nproc_problem(sections["pipeline"].nproc_per_node):  # else refused by the train stage, after the check
        raise ConfigError(f"{path}: [pipeline] nproc_per_node {nproc_problem(sections['pipeline'].nproc_per_node)}")
    if q.engine not in ENGINES:
        raise ConfigError(f"{path}: [quantize] engine must be {' or '.join(ENGINES)}, got {shown(q.engine)}")
    if q.fallback not in ("auto", "none"):
        raise ConfigError(f"{path}: [quantize] fallback must be auto or none, got {q.fallback!r}")
    for target in sections["compile"].targets:
        if target not in TARGETS and target != openvino_route.COMPILE_TARGET:
            raise ConfigError(f"{path}: [compile] unknown target {target!r} "
                              f"({', '.join([*TARGETS, openvino_route.COMPILE_TARGET])})")
    if sections["compile"].runtime not in RUNTIMES:
        raise ConfigError(f"{path}: [compile] runtime must be one of {', '.join(RUNTIMES)}, got "
                          f"{sections['compile'].runtime!r}")
    if sections["package"].target not in ("aarch64", openvino_route.PACKAGE_TARGET):
        raise ConfigError(f"{path}: [package] target must be aarch64 or {openvino_route.PACKAGE_TARGET}, "
                          f"got {shown(sections['package'].target)}")
    if openvino_route.compile_target_of(sections["package"].target) not in sections["compile"].targets:
        raise ConfigError(f"{path}: [package] target {sections['package'].target!r} is not among "
                          f"[compile] targets {list(sections['compile'].targets)}")
    if sections["deploy"].latency_core not in ("cortex-a76", "cortex-a55"):
        raise ConfigError(f"{path}: [deploy] latency_core must be cortex-a76 or cortex-a55, "
                          f"got {sections['deploy'].latency_core!r}")
    out = (source.parent / sections["pipeline"].out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{path}: [pipeline] out: {out} exists and is not a directory")
    training = {name: raw[name] for name in TRAIN_SECTIONS if name in raw}
    if not isinstance(training.get("data", {}), dict) or "train" not in training.get("data", {}):
        raise ConfigError(f"{path}: [data] train = [...] is required (the TFRecord files to train on)")
    if not training["data"].get("val"):
        raise ConfigError(f"{path}: [data] val = [...] is required: every later stage is measured on it")

    parse_fail_on(sections["check"].fail_on, where=f"{source}: [check] fail_on")
    train_cfg = validate_training(training, source)
    if sections["pipeline"].tune:
        if "tune" not in raw:
            raise ConfigError(f"{path}: [pipeline] tune = true needs a [tune] section (what to search)")
        parse_tune(raw["tune"], training, source)  # a bad [tune] fails now, not after the data check
    return PipelineConfig(source=source, training=training, train_files=tuple(map(Path, train_cfg.data.train)),
                          val_files=tuple(map(Path, train_cfg.data.val)), tune=raw.get("tune", {}), **sections)


def validate_training(training: dict, source: Path):
    """The training sections checked as `appliance train` will check them (every key and number,
    the data files resolved), now, so that a typo fails before the data check spends an hour.
    The run's name and directory are the pipeline's."""
    sections = {name: dict(table) if isinstance(table, dict) else table for name, table in training.items()}
    run = sections.setdefault("run", {})
    if isinstance(run, dict):
        run.update(name="train", out_dir=".")  # the train stage runs in OUT/train, whatever [run] says
    return config_from_dict(sections, source)
