"""The training config: one TOML file, validated into frozen dataclasses.

Every section and key is listed here with its type and default; an unknown or mistyped key is
a ConfigError naming the file, the section and the key. Relative paths are resolved against
the config file's directory, so a config travels with its data.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from appliance.core.errors import ConfigError
from appliance.core.inputs import describe
from appliance.core.tomlconfig import parse_section, read_toml
from appliance.tasks import TASK_KINDS, task_for
from appliance.core.values import (EPOCHS, FRACTION, LEARNING_RATE, MAX_SCALE, PATH, SCALE, SEED, SMALL_COUNT,
                                   SMALL_COUNT_AT_LEAST_ONE, STEPS, STEPS_AT_LEAST_ONE, TOLERANCE, WEIGHT_DECAY, Range)
from appliance.train.quality import GATE_KEYS, check_thresholds
from data_tools.image_decode import DEFAULT_MAX_PIXELS, MAX_PIXELS_LIMIT
from data_tools.labels import MAX_CLASSES
from data_tools.check.gate import require_passing_report

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
COMPILE_MODES = ("auto", "on", "off", "cuda-graphs")  # [train] compile: torch.compile of the model (appliance/train/ddp.py)
DECODES = ("auto", "cpu", "gpu")  # [data] decode (appliance/train/device_decode.py)
OPTIMIZERS = ("sgd", "adamw")
DEFAULT_BUCKET_CAP_MB = 25.0  # torch.nn.parallel.DistributedDataParallel's
MONITORED = ("val_loss", "val_acc")  # what an evaluation records, so what [checkpoint] monitor may name
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Upper bounds: far above any real run, low enough that a typo cannot ask for terabytes.
MAX_IMAGE_SIZE = 4096  # pixels per side of the model's input
MAX_BATCH, MAX_WORKERS = 65536, 256  # per process; loader processes
MAX_FREE_GB = 1_000_000.0  # 1 PB


@dataclass(frozen=True)
class RunSection:
    name: Annotated[str, PATH]
    out_dir: Annotated[str, PATH] = "runs"
    seed: Annotated[int, SEED] = 0
    deterministic: bool = True
    log_every: Annotated[int, STEPS_AT_LEAST_ONE] = 10


@dataclass(frozen=True)
class DataSection:
    train: tuple[Annotated[str, PATH], ...]
    val: tuple[Annotated[str, PATH], ...] = ()
    classes: tuple[str, ...] = ()
    num_classes: Annotated[int, Range(ge=0, le=MAX_CLASSES)] = 0  # taken from `classes` when 0
    image_key: str = "image/encoded"
    label_key: str = "image/class/label"
    image_size: Annotated[int, Range(ge=1, le=MAX_IMAGE_SIZE)] = 224
    channels: Annotated[int, Range(ge=1, le=3)] = 3  # 1 or 3 (checked below)
    mean: tuple[Annotated[float, Range(ge=-MAX_SCALE, le=MAX_SCALE)], ...] = (0.485, 0.456, 0.406)
    std: tuple[Annotated[float, SCALE], ...] = (0.229, 0.224, 0.225)
    num_workers: Annotated[int, Range(ge=0, le=MAX_WORKERS)] = 2
    decode: str = "auto"  # where JPEGs are decoded and augmented: "cpu" (workers), "gpu" (device_decode.py), "auto"
    max_pixels: Annotated[int, Range(ge=1, le=MAX_PIXELS_LIMIT)] = DEFAULT_MAX_PIXELS  # as data check --max-pixels
    check_report: Annotated[str, PATH] = ""  # a data-check report.json whose gate must have passed


@dataclass(frozen=True)
class ModelSection:
    architecture: str = "small_cnn"  # "onnx": the graph of an init = "x.onnx", converted to torch
    init: Annotated[str, PATH] = ""  # where the starting weights come from (appliance/train/init_weights.py); "": random
    reset: tuple[str, ...] = ()  # prefixes re-initialised instead of loaded from init (e.g. ["fc"])
    frozen_prefixes: tuple[str, ...] = ()
    linear_probe: bool = False  # train the classifier head only (every other parameter frozen)
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class OptimizerSection:
    name: str = "adamw"
    lr: Annotated[float, LEARNING_RATE] = 1e-3
    weight_decay: Annotated[float, WEIGHT_DECAY] = 0.0
    momentum: Annotated[float, Range(ge=0, lt=1)] = 0.9  # sgd only
    betas: tuple[Annotated[float, Range(ge=0, lt=1)], ...] = (0.9, 0.999)  # adamw only
    zero_redundancy: bool = False
    no_decay_norm_and_bias: bool = True  # no weight decay on biases and norm weights (1-D parameters)
    lr_mult: dict[str, Annotated[float, SCALE]] = field(default_factory=dict)  # {prefix = multiplier of lr}


@dataclass(frozen=True)
class ScheduleSection:
    warmup_steps: Annotated[int, STEPS] = 0
    min_lr_ratio: Annotated[float, FRACTION] = 0.0  # the cosine ends at lr * min_lr_ratio


@dataclass(frozen=True)
class TrainSection:
    epochs: Annotated[int, EPOCHS] = 1
    max_steps: Annotated[int, STEPS] = 0  # 0: epochs decide
    batch_size: Annotated[int, Range(ge=1, le=MAX_BATCH)] = 32  # per process
    grad_accum: Annotated[int, Range(ge=1, le=MAX_BATCH)] = 1
    precision: str = "auto"
    grad_clip: Annotated[float, TOLERANCE] = 0.0  # 0 disables clipping
    compile: str = "auto"  # torch.compile the model: "on", "off", "cuda-graphs", "auto" (off so far: see ddp.use_compile)
    # The quality gate on the trained model (appliance/train/quality.py); they judge, not train.
    # (ranges checked by quality.check_thresholds, which names them as the gate's)
    min_val_acc: float = 0.0
    min_class_recall: float = 0.0
    baseline_margin: float = 0.1  # fraction of the gap from the majority baseline to 100 % to close
    max_predicted_share: float = 0.95  # one class predicted this often is a collapsed model


@dataclass(frozen=True)
class TaskSection:
    """What the model learns (appliance/tasks/): one class per image, one per pixel, or boxes and their classes."""

    kind: str = "classification"  # or "segmentation", "detection"
    ignore_label: Annotated[int, Range(ge=0, le=255)] = 255  # segmentation: mask pixels that count for nothing
    class_weights: tuple[Annotated[float, SCALE], ...] = ()  # segmentation: per-class loss weights
    score_threshold: Annotated[float, Range(ge=0, le=1)] = 0.05  # detection: boxes scoring at most this are dropped
    iou_threshold: Annotated[float, Range(ge=0, le=1)] = 0.5  # detection: NMS drops a box overlapping a kept one more
    max_detections: Annotated[int, Range(ge=1, le=10000)] = 100  # detection: boxes kept per image


@dataclass(frozen=True)
class CheckpointSection:
    every_steps: Annotated[int, STEPS_AT_LEAST_ONE] = 500
    keep_last: Annotated[int, SMALL_COUNT_AT_LEAST_ONE] = 3
    keep_best: Annotated[int, SMALL_COUNT] = 1
    monitor: str = "val_loss"
    mode: str = "min"
    min_free_gb: Annotated[float, Range(ge=0, le=MAX_FREE_GB)] = 1.0


@dataclass(frozen=True)
class AugmentSection:
    """Seeded training augmentation (data_tools.augment.TrainTransform); evaluation never augments."""

    enabled: bool = False
    degrees: Annotated[float, Range(ge=0, le=180)] = 15.0  # rotation, uniform in +/- degrees
    hue: Annotated[float, Range(ge=0, le=0.5)] = 0.1  # fraction of the colour circle: 0.1 = +/- 36 degrees
    saturation: Annotated[float, Range(ge=0, lt=1)] = 0.1  # HSV S multiplied by a factor in [1 - s, 1 + s]
    value: Annotated[float, Range(ge=0, lt=1)] = 0.1  # HSV V multiplied by a factor in [1 - v, 1 + v]
    crop_scale: tuple[Annotated[float, Range(gt=0, le=1)], ...] = (0.08, 1.0)  # RandomResizedCrop area fraction
    flip_probability: Annotated[float, FRACTION] = 0.5  # horizontal flip
    debug: bool = False  # log every sample's applied parameters


@dataclass(frozen=True)
class DistributedSection:
    iface: str = ""  # network interface for torchrun, NCCL and Gloo (e.g. "eth1"); --iface overrides
    env: dict[str, str] = field(default_factory=dict)  # NCCL_IB_DISABLE, NCCL_DEBUG, ... for every process
    # DDP's gradient buckets (appliance/train/ddp.py): MiB per all-reduce; at 25, DDP's own default
    # layout (a first bucket of 1 MiB, then 25 MiB); any other value caps every bucket at it.
    bucket_cap_mb: Annotated[float, Range(gt=0, le=1024)] = DEFAULT_BUCKET_CAP_MB
    gradient_as_bucket_view: bool = False  # gradients are views into the buckets: one copy less, less memory


@dataclass(frozen=True)
class ProfileSection:
    """torch.profiler over a window of steps (appliance/train/profiling.py); never changes the weights."""

    steps: Annotated[int, SMALL_COUNT] = 0  # optimizer steps profiled; 0: off (`--profile [STEPS]` overrides)
    wait: Annotated[int, SMALL_COUNT] = 5  # steps first left alone: start-up, loader workers, first batches
    warmup: Annotated[int, SMALL_COUNT] = 2  # steps traced and thrown away (the profiler's own start-up)
    top_operators: Annotated[int, SMALL_COUNT_AT_LEAST_ONE] = 15  # rows of the report's operator table


@dataclass(frozen=True)
class QatSection:
    """Quantization-aware fine-tuning (appliance/tasks/fake_quant.py): BatchNorm folded, fake INT8 weights
    and layer inputs; the exported model is QDQ with the scales training learnt. Start it from a trained
    run ([model] init) with a lower lr and few epochs; `appliance quantize --qat RUN` writes such a config."""

    enabled: bool = False


@dataclass(frozen=True)
class Config:
    run: RunSection
    data: DataSection
    model: ModelSection = field(default_factory=ModelSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    augment: AugmentSection = field(default_factory=AugmentSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    task: TaskSection = field(default_factory=TaskSection)
    qat: QatSection = field(default_factory=QatSection)
    source: str = ""
    init_sha256: str = ""  # of [model] init's weights, hashed when the config is read: part of training_hash

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name

    @property
    def num_classes(self) -> int:
        return self.data.num_classes or len(self.data.classes)

    def training_hash(self) -> str:
        """sha256 of what decides the weights; logging, retention and length may change on resume."""
        d = dataclasses.asdict(self)
        d.pop("source")
        d.pop("checkpoint")
        # [distributed]: where the processes talk, not what they compute; except the bucket size. The
        # gradient all-reduce sums each bucket in chunks, so the layout sets the order of the additions:
        # measured on gloo, bucket_cap_mb 0.01 against 25 trains other bits on 3 and 4 processes (the same
        # on 2, where a + b is b + a). gradient_as_bucket_view changes no bit (measured on 2 and 3). At the
        # default the key is left out, so the hashes of runs made before it existed stay valid.
        bucket_cap_mb = d.pop("distributed")["bucket_cap_mb"]
        if bucket_cap_mb != DEFAULT_BUCKET_CAP_MB:
            d["ddp_bucket_cap_mb"] = bucket_cap_mb
        if d["data"]["decode"] == "auto":  # the hashes of runs made before [data] decode existed stay valid
            d["data"].pop("decode")
        d["data"].pop("max_pixels")  # what is refused, not what is computed (runs before the key keep their hash)
        d["model"]["init"] = self.init_sha256  # the weights decide, not where the file lies
        d.pop("profile")  # measuring a run does not change it
        if self.task == TaskSection():
            d.pop("task")  # classification's hashes stay those of runs made before [task] existed
        if self.qat == QatSection():
            d.pop("qat")  # likewise for runs made before [qat] existed
        d["run"] = {"seed": self.run.seed, "deterministic": self.run.deterministic}
        d["train"] = {k: v for k, v in d["train"].items() if k not in ("epochs", "max_steps", *GATE_KEYS)}
        if d["train"]["compile"] == "cuda-graphs":  # the compiled kernels, replayed: the same arithmetic
            d["train"]["compile"] = "on"
        if d["train"]["compile"] != "on":  # compiled kernels round differently; "auto" and "off" run eager,
            d["train"].pop("compile")  # and runs made before the key existed keep their hashes
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if self.task == TaskSection():
            d.pop("task")  # a classification run's manifest reads as before [task] existed
        if self.qat == QatSection():
            d.pop("qat")
        return d


_SECTION_TYPES = {"run": RunSection, "data": DataSection, "model": ModelSection, "optimizer": OptimizerSection,
                  "schedule": ScheduleSection, "train": TrainSection, "checkpoint": CheckpointSection,
                  "augment": AugmentSection, "distributed": DistributedSection,
                  "profile": ProfileSection, "task": TaskSection, "qat": QatSection}


def _check_values(cfg: Config, source: str) -> None:
    def bad(where, what):
        raise ConfigError(f"{source}: {where} {what}")

    if cfg.task.kind not in TASK_KINDS:
        bad("[task] kind", f"{cfg.task.kind!r} is not one of {', '.join(TASK_KINDS)}")
    architectures = task_for(cfg.task).architectures
    if cfg.model.architecture not in architectures:
        bad("[model] architecture", f"{cfg.model.architecture!r} is not one of {', '.join(architectures)}"
            f" (for [task] kind {cfg.task.kind!r})")
    if cfg.task.class_weights and len(cfg.task.class_weights) != cfg.num_classes:
        bad("[task] class_weights", f"needs {cfg.num_classes} values (one per class), got {len(cfg.task.class_weights)}")
    if cfg.optimizer.name not in OPTIMIZERS:
        bad("[optimizer] name", f"{cfg.optimizer.name!r} is not one of {', '.join(OPTIMIZERS)}")
    if cfg.train.precision not in PRECISIONS:
        bad("[train] precision", f"{cfg.train.precision!r} is not one of {', '.join(PRECISIONS)}")
    if cfg.train.compile not in COMPILE_MODES:
        bad("[train] compile", f"{cfg.train.compile!r} is not one of {', '.join(COMPILE_MODES)}")
    if cfg.checkpoint.monitor not in MONITORED:
        bad("[checkpoint] monitor", f"{cfg.checkpoint.monitor!r} is not one of {', '.join(MONITORED)} "
            "(what an evaluation records)")
    if cfg.checkpoint.mode not in ("min", "max"):
        bad("[checkpoint] mode", f"{cfg.checkpoint.mode!r} is not 'min' or 'max'")
    if not cfg.data.train:
        bad("[data] train", "lists no file: give the TFRecord files (or glob patterns) to train on")
    if "" in cfg.data.classes or len(set(cfg.data.classes)) != len(cfg.data.classes):
        blank = "" in cfg.data.classes
        bad("[data] classes", "has an empty name" if blank else
            f"names {next(c for c in cfg.data.classes if cfg.data.classes.count(c) > 1)!r} twice (one name per class)")
    if len(cfg.data.classes) > MAX_CLASSES:
        bad("[data] classes", f"names {len(cfg.data.classes)} classes, at most {MAX_CLASSES} are supported")
    for key in ("image_key", "label_key"):
        if not getattr(cfg.data, key):
            bad(f"[data] {key}", "must name a feature, got an empty string")
    for name in cfg.distributed.env:
        if not ENV_NAME.fullmatch(name):
            bad("[distributed] env", f"key {name!r} is not an environment variable name (letters, digits, _)")
    if cfg.num_classes < 2:
        bad("[data]", "needs `classes` (names) or `num_classes` >= 2")
    if cfg.data.classes and cfg.data.num_classes and len(cfg.data.classes) != cfg.data.num_classes:
        bad("[data] num_classes", f"is {cfg.data.num_classes} but `classes` names {len(cfg.data.classes)}")
    if cfg.data.decode not in DECODES:
        bad("[data] decode", f"{cfg.data.decode!r} is not one of {', '.join(DECODES)}")
    if cfg.data.decode == "gpu" and cfg.task.kind != "classification":
        bad("[data] decode", f'"gpu" decodes classification images; [task] kind {cfg.task.kind!r} decodes on the CPU '
            '(use "auto" or "cpu")')
    if cfg.data.channels not in (1, 3):
        bad("[data] channels", f"must be 1 or 3, got {cfg.data.channels}")
    for key in ("mean", "std"):
        if len(getattr(cfg.data, key)) != cfg.data.channels:
            bad(f"[data] {key}", f"needs {cfg.data.channels} values (one per channel)")
    if len(cfg.optimizer.betas) != 2:
        bad("[optimizer] betas", "needs exactly two values")
    # Single numbers were range-checked while parsing (the Annotated ranges above); here what depends on several.
    onnx_init = cfg.model.init.endswith(".onnx")
    if (cfg.model.architecture == "onnx") != onnx_init:
        bad("[model] architecture", '"onnx" goes with an ONNX init (init = "model.onnx"), and an ONNX init with '
            f'architecture "onnx"; got architecture {cfg.model.architecture!r}, init {cfg.model.init!r}')
    if cfg.train.epochs < 1 and cfg.train.max_steps < 1:
        bad("[train]", "needs epochs >= 1 or max_steps >= 1")
    aug = cfg.augment
    if len(aug.crop_scale) != 2 or not 0 < aug.crop_scale[0] <= aug.crop_scale[1] <= 1:
        bad("[augment] crop_scale", f"needs two area fractions 0 < min <= max <= 1, got {list(aug.crop_scale)}")


def _resolve(patterns: tuple[str, ...], base: Path, source: str, key: str) -> tuple[str, ...]:
    """Expand globs relative to the config's directory; a pattern matching nothing is an error."""
    files: list[str] = []
    for pattern in patterns:
        full = pattern if Path(pattern).is_absolute() else str(base / pattern)
        try:
            matches = sorted(glob.glob(full))
        except ValueError:  # a NUL byte
            matches = []
        if not matches:
            raise ConfigError(f"{source}: [data] {key}: {pattern!r} matches no file")
        for match in matches:
            try:
                mode = os.stat(match).st_mode
            except OSError as err:  # a dangling link or a loop of links that glob still lists
                raise ConfigError(f"{source}: [data] {key}: {match}: {err.strerror or err}") from None
            if not stat.S_ISREG(mode):  # a directory, /dev/zero, a pipe: never read as records
                raise ConfigError(f"{source}: [data] {key}: {match} is {describe(mode)}, not a TFRecord file")
        files.extend(str(Path(m).resolve()) for m in matches)
    return tuple(files)


