"""DDP's per-step gradient all-reduce as a phase a strategy switches on and off: the one
implementation DDP, post-local SGD and CPDP share.

The wrapper is PyTorch's real `DistributedDataParallel` (bucketed all-reduce overlapped with
backward): a baseline users actually run. DDP decides at forward time whether the coming backward
all-reduces gradients, from `require_backward_grad_sync`, the flag `no_sync()` toggles; so a
strategy arms the phase for its *next* step (at construction, after every step, after a resume).
The bytes are booked on the ledger as `grads` after the step whose backward all-reduced them, once
per backward that did: a forward through the armed wrapper with autograd on is a backward that will
all-reduce, so gradient accumulation without `no_sync()` (every micro-batch all-reduces) is counted
as the link carries it. `paused()` is the strategy's `no_sync()` for this phase.

A worker of several ranks (`comm.replicas`) trains its one model with a second wrapper over its
own ranks (`inside/grads`), every step the strategy does not all-reduce over all ranks. Two
wrappers can share a module: a backward only all-reduces in the wrapper its forward went through.

A worker sharded with FSDP2 on the (across, inside) mesh has no DDP: FSDP reduce-scatters the
gradients inside the worker every step, and the gradient phase is hybrid sharding's own
all-reduce of each rank's gradient shard across the workers (`ShardedGradientSync`), switched per
step with `set_requires_all_reduce`, FSDP's counterpart of `no_sync()`. `gradient_phase` picks.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..comm.ledger import CommLedger
from ..comm.replicas import Replicas
from ..errors import ConfigError


def wrap_ddp(model: nn.Module, group: Any, broadcast_buffers: bool = True) -> DistributedDataParallel:
    """DDP with PyTorch's defaults; its constructor broadcasts rank 0's state.

    With `broadcast_buffers` (DDP's default), non-persistent buffers (e.g. the LM's rotary cos/sin
    tables) are excluded from DDP's per-forward buffer broadcast: they are constants derived from
    the shape, identical on every rank, and broadcasting them would cost one network latency per
    step for nothing. Real state (BatchNorm statistics) is still broadcast from rank 0 before every
    forward. Without it, no buffer is broadcast after construction (the argument is passed only
    then: recent torch warns on any use of it)."""
    if not broadcast_buffers:
        with warnings.catch_warnings():  # its replacement would sync buffers at init: keep it
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            return DistributedDataParallel(model, process_group=group, broadcast_buffers=False)
    persistent = set(model.state_dict(keep_vars=True).keys())
    constants = [name for name, _ in model.named_buffers() if name not in persistent]
    if constants:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, constants)
    return DistributedDataParallel(model, process_group=group)


def gradient_phase(
    model: nn.Module, group: Any, ledger: CommLedger, replicas: Replicas, *, broadcast_buffers: bool = True
) -> "GradientSync | ShardedGradientSync":
    """The all-rank gradient phase of a strategy: DDP over `group`, or hybrid sharding's all-reduce
    across workers when the worker is sharded inside (`replicas.shards`)."""
    if replicas.shards:
        return ShardedGradientSync(model, replicas, ledger)
    return GradientSync(model, group, ledger, broadcast_buffers=broadcast_buffers)


class GradientSync:
    """The DDP wrapper of `model`, its gradient bytes, and the switch for the next backward."""

    def __init__(
        self,
        model: nn.Module,
        group: Any,
        ledger: CommLedger,
        *,
        broadcast_buffers: bool = True,
        purpose: str = "grads",
    ):
        self.ddp = wrap_ddp(model, group, broadcast_buffers)
        self.bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self._ledger, self._purpose = ledger, purpose
        self._synced = 0  # forwards since the last `book` whose backward all-reduces
        self.ddp.register_forward_pre_hook(self._count_forward)

    def _count_forward(self, module: nn.Module, args: Any) -> None:
        """DDP decides at forward time whether the coming backward all-reduces (as here)."""
        if torch.is_grad_enabled() and self.ddp.require_backward_grad_sync:
            self._synced += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No gradient all-reduce for the backwards of forwards made inside (DDP's `no_sync()`)."""
        with self.ddp.no_sync():
            yield

    @property
    def module(self) -> nn.Module:
        """What the strategy's user calls forward on for a step in this phase."""
        return self.ddp

    def arm(self, on: bool) -> None:
        """Gradient all-reduce on or off for the next backward."""
        self.ddp.require_backward_grad_sync = on

    def book(self) -> bool:
        """After a step: whether its gradients were all-reduced (the phase was armed); count the
        bytes DDP's reducer sent, once per backward that all-reduced since the last step (several
        under gradient accumulation without `no_sync()`)."""
        synced, self._synced = self._synced, 0
        if synced:
            self._ledger.count(self._purpose, self.bytes * synced, calls=synced)
        return bool(self.ddp.require_backward_grad_sync)


