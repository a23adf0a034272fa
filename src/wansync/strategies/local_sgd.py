"""LocalSGD (Stich 2018, arXiv:1805.09767; Lin et al. 2020, arXiv:1808.07217): local steps; every H steps θ_m ← mean(θ_m).

The model ends a boundary living in the averaged buffer (its tensors re-pointed to views of it, as
torch's `PeriodicModelAverager` does), so nothing is copied back. Two such buffers take turns: the
next boundary gathers θ_m into the one the model left, so a boundary allocates nothing (fresh
memory costs a page fault per 4 KiB on CPU, more than the copy itself) at the price of holding
that one spare buffer (P) between boundaries.
"""
from __future__ import annotations

import torch

from .periodic import Periodic


class LocalSGD(Periodic):
    name = "local_sgd"                   # options: Periodic's (H = 8)

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
        self.broadcast_initial_state()
        # the buffer the model was re-pointed to at the last boundary, and the one before it (free)
        self._home: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None

    def boundary(self) -> None:
        wire = self._spare if self._spare is not None else \
            torch.empty(self.wire_numel, dtype=self.flat.dtype, device=self.flat.device)
        avg, info = self.average_params(wire)
        self.flat.adopt(avg)                                  # θ_m ← θ̄ without a copy back
        self._spare, self._home = self._home, wire
        self.emit("sync", kind="average", **info)
