"""DiLoCo (Douillard et al. 2023, arXiv:2311.08105): local inner optimizer, outer Nesterov SGD on the
averaged pseudo-gradient every H steps.

The inner optimizer is whatever the user passes (the trainer's default is AdamW, as in the paper);
its state stays local unless `sync_optimizer_state`. At each boundary::

    Δ̄ = mean(θ̃ − θ_m)
    θ̃ ← OuterOpt(θ̃, grad = Δ̄)        # SGD, Nesterov, lr 0.7, momentum 0.9
    θ_m ← θ̃

We exchange θ_m (the same bytes as Δ_m) through the periodic average every strategy shares, and
form Δ̄ = θ̃ − θ̄: the same quantity as mean(θ̃ − θ_m) up to float rounding, computed once instead
of on every worker, with the drift telemetry for free. Outer SGD with lr 1 and momentum 0 gives
θ̃ = θ̄: LocalSGD (tested).

Default H = 100, not the paper's 500: the paper's 500 sits in runs of ~88k inner steps, where it
still gives ~175 outer steps; our runs are hundreds to a few thousand steps (the default budget is
300), where H = 500 would mean no outer step at all. 100 is Streaming DiLoCo's default (arXiv:2501.18512)
and the CoCoDC setting, so DiLoCo and its streaming variants compare at equal H out of the box.
Pass `sync_every=500` for the paper's setting.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


from .base import model_buffers, sync_tensors
from .options import anchor_device, outer_lr, outer_momentum, outer_state_device, sync_every
from .outer import Anchor
from .periodic import Periodic, PeriodicOptions


@dataclass
class DiLoCoOptions(PeriodicOptions):
    """The periodic knobs with H = 100, plus the outer optimizer's."""
    sync_every: int = sync_every(100)
    outer_lr: float = outer_lr()
    outer_momentum: float = outer_momentum()
    outer_state_device: str = outer_state_device()


class DiLoCo(Periodic):
    name = "diloco"
    Options = DiLoCoOptions

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
        self.broadcast_initial_state()
        self.anchor = Anchor(sync_tensors(self.module), lr=self.opts.outer_lr, momentum=self.opts.outer_momentum,
                             nesterov=True, buffers=model_buffers(self.module),
                             device=anchor_device(self.opts.outer_state_device))

    def reference(self) -> torch.Tensor:
        """θ̃: every worker loads it at each boundary, so a lossy exchange sends θ_m − θ̃ = −Δ_m."""
        return self.anchor.value

    def keep_reference(self) -> None:
        """Nothing to keep: the anchor is the reference."""

    def boundary(self) -> None:
        avg, info = self.average_params()                 # θ̄ = mean(θ_m)
        # Δ̄ = mean(θ̃ − θ_m) = θ̃ − θ̄, in θ̄'s buffer; θ̃ ← OuterOpt(θ̃, Δ̄); θ_m ← θ̃: one pass
        self.anchor.step_to_average(avg, load=True)
        self.emit("sync", kind="outer", **info)

    # ---- resumable state: θ̃ and the outer optimizer's momentum -----------------------------
    def extra_state(self) -> dict[str, Any]:
        return {"anchor": self.anchor.state_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.anchor.load_state_dict(state["anchor"])
