"""The base class every synchronization strategy is built on.

It owns what all algorithms share: the inner step, the step counter, the event stream
(sync events become records in metrics.jsonl), the exchange of model state (`self.exchange`,
whose ledger is `self.comm`), and the resumable state. A concrete strategy supplies only what
differs: what it exchanges after the inner step (`after_inner_step`), which module the user calls
(`model`), and its extra state.

The user loop is always::

    loss = loss_fn(sync.model(batch)); loss.backward(); sync.step(); sync.zero_grad()
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ..comm.exchange import Exchange
from ..comm.flat import FlatTensors
from ..comm.ledger import INSIDE
from ..comm.replicas import Replicas
from ..errors import ConfigError, PeerError
from .grad_sync import GradientSync
from .options import Options

JOIN_TIMEOUTS = 3          # fault-tolerant start-up: the others get this many --peer-timeout to arrive
QUORUM = "quorum"          # ledger purpose: the time fault-tolerant workers wait in a slot's quorum
JOIN_POLL_S = 0.2          # between start-up quorums that came back short of workers


def sync_tensors(module: nn.Module) -> list[torch.Tensor]:
    """What parameter averaging exchanges: parameters plus floating-point persistent buffers
    (BatchNorm statistics), so that averaged replicas are really identical."""
    tensors: list[torch.Tensor] = [p for p in module.parameters()]
    persistent = set(module.state_dict(keep_vars=True).keys())
    for name, b in module.named_buffers():
        if name in persistent and b.is_floating_point():
            tensors.append(b)
    return tensors


class Strategy:
    name: ClassVar[str] = ""
    Options: ClassVar[type[Options]] = Options
    steps_inside_workers: ClassVar[bool] = True     # False: every step all-reduces over every rank (DDP)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, options: Any = None, *,
                 group: Any = None, on_nonfinite: str | None = None, replicas: Replicas | None = None):
        """`on_nonfinite`: None, "abort" or "skip", what the exchange does with a NaN/Inf in this
        worker's model state (see `comm.exchange`). `replicas`: this rank's place in a worker of
        several ranks (`comm.replicas`; None: every rank is a worker); its ranks train one model
        with DDP over the worker's own group, and the exchange runs between workers."""
        if not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialized: call wansync.init() or "
                              "torch.distributed.init_process_group() first")
        self.module = model
        self.optimizer = optimizer
        self.opts = options if options is not None else self.Options()
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.t = 0                       # inner steps taken
        self.last_inner_s = 0.0          # time of the last inner optimizer step (profiler: compute)
        self.since_last_step_s: float | None = None   # end of the previous step() to this one's start
        self._left_step_at: float | None = None
        self.replicas = replicas if replicas is not None else Replicas()
        self.exchange = Exchange(group, on_nonfinite, self.replicas)
        self.comm = self.exchange.ledger
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self.inside_sync = None
        if self.replicas.sharded and self.steps_inside_workers:
            self.inside_sync = GradientSync(model, self.replicas.inside, self.comm, purpose=INSIDE + "grads")

    # ---- the user's view -------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The module to call forward on (a DDP wrapper for gradient-synchronizing strategies, and
        inside a worker of several ranks)."""
        return self.inside_sync.ddp if self.inside_sync is not None and self.inside_step(self.t + 1) else self.module

    def inside_step(self, t: int) -> bool:
        """Does step t (1-based) all-reduce gradients inside the worker only? (Not when the
        strategy all-reduces them over every rank then.)"""
        return True

    def step(self, skip_inner: bool = False) -> None:
        """Inner optimizer step, then whatever synchronization is due at the new step count.

        `skip_inner` drops this worker's inner update (a non-finite gradient under
        `--on-nonfinite skip`) while keeping the schedule, so every rank issues the same
        collectives. Records the time spent outside `step()` since the previous one (forward,
        backward, data: `since_last_step_s`, None on the first) and in the inner step."""
        entered = time.perf_counter()
        if self._left_step_at is not None:
            self.since_last_step_s = entered - self._left_step_at
        if not skip_inner:
            self.optimizer.step()
        self.last_inner_s = time.perf_counter() - entered
        if self.inside_sync is not None and self.inside_step(self.t + 1):
            self.inside_sync.book()
        self.t += 1
        if self.exchange.ft is not None and self.exchanges_at(self.t):
            self.meet_quorum()                        # may heal this worker from a peer (ft.quorum)
        if not self.healed_into_final_quorum():
            self.after_inner_step()
        self._left_step_at = time.perf_counter()

    def meet_quorum(self, finishing: bool = False) -> None:
        """Fault-tolerant runs: the quorum of this step's slot (`finishing`: of the final
        synchronization); the time spent in it (waiting for the others, healing) is booked as a
        wait on the ledger under `quorum` (exposed communication)."""
        t0 = time.perf_counter()
        self.exchange.ft.quorum(self.t, left_out_is_fatal=True, finishing=finishing)
        self.exchange.ledger.waited(QUORUM, time.perf_counter() - t0)

    def meet_final_quorum(self) -> None:
        """Fault-tolerant runs, before `finish`: the quorum its exchanges run in, where a worker
        still behind heals; none for a worker that healed into it (it met it already)."""
        if self.exchange.ft is not None and not self.exchange.ft.finishing:
            self.meet_quorum(finishing=True)

    def healed_into_final_quorum(self) -> bool:
        """Did this worker heal from peers in their final quorum? It then holds their state after
        the last step's exchanges: it makes none of them again, and goes on to `finish` with them."""
        return self.exchange.ft is not None and self.exchange.ft.finishing

    def join(self, expected: int = 1) -> None:
        """Fault-tolerant runs, before the first step: meet the others at their next quorum
        (at the start of a run, until `expected` workers are in it); a worker that started late
        (restarted) heals there to their step and takes part in that step's exchanges with them.
        A worker gives up (PeerError, one line) when the others have not all arrived within
        JOIN_TIMEOUTS x the quorum timeout (--peer-timeout); a quorum call that times out meanwhile
        is retried (the others may still be starting on a loaded machine)."""
        t, ft = self.t, self.exchange.ft
        deadline = time.monotonic() + JOIN_TIMEOUTS * ft.timeout_s
        while True:
            try:
                ft.quorum(t)
                if self.t != t or ft.participants >= expected:
                    break
            except PeerError:
                if time.monotonic() >= deadline:
                    raise
                continue
            if time.monotonic() >= deadline:
                raise PeerError(f"only {ft.participants} of {expected} workers joined the fault-tolerant run within "
                                f"{JOIN_TIMEOUTS} x --peer-timeout ({JOIN_TIMEOUTS * ft.timeout_s:g} s)")
            time.sleep(JOIN_POLL_S)           # the others are not heartbeating yet: no busy loop
        if self.t != t:
            if not self.healed_into_final_quorum():
                self.after_inner_step()
            self._left_step_at = time.perf_counter()

    def exchanges_at(self, t: int) -> bool:
        """Does step t (after its inner step) exchange between workers? Fault-tolerant runs take a
        quorum there."""
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def finish(self) -> None:
        """Bring every rank to the same final parameters (a last sync if one is due)."""

    # ---- for subclasses ----------------------------------------------------------------
    def after_inner_step(self) -> None:
        """Synchronize if step `self.t` calls for it."""

    @property
    def inner_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def broadcast_initial_state(self) -> None:
        """Start every replica from rank 0's parameters and buffers (one flat broadcast)."""
        flat = FlatTensors(sync_tensors(self.module))
        buf = flat.gather()
        self.exchange.broadcast(buf)
        flat.scatter(buf)

    # ---- events --------------------------------------------------------------------------
    def on_event(self, fn: Callable[[dict[str, Any]], None]) -> None:
        self._listeners.append(fn)

    def emit(self, record_type: str, /, **fields: Any) -> None:
        record = {"type": record_type, "step": self.t, "strategy": self.name, **fields}
        if self.exchange.ft is not None and record_type == "sync":
            record.setdefault("participants", self.exchange.ft.participants)
        for fn in self._listeners:
            fn(record)

    # ---- resumable state -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "options": dataclasses.asdict(self.opts), **self.extra_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t = int(state["t"])
        self.load_extra_state(state)

    def heal_state(self) -> dict[str, Any]:
        """What a worker healing from this one receives (fault-tolerant runs): the resumable state."""
        return self.state_dict()

    def load_heal_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state)

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass
