"""What every periodic strategy shares: the boundary schedule, parameter averaging with drift
telemetry, and optional inner-optimizer-state averaging.

Drift is measured at every boundary *before* averaging:
`mean_m ||θ_m − θ̄|| / ||θ̄||`; it rises before the K ≥ 16 collapse. It costs one extra
8-byte all-reduce per boundary (purpose `telemetry`), which `drift_telemetry=False` removes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.flat import FlatTensors
from .base import Deferred, Strategy, sync_tensors
from .options import Options, option, sync_every


@dataclass
class PeriodicOptions(Options):
    """The knobs of every periodic strategy; with these defaults, LocalSGD's."""
    sync_every: int = sync_every(8)
    sync_optimizer_state: bool = option(False, "average the inner optimizer's state at every boundary")
    drift_telemetry: bool = option(True, "measure worker drift at every boundary (one 8-byte all-reduce)")


class Periodic(Strategy):
    """Local inner steps; `boundary()` every `opts.sync_every` steps."""
    Options = PeriodicOptions

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
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
        """θ̄ = mean(θ_m) as a flat buffer (parameters not yet overwritten) and the drift record.

        The drift's scalar all-reduce is issued asynchronously and waited for only after the
        caller has used θ̄ (`info["drift"]` is resolved by `resolve_drift`)."""
        buf = self.flat.gather()
        local = buf.clone() if self.drift_on else None
        self.exchange.mean(buf, "params", inplace=True)
        info: dict[str, Any] = {"bytes": buf.numel() * buf.element_size()}
        if local is not None:
            info["drift"] = self.start_drift(local, buf)
        if getattr(self.opts, "sync_optimizer_state", False):
            self.average_optimizer_state()
        return buf, info

    @property
    def drift_on(self) -> bool:
        return bool(getattr(self.opts, "drift_telemetry", True))

    def start_drift(self, local: torch.Tensor, avg: torch.Tensor) -> "Deferred":
        """Launch mean_m ||θ_m − θ̄|| (one async scalar all-reduce); divide by ||θ̄|| on resolve."""
        d = torch.dist(local, avg).reshape(1).double()
        pending = self.exchange.mean(d, "telemetry", async_op=True)
        avg_norm = float(torch.linalg.vector_norm(avg))
        return Deferred(lambda: float(pending.wait()[0]) / avg_norm if avg_norm > 0 else math.inf)

    @staticmethod
    def resolve_drift(info: dict[str, Any]) -> dict[str, Any]:
        """Replace a pending drift by its value (`emit` does this too)."""
        return {k: v.resolve() if isinstance(v, Deferred) else v for k, v in info.items()}

    def average_optimizer_state(self) -> None:
        """Average every floating-point tensor of the inner optimizer's state (momentum, Adam
        moments) in one flat exchange. Step counters stay as they are (they agree anyway)."""
        tensors = [v for st in self.optimizer.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0]
        if not tensors:
            return
        flat = FlatTensors(tensors)
        buf = flat.gather()
        self.exchange.mean(buf, "optim_state", inplace=True)
        flat.scatter(buf)

