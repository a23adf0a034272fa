"""LocalSGD (spec §2): local steps; every H steps θ_m ← mean(θ_m)."""
from __future__ import annotations

from dataclasses import dataclass

from .base import check
from .periodic import Periodic


@dataclass
class LocalSGDOptions:
    sync_every: int = 8
    sync_optimizer_state: bool = False
    drift_telemetry: bool = True

    def __post_init__(self) -> None:
        check(self.sync_every >= 1, f"sync_every must be >= 1, got {self.sync_every}")


class LocalSGD(Periodic):
    name = "local_sgd"
    Options = LocalSGDOptions

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
        self.broadcast_initial_state()

    def boundary(self) -> None:
        avg, info = self.average_params()
        self.flat.scatter(avg)
        self.emit("sync", kind="average", **self.resolve_drift(info))
