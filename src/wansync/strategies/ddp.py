"""DDP (spec §1): per-step gradient all-reduce with PyTorch's real DistributedDataParallel.

The baseline must be the one users actually run (bucketed all-reduce overlapped with
backward), or every comparison against it is unfair.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .base import Strategy


def wrap_ddp(model: nn.Module, group: Any) -> DistributedDataParallel:
    """DDP with PyTorch's defaults; its constructor broadcasts rank 0's state.

    Non-persistent buffers (e.g. the LM's rotary cos/sin tables) are constants derived from the
    shape, identical on every rank: they are excluded from DDP's per-forward buffer broadcast,
    which would otherwise cost one network latency per step for nothing. Real state (BatchNorm
    statistics) is still broadcast from rank 0 before every forward, as DDP does by default."""
    persistent = set(model.state_dict(keep_vars=True).keys())
    constants = [name for name, _ in model.named_buffers() if name not in persistent]
    if constants:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, constants)
    return DistributedDataParallel(model, process_group=group)


class DDP(Strategy):
    name = "ddp"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, options: Any = None, *, group: Any = None):
        super().__init__(model, optimizer, options, group=group)
        self.ddp = wrap_ddp(model, group)

        self.grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    @property
    def model(self) -> nn.Module:
        return self.ddp

    def after_inner_step(self) -> None:
        # DDP's reducer all-reduced every gradient bucket during backward: account for it.
        self.comm.count("grads", self.grad_bytes)
