"""Optimizer (SGD or AdamW, optionally sharded with ZeroRedundancyOptimizer) and its schedule."""

from __future__ import annotations

import math

import torch


def build_optimizer(cfg, model) -> torch.optim.Optimizer:
    opt = cfg.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    if opt.name == "sgd":
        cls, kwargs = torch.optim.SGD, {"lr": opt.lr, "momentum": opt.momentum, "weight_decay": opt.weight_decay}
    else:
        cls, kwargs = torch.optim.AdamW, {"lr": opt.lr, "betas": tuple(opt.betas), "weight_decay": opt.weight_decay}
    if opt.zero_redundancy:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # Each rank keeps the optimizer state of its shard; checkpoints save one file per rank.
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
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