def parse_sections(raw: dict, source: str) -> dict:
    """The training sections of a TOML table, each parsed and range-checked (files not resolved)."""
    for name, value in raw.items():
        if name not in _SECTION_TYPES:
            raise ConfigError(f"{source}: unknown section [{name}] (known: {', '.join(_SECTION_TYPES)})")
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {name} must be a [section], got {value!r}")
    for name in ("run", "data"):
        if name not in raw:
            raise ConfigError(f"{source}: missing section [{name}]")
    return {name: parse_section(cls, raw.get(name, {}), source, name) for name, cls in _SECTION_TYPES.items()}


def load_config(path: str | Path) -> Config:
    """Read and validate a training config; all errors are ConfigError naming the file and key."""
    return config_from_dict(read_toml(path, "config file"), path)


def config_from_dict(raw: dict, path: str | Path) -> Config:
    """Validate training sections read from `path` (a training config, or a pipeline config's
    training sections); relative paths are resolved against path's directory."""
    path = Path(path)
    source = str(path)
    sections = parse_sections(raw, source)
    base = path.resolve().parent
    data = sections["data"]
    sections["data"] = dataclasses.replace(
        data,
        train=_resolve(data.train, base, source, "train"),
        val=_resolve(data.val, base, source, "val"),
        check_report=str((base / data.check_report).resolve()) if data.check_report else "",
    )
    run = sections["run"]
    if not Path(run.out_dir).is_absolute():
        sections["run"] = dataclasses.replace(run, out_dir=str(base / run.out_dir))
    if not run.name or "/" in run.name or run.name.startswith("."):
        raise ConfigError(f"{source}: [run] name {run.name!r} must be a plain directory name")
    model_raw = raw.get("model", {})
    if sections["model"].init.endswith(".onnx") and "architecture" not in model_raw:
        # An ONNX init says which graph to train: the architecture is that graph's.
        sections["model"] = dataclasses.replace(sections["model"], architecture="onnx")
    init_sha256 = ""
    if sections["model"].init:
        from appliance.train.init_weights import resolve_init  # late: torch; configs are read without it

        init = resolve_init(sections["model"].init, base, source)
        if init.kind != "torchvision":  # absolute, as the data paths: the workers read the same file
            spec = Path(init.spec)
            sections["model"] = dataclasses.replace(sections["model"], init=str((base / spec).resolve()))
        init_sha256 = init.sha256
    cfg = Config(**sections, source=str(path.resolve()), init_sha256=init_sha256)
    _check_values(cfg, source)
    check_thresholds(cfg.train, source)
    return cfg


def check_data_report(cfg: Config) -> dict | None:
    """When [data] check_report is set, the data check must have run and its gate passed."""
    if not cfg.data.check_report:
        return None
    path = Path(cfg.data.check_report)
    if not path.exists():
        raise ConfigError(f"{cfg.source}: [data] check_report: {path} does not exist "
                          "(run `appliance data check --fail-on ...` first)")
    return require_passing_report(path)
