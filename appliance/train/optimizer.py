"""Optimizer (SGD or AdamW, optionally sharded with ZeroRedundancyOptimizer) and its schedule."""

from __future__ import annotations

import math

import torch

from appliance.core.errors import ConfigError


def param_groups(cfg, model) -> list[dict]:
    """The trainable parameters in groups by (lr multiplier, weight decay or not); each group names
    itself ("name", "lr_mult"), so the groups are readable in the optimizer's state."""
    opt = cfg.optimizer
    names = [name for name, _ in model.named_parameters()]
    for prefix in opt.lr_mult:
        if not any(n.startswith(prefix) for n in names):
            raise ConfigError(f"{cfg.source}: [optimizer] lr_mult: {prefix!r} matches no parameter "
                              f"(e.g. {', '.join(names[:3])})")
    longest_first = sorted(opt.lr_mult, key=len, reverse=True)
    groups: dict[tuple[float, bool], list] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        mult = next((opt.lr_mult[p] for p in longest_first if name.startswith(p)), 1.0)
        # Biases and norm scales are 1-D: decaying them towards 0 only hurts (the usual fine-tuning rule).
        decay = not (opt.no_decay_norm_and_bias and param.ndim <= 1)
        groups.setdefault((mult, decay), []).append(param)
    return [{"params": params, "lr": opt.lr * mult, "weight_decay": opt.weight_decay if decay else 0.0,
             "name": f"{'decay' if decay else 'no_decay'} lr_mult={mult:g}", "lr_mult": mult}
            for (mult, decay), params in sorted(groups.items(), key=lambda kv: (kv[0][0] != 1.0, kv[0][0], not kv[0][1]))]


def build_optimizer(cfg, model, fused: bool = False) -> torch.optim.Optimizer:
    """SGD or AdamW over param_groups; fused: torch's one-kernel step where this torch has it for the
    parameters' device (it also takes GradScaler's inf check on the device, with no read per step)."""
    opt = cfg.optimizer
    params = param_groups(cfg, model)
    if opt.name == "sgd":
        cls, kwargs = torch.optim.SGD, {"lr": opt.lr, "momentum": opt.momentum, "weight_decay": opt.weight_decay}
    else:
        cls, kwargs = torch.optim.AdamW, {"lr": opt.lr, "betas": tuple(opt.betas), "weight_decay": opt.weight_decay}
    if opt.zero_redundancy:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # Each rank keeps the optimizer state of its shard; checkpoints save one file per rank.
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
    if fused:
        try:
            return cls(params, fused=True, **kwargs)
        except (RuntimeError, ValueError, TypeError):  # no fused kernel for this device or dtype here
            pass
    return cls(params, **kwargs)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base lr: linear warmup from 0, then cosine down to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(cfg, optimizer, total_steps: int):
    s = cfg.schedule
    # A functools.partial would be pickled into state_dict(); a lambda is not, so the state stays JSON.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, s.warmup_steps, total_steps, s.min_lr_ratio))
