"""The model as it trains: frozen layers, activation checkpointing, DDP; and the precision choice."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from appliance.errors import ConfigError
from appliance.models import build_model

# Blocks worth recomputing in backward: the repeated units of each architecture we build.
_BLOCK_NAMES = {"BasicBlock", "Bottleneck", "InvertedResidual", "MBConv", "FusedMBConv"}


def _is_block(module: nn.Module) -> bool:
    if type(module).__name__ in _BLOCK_NAMES:
        return True
    # small_cnn: conv-bn-relu Sequentials
    return isinstance(module, nn.Sequential) and len(module) > 0 and isinstance(module[0], nn.Conv2d)


def build_training_model(cfg, device: torch.device):
    """(DDP-wrapped model for training, the plain model for saving and loading state)."""
    model = build_model(cfg.model.architecture, cfg.num_classes, cfg.data.channels)
    names = [name for name, _ in model.named_parameters()]
    for prefix in cfg.model.frozen_prefixes:
        matched = [n for n in names if n.startswith(prefix)]
        if not matched:
            raise ConfigError(f"{cfg.source}: [model] frozen_prefixes: {prefix!r} matches no parameter of "
                              f"{cfg.model.architecture} (e.g. {', '.join(names[:3])})")
        for name, param in model.named_parameters():
            if name.startswith(prefix):
                param.requires_grad_(False)
    if cfg.model.activation_checkpointing:
        # Trades compute for memory. The wrapper keeps state_dict keys unchanged. BatchNorm
        # running statistics are updated again when a block is recomputed.
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=_is_block)
    model.to(device)
    wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return wrapped, model


def pick_precision(requested: str, device: torch.device, source: str = "config") -> str:
    """auto: fp16 with GradScaler on CUDA, bf16 autocast on CPU."""
    if requested == "auto":
        return "fp16" if device.type == "cuda" else "bf16"
    if requested == "fp16" and device.type != "cuda":
        raise ConfigError(f"{source}: [train] precision \"fp16\" needs a CUDA GPU; use \"bf16\" or \"fp32\" on CPU")
    return requested
