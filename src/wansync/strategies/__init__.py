"""The strategy registry: one module per algorithm, one line here to add one."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .base import Strategy
from .cocodc import CoCoDC
from .cpdp import CPDP
from .ddp import DDP
from .diloco import DiLoCo
from .local_sgd import LocalSGD
from .post_local_sgd import PostLocalSGD
from .slowmo import SlowMo
from .streaming import Streaming

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (DDP, LocalSGD, SlowMo, CPDP, DiLoCo, PostLocalSGD)}
STRATEGIES.update({cls.name: cls for cls in (Streaming, CoCoDC)})


def strategy_class(name: str) -> type[Strategy]:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"unknown strategy '{name}' (available: {', '.join(STRATEGIES)})") from None


def option_names(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(strategy_class(name).Options)]


def make_options(name: str, **options: Any) -> Any:
    """The strategy's Options from keyword values; None means the strategy's default."""
    cls = strategy_class(name)
    valid = option_names(name)
    unknown = [k for k in options if k not in valid]
    if unknown:
        raise ConfigError(f"strategy {name} has no option {unknown[0]!r} (its options: {', '.join(valid) or 'none'})")
    return cls.Options(**{k: v for k, v in options.items() if v is not None})


def build(name: str, model: nn.Module, optimizer: torch.optim.Optimizer, *, group: Any = None,
          on_nonfinite: str | None = None, **options: Any) -> Strategy:
    """Build a strategy on an existing process group (the public `wansync.strategy`).
    `on_nonfinite` (None, "abort", "skip"): what its exchange does with NaN/Inf model state."""
    cls = strategy_class(name)
    return cls(model, optimizer, make_options(name, **options), group=group, on_nonfinite=on_nonfinite)
