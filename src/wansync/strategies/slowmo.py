"""SlowMo (Wang et al., ICLR 2020, arXiv:1910.00643): LocalSGD whose average passes through slow momentum.

Anchor θ̃ = parameters at the last sync, slow momentum u (zeros at start), slow learning rate α,
slow momentum β. Every H (`sync_every`) steps::

    θ̄ = mean(θ_m)
    u ← β·u + (θ̃ − θ̄) / η          # η: the inner learning rate at the boundary step
    θ̃ ← θ̃ − α·η·u
    θ_m ← θ̃                          # on every worker

`β = 0, α = 1` is LocalSGD. The filter is `Anchor.slowmo_step` (SGD, momentum β, lr α·η on the
gradient (θ̃ − θ̄)/η), which stays right when η changes between boundaries. The anchor covers
what LocalSGD averages: parameters and floating-point persistent buffers (BatchNorm statistics);
the slow momentum on buffers is the same filter on their averages, keeping replicas identical.
Inner optimizer state stays local unless `sync_optimizer_state`.

At a boundary where η = 0 (a warmup from 0; a schedule that reaches 0, read by `finish()`) the
filter takes its limit η → 0: θ̃ ← θ̃ − α·(θ̃ − θ̄) (the momentum's share α·η·β·u vanishes; at α = 1
the plain average), and u is kept (its increment (θ̃ − θ̄)/η has no limit).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import check
from .base import model_buffers, sync_tensors
from .catalog import SlowMoOptions
from .options import anchor_device
from .outer import Anchor
from .periodic import Periodic


class SlowMo(Periodic):
    name = "slowmo"
    Options = SlowMoOptions
    sync_kind = "slowmo"

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
        self.broadcast_initial_state()
        # θ̃ and u (the SGD momentum buffer, created at the first boundary: u starts at zero)
        self.anchor = Anchor(
            sync_tensors(self.module),
            lr=self.opts.slowmo_lr,
            momentum=self.opts.slowmo_beta,
            buffers=model_buffers(self.module),
            device=anchor_device(self.opts.outer_state_device),
        )

    def reference(self) -> torch.Tensor:
        """θ̃: every worker loads it at each boundary, so a lossy exchange sends θ_m − θ̃ = −Δ_m."""
        return self.anchor.value

    def keep_reference(self) -> None:
        """Nothing to keep: the anchor is the reference."""

    def boundary(self) -> None:
        avg, info = self.average_params()  # θ̄ = mean(θ_m)
        self.slowmo_update(avg)  # u, θ̃, and θ_m ← θ̃
        self.emit("sync", kind=self.sync_kind, **info, **self.boundary_fields())

    def slowmo_update(self, avg) -> None:
        """u ← β·u + (θ̃ − θ̄)/η ; θ̃ ← θ̃ − α·η·u  (η: the inner learning rate now); θ_m ← θ̃.
        At η = 0 (a warmup from 0, a schedule that ends at 0 before `finish()`) the filter takes its
        limit: θ̃ ← θ̃ − α·(θ̃ − θ̄), u kept (`Anchor.slowmo_limit`)."""
        eta = self.inner_lr
        check(
            eta >= 0,
            f"{self.name} needs an inner learning rate >= 0 at a boundary (the filter divides "
            f"by it), got {eta} at step {self.t}",
        )
        if eta == 0:
            self.anchor.slowmo_limit(avg, self.opts.slowmo_lr, load=True)
        else:
            self.anchor.slowmo_step(avg, eta, self.opts.slowmo_lr, load=True)  # θ̃ − θ̄ formed in θ̄'s buffer

    def boundary_fields(self) -> dict[str, Any]:
        """Extra fields of the sync event (subclasses add theirs)."""
        return {"inner_lr": self.inner_lr}

    # ---- resumable state: θ̃ and u (the counter t is the base class's) -------------------------
    def extra_state(self) -> dict[str, Any]:
        return {"anchor": self.anchor.state_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.anchor.load_state_dict(state["anchor"])
