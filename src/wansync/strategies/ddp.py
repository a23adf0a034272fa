"""DDP: per-step gradient all-reduce with PyTorch's real DistributedDataParallel.

The baseline must be the one users actually run (bucketed all-reduce overlapped with
backward), or every comparison against it is unfair. The gradient phase (`grad_sync.py`) is on
at every step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import Strategy
from .grad_sync import gradient_phase
from .timetable import Timetable


class DDPTimetable(Timetable):
    """Every step all-reduces the gradients over every rank."""

    def ddp_step(self, t: int) -> bool:
        return True


class DDP(Strategy):
    name = "ddp"
    Timetable = DDPTimetable
    steps_inside_workers = False

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, options: Any = None, **kw: Any):
        super().__init__(model, optimizer, options, **kw)
        self.grad_sync = gradient_phase(model, self.group, self.comm, self.replicas)

    @property
    def model(self) -> nn.Module:
        return self.grad_sync.module  # over every rank (hybrid sharding in a sharded worker)

    def after_inner_step(self) -> None:
        self.grad_sync.book()  # DDP's reducer all-reduced every gradient bucket during backward
