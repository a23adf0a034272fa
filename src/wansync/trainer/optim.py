"""The inner optimizer and its learning-rate schedule (a pure function of the step, so a
resumed run needs no scheduler state)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .muon import ADAMW_BETAS, FOREACH, muon_adamw


def build_optimizer(cfg: Any, model: nn.Module) -> torch.optim.Optimizer:
    """The inner optimizer of `cfg`: AdamW, SGD, or Muon on the hidden matrices with AdamW on the rest
    (`trainer.muon`); for a strategy that replaces it (DeMo's sign descent) a plain SGD that carries the
    learning rate and the weight decay, whatever `optimizer` says."""
    from ..errors import ConfigError
    from ..strategies import strategy_class

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError(f"--model {cfg.model}: the model has no parameter that requires grad: nothing to train")
    if not strategy_class(cfg.strategy).steps_optimizer:
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=FOREACH)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, foreach=FOREACH)
    if cfg.optimizer == "muon":
        return muon_adamw(model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=ADAMW_BETAS, foreach=FOREACH)


LINEAR_SCALING_BASE_BATCH = 256


def peak_lr(cfg: Any, world_size: int | None = None) -> float:
    """The peak inner lr: `lr` as given (lr_scaling none = fixed), or under lr_scaling linear
    lr x global batch / 256, the global batch being world_size (default: every rank of every
    worker) x batch_size."""
    if getattr(cfg, "lr_scaling", "none") != "linear":
        return cfg.lr
    world = world_size if world_size is not None else cfg.workers * getattr(cfg, "ranks_per_worker", 1)
    return cfg.lr * world * cfg.batch_size / LINEAR_SCALING_BASE_BATCH


def lr_at(cfg: Any, step: int, world_size: int | None = None) -> float:
    """Learning rate for inner step `step` (0-based): linear warmup, then constant or cosine to 10%."""
    lr = peak_lr(cfg, world_size)
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return lr
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr
