"""What every periodic strategy shares: the boundary schedule, parameter averaging with drift
telemetry, and optional inner-optimizer-state averaging (spec §8).

Drift (spec §8) is measured at every boundary *before* averaging:
`mean_m ||θ_m − θ̄|| / ||θ̄||`; it rises before the K ≥ 16 collapse. It costs one extra
8-byte all-reduce per boundary (purpose `telemetry`), which `drift_telemetry=False` removes.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..comm.flat import FlatTensors
from ..comm.ledger import all_reduce_mean
from .base import Strategy, sync_tensors


class Periodic(Strategy):
    """Local inner steps; `boundary()` every `opts.sync_every` steps."""

    def __init__(self, model, optimizer, options=None, *, group=None):
        super().__init__(model, optimizer, options, group=group)
        self.flat = FlatTensors(sync_tensors(self.module))

    def is_boundary(self, t: int) -> bool:
        return t % self.opts.sync_every == 0

    def after_inner_step(self) -> None:
        if self.is_boundary(self.t):
            self.boundary()

    def boundary(self) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        if not self.is_boundary(self.t):
            self.boundary()

    # ---- shared pieces ---------------------------------------------------------------------
    def average_params(self) -> tuple[torch.Tensor, dict[str, Any]]:
        """θ̄ = mean(θ_m) as a flat buffer (parameters not yet overwritten) and the drift record."""
        local = self.flat.gather()
        avg = local.clone()
        all_reduce_mean(avg, self.comm, "params", self.group)
        info: dict[str, Any] = {"bytes": avg.numel() * avg.element_size()}
        if getattr(self.opts, "drift_telemetry", True):
            info["drift"] = self.drift(local, avg)
        if getattr(self.opts, "sync_optimizer_state", False):
            self.average_optimizer_state()
        return avg, info

    def drift(self, local: torch.Tensor, avg: torch.Tensor) -> float:
        """mean_m ||θ_m − θ̄|| / ||θ̄|| (one scalar all-reduce)."""
        d = torch.stack([(local - avg).norm().double()])
        all_reduce_mean(d, self.comm, "telemetry", self.group)
        denom = float(avg.double().norm())
        return float(d[0]) / denom if denom > 0 else math.inf

    def average_optimizer_state(self) -> None:
        """Average every floating-point tensor of the inner optimizer's state (momentum, Adam
        moments) in one flat exchange. Step counters stay as they are (they agree anyway)."""
        tensors = [v for st in self.optimizer.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0]
        if not tensors:
            return
        flat = FlatTensors(tensors)
        buf = flat.gather()
        all_reduce_mean(buf, self.comm, "optim_state", self.group)
        flat.scatter(buf)
