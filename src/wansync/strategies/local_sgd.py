"""LocalSGD (Stich 2018, arXiv:1805.09767; Lin et al. 2020, arXiv:1808.07217): local steps; every H steps θ_m ← mean(θ_m).

The model lives in one flat buffer (`Periodic.home`; its tensors re-pointed to views of it at the
first boundary, as torch's `PeriodicModelAverager` does), and a boundary averages that buffer in
place: no gather, no copy back, no fresh memory. With drift telemetry the mean lands in a second
buffer and the model moves there, the two taking turns boundary after boundary (P held: fresh
memory costs a page fault per 4 KiB on CPU, more than a pass over it).
"""

from __future__ import annotations

from .periodic import Periodic


class LocalSGD(Periodic):
    name = "local_sgd"  # options: Periodic's (H = 8)

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
        self.broadcast_initial_state()

    def boundary(self) -> None:
        _, info = self.average_params()  # θ_m ← θ̄, in the model's own buffer
        self.emit("sync", kind="average", **info)
