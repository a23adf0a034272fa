"""What every periodic strategy shares: the boundary schedule, parameter averaging with drift
telemetry, and optional inner-optimizer-state averaging.

Drift at a boundary is `mean_m ||θ_m − θ̄|| / ||θ̄||` (θ_m before averaging); it rises before the
K ≥ 16 collapse. The mean over workers rides as one extra element on the *next* boundary's
parameter exchange, so a sync event reports the previous boundary's drift (`drift_prev`) and
telemetry adds no collective; the last boundary's drift comes from one scalar exchange in
`finish()` (a "drift" record). `drift_telemetry=False` removes the element and that exchange.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.flat import FlatTensors
from .base import Strategy, sync_tensors
from .options import Options, option, sync_every


@dataclass
class PeriodicOptions(Options):
    """The knobs of every periodic strategy; with these defaults, LocalSGD's."""
    sync_every: int = sync_every(8)
    sync_optimizer_state: bool = option(False, "average the inner optimizer's state at every boundary")
    drift_telemetry: bool = option(True, "report worker drift at every boundary (rides on the next parameter exchange)")


def consume_distance(local: list[torch.Tensor], avg: list[torch.Tensor],
                     packed: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
    """‖θ_m − θ̄‖ from θ_m's own tensors and θ̄'s views, subtracting in place: no copy of θ_m and no
    temporaries (2-3x cheaper than a fresh difference buffer on CPU). `packed`: the same two as flat
    buffers, for one subtraction instead of one per tensor (the same bits). The norm is taken tensor
    by tensor either way, so the value does not depend on the layout (a resumed run reports the same
    bits). It leaves θ_m − θ̄ in `local`, which is why only `average_params` calls it: every
    boundary gives the model new values next."""
    if packed is not None:
        packed[0].sub_(packed[1])
    else:
        torch._foreach_sub_(local, avg)
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local))))


class Periodic(Strategy):
    """Local inner steps; `boundary()` every `opts.sync_every` steps."""
    Options = PeriodicOptions

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
        self.flat = FlatTensors(sync_tensors(self.module))
        # drift telemetry: this worker's ‖θ_m − θ̄‖ and ‖θ̄‖ at the last boundary (None: none yet)
        self._drift_dist, self._drift_avg_norm, self._drift_step = 0.0, None, 0

    def is_boundary(self, t: int) -> bool:
        return t % self.opts.sync_every == 0

    def exchanges_at(self, t: int) -> bool:
        return self.is_boundary(t)

    def after_inner_step(self) -> None:
        if self.is_boundary(self.t):
            self.boundary()

    def boundary(self) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        if not self.is_boundary(self.t):
            self.boundary()
        self.finish_drift()

    # ---- resumable state: the drift in flight rides along (telemetry only) -------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "drift": [self._drift_dist, self._drift_avg_norm, self._drift_step]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._drift_dist, self._drift_avg_norm, self._drift_step = state.get("drift", (0.0, None, 0))

    # ---- shared pieces ---------------------------------------------------------------------
    def average_params(self, wire: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """θ̄ = mean(θ_m) as a flat buffer and the sync event's fields. Call it while the model still
        holds θ_m, and overwrite the model afterwards (every boundary does): with drift telemetry,
        this worker's distance ‖θ_m − θ̄‖ is taken from the model in place, leaving garbage there.
        `wire`: a buffer of `wire_numel` elements the model does not live in, to gather θ_m into
        (None: a new one).

        With drift telemetry the buffer carries one more element, this worker's distance at the
        previous boundary, so the exchange reports `drift_prev` for that boundary at no extra
        collective (the values' sum is elementwise: the extra element changes none of its bits).
        ‖θ̄‖ is the exchange's non-finite check (`norm`), and the views the distance needs are built
        while the all-reduce runs, so telemetry costs one subtraction and one norm."""
        extra = self.wire_numel - self.flat.numel
        packed = self.flat.packed()                   # θ_m as one flat view when the model lies in one buffer
        local = [t.detach() for t in self.flat.tensors]
        pieces = [packed] if packed is not None else [t.reshape(-1) for t in local]
        if extra:
            pieces.append(torch.tensor([self._drift_dist], dtype=self.flat.dtype, device=self.flat.device))
        wire = torch.cat(pieces, out=wire) if wire is not None else torch.cat(pieces)
        sent = self.exchange.mean(wire, "params", async_op=True, inplace=True, extra=extra)
        buf = wire[:self.flat.numel]
        avg = self.flat.views(buf) if extra else []
        sent.wait()
        info: dict[str, Any] = {"bytes": self.flat.nbytes}
        if extra:
            if self._drift_avg_norm is not None:
                info["drift_prev"] = self.relative_drift(float(wire[-1]), self._drift_avg_norm)
            self._drift_dist = consume_distance(local, avg, (packed, buf) if packed is not None else None)
            self._drift_step, self._drift_avg_norm = self.t, sent.norm
        if getattr(self.opts, "sync_optimizer_state", False):
            self.average_optimizer_state()
        return buf, info

    @property
    def drift_on(self) -> bool:
        return bool(getattr(self.opts, "drift_telemetry", True))

    @property
    def wire_numel(self) -> int:
        """The parameter exchange's length: the values, plus the drift element with telemetry."""
        return self.flat.numel + (1 if self.drift_on else 0)

    @staticmethod
    def relative_drift(mean_dist: float, avg_norm: float) -> float:
        """mean_m ‖θ_m − θ̄‖ / ‖θ̄‖ (inf when θ̄ = 0)."""
        return mean_dist / avg_norm if avg_norm > 0 else math.inf

    def finish_drift(self) -> None:
        """Report the last boundary's drift, which no later exchange carries: one scalar mean
        (purpose `telemetry`) and a "drift" record."""
        if not self.drift_on or self._drift_avg_norm is None:
            return
        mean_dist = float(self.exchange.mean(torch.tensor([self._drift_dist], dtype=torch.float64),
                                             "telemetry").wait()[0])
        self.emit("drift", boundary=self._drift_step, drift=self.relative_drift(mean_dist, self._drift_avg_norm))
        self._drift_avg_norm = None

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

