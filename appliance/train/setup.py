"""A training process's state, built once: processes, determinism, data, model, optimizer,
checkpoints; and the resume that puts a checkpoint's every part back (loop.py runs it)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from appliance.core.errors import ConfigError
from appliance.core.manifest import atomic_write_text
from appliance.models import ONNX_ARCHITECTURE, ONNX_GRAPH_NAME, ModelCard
from appliance.tasks import task_for
from appliance.tasks.fake_quant import CARD_KEY as QAT_CARD_KEY, CARD_VALUE as QAT_CARD_VALUE
from appliance.train import data, faults, worker_error
from appliance.train.checkpoint import CheckpointDamaged, CheckpointManager
from appliance.train.config import Config, check_data_report
from appliance.train.ddp import build_training_model, cuda_graphs, match_layout, pick_precision, set_tf32, use_compile
from appliance.train.device_decode import decode_mode
from appliance.train.determinism import set_determinism, set_rng_state
from appliance.train.optimizer import build_optimizer, build_scheduler
from appliance.train.step import Normalise

INIT_REPORT = "init.json"  # how [model] init's weights matched the model
STORAGE_WORDS = {"shared": "one directory shared by every node (a shared filesystem was detected)",
                 "per-node": "each node writes its own directory (no shared filesystem was detected)"}


_NO_AUTOCAST = contextlib.nullcontext()


@dataclass
class Run:
    """Everything one training process holds; the loop's position (step, epoch, batches_done) included."""

    cfg: Config
    rank: int
    world: int
    local_rank: int
    device: torch.device
    log: Callable
    model: nn.Module = None  # DDP-wrapped with more than one process
    task: Any = None  # appliance.tasks: the loss, what validation counts, the card's task entries
    raw_model: nn.Module = None
    trainable: list = field(default_factory=list)  # raw_model's parameters with requires_grad, listed once
    ddp: bool = False
    memory_format: Any = torch.contiguous_format
    normalise: Any = None
    decode: str = "cpu"  # where the JPEGs are decoded: "cpu" (loader workers) or "gpu" (device_decode.py)
    optimizer: Any = None
    local_optimizer: Any = None  # ZeRO: this rank's shard
    scheduler: Any = None
    scaler: Any = None
    amp_dtype: Any = None
    criterion: Any = None
    train_loader: Any = None
    val_loader: Any = None
    sampler: Any = None
    loader_generator: Any = None
    checkpoints: CheckpointManager = None
    card: ModelCard = None
    onnx_graph: Path | None = None
    init_report: dict | None = None
    tf32: bool = False
    compiled: bool = False  # [train] compile, as resolved for this device
    cuda_graphs: bool = False  # and its kernels replayed as CUDA graphs (ddp.cuda_graphs)
    profiler: Any = None
    total_steps: int = 0
    step: int = 0
    epoch: int = 0
    batches_done: int = 0
    metrics: dict = field(default_factory=dict)

    def autocast(self):
        if self.amp_dtype is None:  # fp32: nothing to switch, every step
            return _NO_AUTOCAST
        return torch.autocast(self.device.type, dtype=self.amp_dtype)


