"""CPDP, controlled periodic data parallelism (Ettifouri et al. 2026, arXiv:2607.21224).

Workers take K − 1 local steps with gradient sync disabled (DDP `no_sync()`), then one
reconciliation step. At every step t with t mod K == 0::

    1. backward with gradient sync on:  g = mean(∇L_m)       # phase 1: gradient all-reduce (DDP)
    2. inner optimizer step with g on every worker           # synchronized step (params still differ)
    3. θ̄ = mean(θ_m)                                         # phase 2: parameter averaging
    4. u ← β·u + (θ̃ − θ̄)/η ;  θ̃ ← θ̃ − α·η·u                 # SlowMo filter on the average
    5. θ_m ← θ̃                                               # exact equality restored

Steps 3–5 are SlowMo's boundary (Wang et al. 2020, arXiv:1910.00643), so CPDP is SlowMo plus
phase 1, and this class is `SlowMo` plus the gradient phase DDP uses (`grad_sync.py`). Optimizer
states stay local (unless `sync_optimizer_state`). Defaults from the paper: K = 4, β = 0.3, α = 1.

How phase 1 is switched: `sync.model` is PyTorch's real `DistributedDataParallel`, and the user
calls it (forward, backward) *before* `sync.step()`, so the phase is armed for the *next* step: at
construction (for step 1) and at the end of every `step()` (for step t + 1): on iff t + 1 is a
boundary and `grad_phase`. DDP is built with `broadcast_buffers=False`, because otherwise it would
broadcast the buffers at every forward, local steps included; buffers are averaged with the
parameters at boundaries instead.

The reviewers' ablations are options, not copies:
- `grad_phase=False`: no gradient all-reduce — LocalSGD+SlowMo (equal to `slowmo` with the
  same K, β, α; tested);
- `slowmo_beta=0`: gradient all-reduce + plain LocalSGD averaging.
Identity: K = 1, β = 0 (α = 1) is DDP (tested to 1e-6).

A final `finish()` off a boundary reconciles the parameters (phase 2 only: that step's backward
has already run without gradient sync).
"""

from __future__ import annotations

from typing import Any

from .catalog import CPDPOptions
from .grad_sync import gradient_phase
from .periodic import PeriodicTimetable
from .slowmo import SlowMo


class CPDPTimetable(PeriodicTimetable):
    """SlowMo's boundaries, each starting with phase 1, the gradient all-reduce (unless ablated)."""

    def ddp_step(self, t: int) -> bool:
        return bool(self.opts.grad_phase) and self.is_boundary(t)


class CPDP(SlowMo):
    name = "cpdp"
    Options, Timetable = CPDPOptions, CPDPTimetable
    sync_kind = "cpdp"

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
        self.grad_sync = gradient_phase(model, self.group, self.comm, self.replicas, broadcast_buffers=False)
        self.grads_synced = False  # did the step just taken all-reduce its gradients?
        self.grad_sync.arm(self.timetable.ddp_step(self.t + 1))

    @property
    def model(self):
        """The all-rank DDP wrapper (its gradient phase armed at boundaries); in a worker of
        several ranks, local steps go through the worker's own DDP instead."""
        if self.inside_sync is not None and self.inside_step(self.t + 1):
            return self.inside_sync.ddp
        return self.grad_sync.module

    def after_inner_step(self) -> None:
        # steps 1–2 have happened: DDP all-reduced g in backward (if armed), then the inner step
        self.grads_synced = self.grad_sync.book()
        super().after_inner_step()  # steps 3–5 at a boundary (SlowMo's)
        self.grad_sync.arm(self.timetable.ddp_step(self.t + 1))

    def boundary_fields(self) -> dict[str, Any]:
        return {
            **super().boundary_fields(),
            "grad_phase": self.grads_synced,
            "grad_bytes": self.grad_sync.bytes if self.grads_synced else 0,
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        super().load_extra_state(state)
        self.grad_sync.arm(self.timetable.ddp_step(self.t + 1))
