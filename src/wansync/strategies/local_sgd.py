"""LocalSGD (Stich 2018, arXiv:1805.09767; Lin et al. 2020, arXiv:1808.07217): local steps; every H steps θ_m ← mean(θ_m)."""
from __future__ import annotations

from .periodic import Periodic


class LocalSGD(Periodic):
    name = "local_sgd"                   # options: Periodic's (H = 8)

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
        self.broadcast_initial_state()

    def boundary(self) -> None:
        avg, info = self.average_params()
        self.flat.scatter(avg)
        self.emit("sync", kind="average", **info)