@contextlib.contextmanager
def fsdp_gradient_sync_paused(model: nn.Module) -> Iterator[None]:
    """FSDP2's gradient accumulation: no reduce-scatter (nor all-reduce across workers) for the
    backwards inside; FSDP's default, gradient sync on, restored after."""
    from torch.distributed.fsdp import FSDPModule

    roots = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in roots:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in roots:
            m.set_requires_gradient_sync(True, recurse=False)


def hybrid_sharded(model: nn.Module) -> bool:
    """Is `model` sharded with FSDP2 on a 2-D mesh (hybrid sharding: its gradients all-reduced
    across the mesh's first dimension by FSDP2 itself, at every step)?"""
    mesh = getattr(next(model.parameters(), None), "device_mesh", None)
    return mesh is not None and mesh.ndim == 2


class ShardedGradientSync:
    """The gradient phase of a worker sharded with FSDP2: the gradient shards its backward
    reduce-scattered inside the worker, all-reduced across the workers (mean) in the same backward,
    before anything reads them (clipping, the inner step), as DDP's are. A model sharded on the
    worker's ranks only gets it through FSDP2's all-reduce hook, switched per step by `arm`; one
    sharded on a 2-D (workers x ranks) mesh is hybrid sharding, whose all-reduce FSDP2 makes at
    every step (DDP's phase, never switched off). Its bytes are this rank's gradient shards'."""

    def __init__(self, model: nn.Module, replicas: Replicas, ledger: CommLedger, purpose: str = "grads"):
        from torch.distributed.fsdp import FSDPModule

        self.module = model
        self.native = hybrid_sharded(model)
        self.bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self._across, self._workers = replicas.across, replicas.workers
        self._ledger, self._purpose, self._on = ledger, purpose, True
        self._paused, self._synced = False, 0
        if not self.native:
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_all_reduce_hook(self._all_reduce)
        model.register_forward_pre_hook(self._count_forward)

    def _count_forward(self, module: nn.Module, args: Any) -> None:
        """A forward with autograd on, outside `paused()`, is a backward whose shards go across."""
        if torch.is_grad_enabled() and self._on and not self._paused:
            self._synced += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """FSDP2's `set_requires_gradient_sync(False)` for the backwards inside: neither the
        reduce-scatter inside the worker nor the all-reduce across workers."""
        self._paused = True
        try:
            with fsdp_gradient_sync_paused(self.module):
                yield
        finally:
            self._paused = False

    def _all_reduce(self, grads: torch.Tensor) -> None:
        """FSDP2's hook, on each unit's reduce-scattered gradients: their mean across workers, in place."""
        if self._on and self._workers > 1:
            dist.all_reduce(grads, group=self._across)
            grads.div_(self._workers)

    def arm(self, on: bool) -> None:
        """Gradient all-reduce across workers on or off for the next backward."""
        if self.native and not on:
            raise ConfigError(
                "a model sharded with hybrid sharding all-reduces gradients across workers at every "
                "step: shard it on the worker's ranks only for a strategy with local steps"
            )
        self._on = on

    def book(self) -> bool:
        """After a step: whether its gradient shards were all-reduced across workers; their bytes
        once per backward that did (`GradientSync.book`)."""
        synced, self._synced = self._synced, 0
        if synced:
            self._ledger.count(self._purpose, self.bytes * synced, calls=synced)
        return self._on
