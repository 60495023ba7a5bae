"""The model as it trains: frozen layers, activation checkpointing, DDP; and the precision choice."""

from __future__ import annotations

import types
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from appliance.core.errors import ConfigError
from appliance.models import ONNX_ARCHITECTURE, classifier_head
from appliance.tasks import task_for
from appliance.tasks.fake_quant import insert_fake_quant
from appliance.train.config import DEFAULT_BUCKET_CAP_MB
from appliance.train.init_weights import apply_init, resolve_init

# Blocks worth recomputing in backward: the repeated units of each architecture we build.
_BLOCK_NAMES = {"BasicBlock", "Bottleneck", "InvertedResidual", "MBConv", "FusedMBConv"}


def _is_block(module: nn.Module) -> bool:
    if type(module).__name__ in _BLOCK_NAMES:
        return True
    # small_cnn: conv-bn-relu Sequentials
    return isinstance(module, nn.Sequential) and len(module) > 0 and isinstance(module[0], nn.Conv2d)


def _stay_in_eval(module: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(module, False)


def freeze(model: nn.Module, prefixes, linear_probe: bool, source: str, architecture: str) -> list[str]:
    """requires_grad off for parameters under prefixes (every one but the head's in linear-probe
    mode); BatchNorm layers left without a trainable parameter stay in eval mode, so their running
    statistics do not move either (model.train() keeps them so). The names of the frozen parameters."""
    names = [name for name, _ in model.named_parameters()]
    for prefix in prefixes:
        if not any(n.startswith(prefix) for n in names):
            raise ConfigError(f"{source}: [model] frozen_prefixes: {prefix!r} matches no parameter of "
                              f"{architecture} (e.g. {', '.join(names[:3])})")
    head = classifier_head(model)
    if linear_probe and not head:
        raise ConfigError(f"{source}: [model] linear_probe: {architecture} has no Linear classifier head")
    frozen = [n for n in names if any(n.startswith(p) for p in prefixes)
              or linear_probe and not n.startswith(head + ".")]
    if len(frozen) == len(names):
        raise ConfigError(f"{source}: [model] frozen_prefixes freeze every parameter of {architecture}: nothing to train")
    params = dict(model.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            own = list(module.parameters())
            if all(not p.requires_grad for p in own) and (own or any(name.startswith(p) for p in prefixes)
                                                          or linear_probe):
                module.train = types.MethodType(_stay_in_eval, module)
                module.eval()
    return frozen


def prepare_model(cfg, log=print) -> tuple[nn.Module, dict | None]:
    """The model on the CPU: built, given its [model] init weights, frozen; and the init report
    (None without init). The launcher runs it once before any process starts, so a bad init is one line."""
    init, report = None, None
    if cfg.model.init:
        init = resolve_init(cfg.model.init, Path(cfg.source).parent, cfg.source)
    graph = init.path if init is not None and cfg.model.architecture == ONNX_ARCHITECTURE else None
    task = task_for(cfg.task)
    model = task.build_model(cfg.model.architecture, cfg.num_classes, cfg.data.channels, onnx_graph=graph)
    if init is not None:
        try:
            report = apply_init(model, init, cfg.model.reset, cfg.model.architecture, log, task)
        except ConfigError as err:
            raise ConfigError(f"{cfg.source}: {err}") from None
    elif cfg.model.reset:
        raise ConfigError(f"{cfg.source}: [model] reset needs [model] init (without it every weight is fresh)")
    if cfg.qat.enabled:  # after init: BatchNorm folds with the trained statistics
        insert_fake_quant(model)
    freeze(model, cfg.model.frozen_prefixes, cfg.model.linear_probe, cfg.source, cfg.model.architecture)
    return model, report


def memory_format_for(model: nn.Module, device: torch.device) -> torch.memory_format:
    """channels_last for a convolution network on a GPU (cuDNN's fast layout: without it every conv
    converts NCHW to NHWC and back); contiguous otherwise."""
    if device.type == "cuda" and any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return torch.channels_last
    return torch.contiguous_format


def use_compile(requested: str, device: torch.device) -> bool:
    """[train] compile: "on" and "cuda-graphs" compile, "off" does not; "auto" is off on every device
    so far. On a CPU a compiled tiny model's steps measured 0.74x eager, but its compile took 20 s
    (cached) to 3 min (cold) of start-up on the 2-core box, recompiles for evaluation, and needs a C++
    compiler at run time: a loss for short runs and tests (benchmarks/README.md, issue 27). No GPU run
    has measured it yet (benchmarks/train_gpu.py --compile compare measures it)."""
    return requested in ("on", "cuda-graphs")


def cuda_graphs(requested: str, device: torch.device, world: int, grad_accum: int) -> tuple[bool, str]:
    """Whether [train] compile = "cuda-graphs" replays the compiled model's kernels as CUDA graphs
    (torch.compile's "reduce-overhead": one launch per graph instead of one per kernel, the step's host
    cost), and where it does not, why: it then runs as "on", the same kernels launched one by one, so
    the same arithmetic. Graphs exist on CUDA only; with gradient accumulation PyTorch's CUDA graph trees
    give the first micro-batch's gradient memory the next replay overwrites (silently wrong gradients,
    pytorch/pytorch#169545); with several processes (DDP's bucketed all-reduce in a captured backward)
    no run has measured it, so it is not claimed."""
    if requested != "cuda-graphs":
        return False, ""
    why = ("no CUDA device" if device.type != "cuda" else
           f"grad_accum = {grad_accum}: CUDA graph trees overwrite an accumulated gradient, pytorch/pytorch#169545"
           if grad_accum > 1 else f"{world} processes: measured with one only" if world > 1 else "")
    return not why, why


def build_training_model(cfg, device: torch.device, log=print, world: int = 2):
    """(the model to train: DDP-wrapped with more than one process, else the plain model; the plain
    model for saving and loading state; the init report; its memory format). With [train] compile the
    plain model is compiled in place (Module.compile: its state_dict keys stay those of the eager
    model, so checkpoints, resume and the saved model do not change form)."""
    model, report = prepare_model(cfg, log)
    if cfg.model.activation_checkpointing:
        # Trades compute for memory. The wrapper keeps state_dict keys unchanged. BatchNorm
        # running statistics are updated again when a block is recomputed.
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=_is_block)
    memory_format = memory_format_for(model, device)
    model.to(device, memory_format=memory_format)
    if use_compile(cfg.train.compile, device):
        graphs, why = cuda_graphs(cfg.train.compile, device, world, cfg.train.grad_accum)
        if why:
            log(f"train: [train] compile = 'cuda-graphs' runs as 'on', without CUDA graphs ({why})")
        # dynamic=False: a graph per input shape. By default the first other shape (an epoch's partial last
        # batch) recompiles the model with a dynamic batch size, and that graph then serves the full
        # batches too: other kernels from there on, so a run resumed after that point (which starts
        # static) would not train the same arithmetic as the run it continues.
        model.compile(mode="reduce-overhead" if graphs else None, dynamic=False)
    if world == 1:  # DDP would only add its hooks and buffer broadcasts
        return model, model, report, memory_format
    buckets = cfg.distributed
    # None at the default: DDP's own layout, whose first bucket is 1 MiB (an explicit 25 makes it 25 MiB).
    cap = None if buckets.bucket_cap_mb == DEFAULT_BUCKET_CAP_MB else buckets.bucket_cap_mb
    wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      bucket_cap_mb=cap, gradient_as_bucket_view=buckets.gradient_as_bucket_view)
    return wrapped, model, report, memory_format


def match_layout(optimizer: torch.optim.Optimizer) -> None:
    """Give loaded optimizer state the memory layout of its parameter: a checkpoint stores tensors
    contiguous, and fused kernels walk a parameter and its state as flat memory."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == param.shape and value.stride() != param.stride():
                    state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


def set_tf32(precision: str, deterministic: bool) -> bool:
    """TF32 matmuls and convolutions for fp32 training unless bit-determinism is asked for; whether it is on
    (the run manifest records it). Mixed precision computes in bf16/fp16 anyway."""
    on = not deterministic
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    return on


def pick_precision(requested: str, device: torch.device, source: str = "config") -> str:
    """auto: fp16 with GradScaler on CUDA, bf16 autocast on CPU."""
    if requested == "auto":
        return "fp16" if device.type == "cuda" else "bf16"
    if requested == "fp16" and device.type != "cuda":
        raise ConfigError(f"{source}: [train] precision \"fp16\" needs a CUDA GPU; use \"bf16\" or \"fp32\" on CPU")
    return requested
