"""DDP's per-step gradient all-reduce as a phase a strategy switches on and off: the one
implementation DDP, post-local SGD and CPDP share.

The wrapper is PyTorch's real `DistributedDataParallel` (bucketed all-reduce overlapped with
backward): a baseline users actually run. DDP decides at forward time whether the coming backward
all-reduces gradients, from `require_backward_grad_sync`, the flag `no_sync()` toggles; so a
strategy arms the phase for its *next* step (at construction, after every step, after a resume).
The bytes are booked on the ledger as `grads` after the step whose backward all-reduced them.

A worker of several ranks (`comm.replicas`) trains its one model with a second wrapper over its
own ranks (`inside/grads`), every step the strategy does not all-reduce over all ranks. Two
wrappers can share a module: a backward only all-reduces in the wrapper its forward went through.
"""
from __future__ import annotations

import warnings
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..comm.ledger import CommLedger


def wrap_ddp(model: nn.Module, group: Any, broadcast_buffers: bool = True) -> DistributedDataParallel:
    """DDP with PyTorch's defaults; its constructor broadcasts rank 0's state.

    With `broadcast_buffers` (DDP's default), non-persistent buffers (e.g. the LM's rotary cos/sin
    tables) are excluded from DDP's per-forward buffer broadcast: they are constants derived from
    the shape, identical on every rank, and broadcasting them would cost one network latency per
    step for nothing. Real state (BatchNorm statistics) is still broadcast from rank 0 before every
    forward. Without it, no buffer is broadcast after construction (the argument is passed only
    then: recent torch warns on any use of it)."""
    if not broadcast_buffers:
        with warnings.catch_warnings():      # its replacement would sync buffers at init: keep it
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            return DistributedDataParallel(model, process_group=group, broadcast_buffers=False)
    persistent = set(model.state_dict(keep_vars=True).keys())
    constants = [name for name, _ in model.named_buffers() if name not in persistent]
    if constants:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, constants)
    return DistributedDataParallel(model, process_group=group)


class GradientSync:
    """The DDP wrapper of `model`, its gradient bytes, and the switch for the next backward."""

    def __init__(self, model: nn.Module, group: Any, ledger: CommLedger, *, broadcast_buffers: bool = True,
                 purpose: str = "grads"):
        self.ddp = wrap_ddp(model, group, broadcast_buffers)
        self.bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self._ledger, self._purpose = ledger, purpose

    def arm(self, on: bool) -> None:
        """Gradient all-reduce on or off for the next backward."""
        self.ddp.require_backward_grad_sync = on

    def book(self) -> bool:
        """After a step: whether its backward all-reduced the gradients (the phase was armed);
        if so, count the bytes DDP's reducer sent."""
        if not self.ddp.require_backward_grad_sync:
            return False
        self._ledger.count(self._purpose, self.bytes)
        return True