def start_processes(cfg: Config, log_for_rank: Callable) -> Run:
    """The process group, determinism and TF32; RANK/WORLD_SIZE/LOCAL_RANK from torchrun."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    run = Run(cfg=cfg, rank=rank, world=world, local_rank=local_rank, device=device, log=log_for_rank(rank))
    # The loaders' workers are forked now, while this process has one thread: a fork once the process
    # group's (gloo/NCCL, store), TensorBoard's or OpenMP's threads run copies their locks into a child
    # that can never release them (a worker deadlocked at start is a rank waiting for a batch forever).
    check_data_report(cfg)
    faults.stacks_on_sigusr1()  # a test hook: unset in production
    build_loaders(run)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if rank == 0:
        worker_error.clear(cfg.run_dir)  # an earlier attempt's line; every rank is past start-up now
    faults.load()
    set_determinism(cfg.run.seed, rank, cfg.run.deterministic)
    run.tf32 = set_tf32(cfg.train.precision, cfg.run.deterministic)
    return run


def build_loaders(run: Run) -> None:
    """The training and validation loaders, their persistent workers started (data.start_workers)."""
    cfg, device, log = run.cfg, run.device, run.log
    # The loaders get their own generator, reseeded per epoch: creating an iterator then never
    # draws from the global RNG, whose stream the checkpoints capture mid-epoch.
    run.loader_generator = torch.Generator()
    pin = device.type == "cuda"
    run.decode = decode_mode(cfg.data.decode, device) if cfg.task.kind == "classification" else "cpu"
    if run.rank == 0 and run.decode == "gpu":
        where = "nvJPEG through torchvision" if device.type == "cuda" else "no CUDA: tensor ops on the CPU"
        log(f"data: [data] decode = {cfg.data.decode!r}: JPEGs decoded and augmented by the training process on "
            f"{device} ({where})", flush=True)
    run.train_loader, run.sampler = data.train_loader(cfg, run.rank, run.world, run.loader_generator, pin=pin,
                                                      decode=run.decode, device=device)
    if cfg.data.val:
        run.val_loader = data.val_loader(cfg, run.rank, run.world, run.loader_generator, pin=pin,
                                         decode=run.decode, device=device)
    for loader in (run.train_loader, run.val_loader):
        data.start_workers(loader)


def build(run: Run) -> Run:
    """Model, optimizer, schedule, precision, checkpoints (the loaders are built by start_processes)."""
    cfg, device, log = run.cfg, run.device, run.log
    steps_per_epoch = len(run.train_loader) // cfg.train.grad_accum
    if steps_per_epoch < 1:
        raise ConfigError(f"{cfg.source}: [train] batch_size x grad_accum x processes is larger than the data")
    run.total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch

    run.model, run.raw_model, run.init_report, run.memory_format = build_training_model(cfg, device, log, run.world)
    run.ddp = run.model is not run.raw_model
    run.trainable = [p for p in run.raw_model.parameters() if p.requires_grad]
    run.compiled = use_compile(cfg.train.compile, device)
    run.cuda_graphs = cuda_graphs(cfg.train.compile, device, run.world, cfg.train.grad_accum)[0]
    run.normalise = Normalise(cfg.data.mean, cfg.data.std, cfg.data.channels, device)
    run.optimizer = build_optimizer(cfg, run.raw_model, fused=True)
    run.scheduler = build_scheduler(cfg, run.optimizer, run.total_steps)
    precision = pick_precision(cfg.train.precision, device, cfg.source)
    run.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    run.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    run.task = task_for(cfg.task)
    run.criterion = run.task.criterion().to(device)
    run.local_optimizer = run.optimizer.optim if cfg.optimizer.zero_redundancy else run.optimizer
    run.card = ModelCard(architecture=cfg.model.architecture, num_classes=cfg.num_classes,
                         in_channels=cfg.data.channels, image_size=cfg.data.image_size, mean=cfg.data.mean,
                         std=cfg.data.std, channel_order="RGB" if cfg.data.channels == 3 else "L",
                         class_names=cfg.data.classes, extra={"run": cfg.run.name, "made_by": "appliance train",
                                                                   **run.task.card_extra()})
    if cfg.qat.enabled:  # export rebuilds the fake-quantized model from this
        run.card.extra[QAT_CARD_KEY] = QAT_CARD_VALUE
    if cfg.model.architecture == ONNX_ARCHITECTURE:
        run.onnx_graph = Path(cfg.model.init)
        run.card.extra["onnx_graph"] = ONNX_GRAPH_NAME
    if run.init_report is not None and run.rank == 0:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cfg.run_dir / INIT_REPORT, json.dumps(run.init_report, indent=2) + "\n")
    run.checkpoints = CheckpointManager(
        cfg.run_dir / "checkpoints", keep_last=cfg.checkpoint.keep_last, keep_best=cfg.checkpoint.keep_best,
        monitor=cfg.checkpoint.monitor, mode=cfg.checkpoint.mode,
        min_free_bytes=int(cfg.checkpoint.min_free_gb * 2**30), rank=run.rank, world_size=run.world,
        local_rank=run.local_rank, node=int(os.environ.get("GROUP_RANK", 0)), log=log,
        model_state=run.raw_model.state_dict(), card=run.card)
    if run.world > int(os.environ.get("LOCAL_WORLD_SIZE", run.world)):  # several machines: say where checkpoints live
        log(f"checkpoints: {STORAGE_WORDS[run.checkpoints.storage]} ({run.checkpoints.directory})", flush=True)
    return run


def resume(run: Run, how: str, log_line: Callable) -> None:
    """Weights, optimizer, schedule, scaler, RNG streams and data position from a checkpoint
    (how: "auto" the newest, "none" a fresh start, or a checkpoint's path)."""
    cfg, checkpoints = run.cfg, run.checkpoints
    ckpt = None
    if how == "auto":
        ckpt = checkpoints.load_latest()
        if ckpt is None and checkpoints.any_set_aside():
            raise ConfigError(f"{checkpoints.directory}: no checkpoint verifies (see the warnings above); "
                              "refusing to start over on top of them: use a new [run] name")
    elif how == "none":
        if checkpoints.any_committed():
            raise ConfigError(f"{cfg.run_dir / 'checkpoints'} already holds checkpoints of an earlier run; "
                              "use --resume auto to continue it, or a new [run] name to start over")
    else:
        try:
            ckpt = checkpoints.load(how)
        except CheckpointDamaged as err:
            raise ConfigError(f"--resume {how}: {err}") from None
    if ckpt is None:
        return
    if ckpt.trainer["config_hash"] != cfg.training_hash():
        raise ConfigError(f"{cfg.source}: differs from the config that made {ckpt.path} in a setting that "
                          "decides the weights; use a new [run] name to start a new run (with [model] init = "
                          f"\"{ckpt.path}\" to start it from those weights)")
    run.raw_model.load_state_dict(ckpt.model_state)
    run.local_optimizer.load_state_dict(ckpt.optimizer_state)
    match_layout(run.local_optimizer)
    run.scheduler.load_state_dict(ckpt.trainer["scheduler"])
    run.scaler.load_state_dict(ckpt.trainer["scaler"])
    for group, lr in zip(run.optimizer.param_groups, run.scheduler.get_last_lr()):
        group["lr"] = lr  # ZeRO keeps its own param groups; they must carry the resumed lr too
    set_rng_state(ckpt.rng)
    run.sampler.load_state_dict(ckpt.trainer["sampler"])  # rank 0's; every rank is at the same position
    run.step, run.epoch, run.batches_done = ckpt.step, ckpt.trainer["epoch"], ckpt.trainer["batches_done"]
    run.metrics = ckpt.trainer["metrics"]
    run.log(f"resumed from {ckpt.path} (step {run.step}, epoch {run.epoch})", flush=True)
    if run.rank == 0:  # later lines may repeat steps the lost attempt had logged
        log_line(cfg.run_dir, {"step": run.step, "epoch": run.epoch, "resumed_from": str(ckpt.path)})


def printer(bar_holder: list) -> Callable:
    """log_for_rank for start_processes: rank 0's lines go through its progress bar once there is one."""
    def for_rank(rank: int):
        def log(line: str, flush: bool = True) -> None:
            if rank != 0:
                return
            if bar_holder:
                bar_holder[0].write(line, sys.stdout)
            else:
                print(line, flush=flush)
        return log
    return for_rank
