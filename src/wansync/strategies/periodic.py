"""What every periodic strategy shares: the boundary schedule, parameter averaging with drift
telemetry, and optional inner-optimizer-state averaging.

Drift at a boundary is `mean_m ||θ_m − θ̄|| / ||θ̄||` (θ_m before averaging); it rises before the
K ≥ 16 collapse. Its means over workers ride as three extra elements on the *next* boundary's
parameter exchange (`DRIFT_SIDE_BAND`), so a sync event reports the previous boundary's drift
(`drift_prev`) and telemetry adds no collective; the last boundary's drift comes from one small
exchange in `finish()` (a "drift" record). `drift_telemetry=False` removes the elements and that
exchange.

‖θ̄‖ is not measured on θ̄ (one more pass over the parameters after the exchange): each worker
measures ‖θ_m‖² while its exchange is on the wire, and since θ̄ is the workers' mean,
‖θ̄‖² = mean_m ‖θ_m‖² − mean_m ‖θ_m − θ̄‖² exactly (the parallel-axis identity, without
cancellation: the distances are small next to the norms).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.exchange import PAIRED_DISTANCE_MAX
from ..comm.flat import FlatTensors
from .base import Strategy, sync_tensors
from .options import Options, option, sync_every


# the side band a boundary's exchange carries for the previous one: ‖θ_m − θ̄‖, and ‖θ_m‖² and
# ‖θ_m − θ̄‖² per element (in range for the buffer's dtype, even float16)
DRIFT_SIDE_BAND = 3


@dataclass
class PeriodicOptions(Options):
    """The knobs of every periodic strategy; with these defaults, LocalSGD's."""
    sync_every: int = sync_every(8)
    sync_optimizer_state: bool = option(False, "average the inner optimizer's state at every boundary")
    drift_telemetry: bool = option(True, "report worker drift at every boundary (rides on the next parameter exchange)")


class Periodic(Strategy):
    """Local inner steps; `boundary()` every `opts.sync_every` steps."""
    Options = PeriodicOptions

    # with drift telemetry a boundary's mean lands in a second buffer, which becomes the model's
    # home while the first, still holding θ_m, is consumed measuring ‖θ_m − θ̄‖: whether that spare
    # is kept between boundaries (P bytes held, no fresh memory per boundary; allocated beside the
    # home, so the distance is one fused pass) or allocated at each (strategies whose peak already
    # holds a transient P)
    keeps_spare = False

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
        self.flat = FlatTensors(sync_tensors(self.module))
        # drift telemetry: this worker's ‖θ_m − θ̄‖ and ‖θ_m‖² at the last boundary (None: none yet)
        self._drift_dist, self._drift_sq, self._drift_step = 0.0, None, 0
        self._home: torch.Tensor | None = None
        self._home_ptrs: list[int] = []       # where the model's tensors lie when they live in _home
        self._home_views: list[torch.Tensor] = []
        self._spare: torch.Tensor | None = None
        self._spare_views: list[torch.Tensor] = []

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
        return {**super().state_dict(), "drift_side": [self._drift_dist, self._drift_sq, self._drift_step]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "drift_side" in state:
            self._drift_dist, self._drift_sq, self._drift_step = state["drift_side"]
        else:                       # a checkpoint from before the side band: [‖θ_m − θ̄‖, ‖θ̄‖, step]
            self._drift_dist, avg_norm, self._drift_step = state.get("drift", (0.0, None, 0))
            self._drift_sq = None if avg_norm is None else avg_norm ** 2 + self._drift_dist ** 2

    # ---- shared pieces ---------------------------------------------------------------------
    def home(self) -> torch.Tensor | None:
        """The flat buffer of `wire_numel` elements whose first P the model's tensors live in (they
        move there at the first boundary, as torch's averager re-points them): a boundary averages
        it in place, so θ_m is never gathered and θ̄ lands where the model reads it. None when a
        tensor cannot move (a non-contiguous one keeps its layout, `FlatTensors.adopt`)."""
        if self._home is not None and all(t.data_ptr() == p for t, p in zip(self.flat.tensors, self._home_ptrs)):
            return self._home
        if not all(t.is_contiguous() for t in self.flat.tensors):
            return None
        if self.keeps_spare and self.drift_on and self._spare is None and self.wire_numel <= PAIRED_DISTANCE_MAX:
            # home and spare as the two rows of one block: the distance between them is one fused
            # pass (`exchange.distance_of`, for buffers short enough for it; longer ones are two
            # allocations, so that torch.save of the model's state does not write the spare too)
            home, self._spare = torch.empty(2, self.wire_numel, dtype=self.flat.dtype, device=self.flat.device)
            self._spare_views = self.flat.views(self._spare[:self.flat.numel])
        else:
            home = torch.empty(self.wire_numel, dtype=self.flat.dtype, device=self.flat.device)
        torch.cat([t.detach().reshape(-1) for t in self.flat.tensors], out=home[:self.flat.numel])
        self._move_home(home)
        return home

    def _move_home(self, home: torch.Tensor, views: list[torch.Tensor] | None = None) -> None:
        views = views or self.flat.views(home[:self.flat.numel])
        self.flat.adopt(home[:self.flat.numel], views)
        self._home, self._home_views, self._home_ptrs = home, views, [t.data_ptr() for t in self.flat.tensors]

    def average_params(self) -> tuple[torch.Tensor, dict[str, Any]]:
        """θ̄ = mean(θ_m) as a flat buffer, and the sync event's fields. The buffer is the model's
        home (`home`): the model holds θ̄ when this returns, and a strategy that gives it other
        values next writes them there (`FlatTensors.scatter` is one copy).

        With drift telemetry the buffer carries the previous boundary's side band (`drift_side`),
        so the exchange reports `drift_prev` for that boundary at no extra collective (the values'
        sum is elementwise: the extra elements change none of its bits). The distance ‖θ_m − θ̄‖
        needs θ_m after the exchange, so the mean lands in a second buffer (`Exchange.mean(out=)`:
        the division before the collective writes it there, no copy of θ_m), which becomes the
        model's home, and the first is consumed measuring the distance; ‖θ_m‖² is measured while
        the exchange is on the wire."""
        extra, n = self.wire_numel - self.flat.numel, self.flat.numel
        home = self.home()
        if home is not None:
            wire = home
        else:                                         # tensors that stay where they are: gather them
            wire = torch.empty(self.wire_numel, dtype=self.flat.dtype, device=self.flat.device)
            torch.cat([t.detach().reshape(-1) for t in self.flat.tensors], out=wire[:n])
        if extra:
            wire[n:] = torch.tensor(self.drift_side(), dtype=wire.dtype)
            out = self._spare if self._spare is not None else torch.empty_like(wire)
            sent = self.exchange.mean(wire, "params", out=out, extra=extra)
            if home is not None:
                old_views = self._home_views
                self._move_home(out, self._spare_views if out is self._spare else None)
                if self.keeps_spare:
                    self._spare, self._spare_views = home, old_views
        else:
            out = wire
            sent = self.exchange.mean(wire, "params", inplace=True)
        buf = out[:n]
        info: dict[str, Any] = {"bytes": self.flat.nbytes}
        if extra:
            if self._drift_sq is not None:
                info["drift_prev"] = self.relative_drift(*out[n:].tolist())
            self._drift_dist, self._drift_sq, self._drift_step = sent.distance, sent.values_sq, self.t
        if home is None:
            self.flat.scatter(buf)                    # the model holds θ̄, as with a home
        if getattr(self.opts, "sync_optimizer_state", False):
            self.average_optimizer_state()
        return buf, info

    @property
    def drift_on(self) -> bool:
        return bool(getattr(self.opts, "drift_telemetry", True))

    @property
    def wire_numel(self) -> int:
        """The parameter exchange's length: the values, plus the drift side band with telemetry."""
        return self.flat.numel + (DRIFT_SIDE_BAND if self.drift_on else 0)

    def drift_side(self) -> list[float]:
        """This worker's side band for the last boundary: ‖θ_m − θ̄‖, ‖θ_m‖²/P, ‖θ_m − θ̄‖²/P
        (zeros before the first)."""
        d, n = self._drift_dist, max(self.flat.numel, 1)
        return [d, (self._drift_sq or 0.0) / n, d * d / n]

    def relative_drift(self, mean_dist: float, mean_sq: float, mean_dist_sq: float) -> float:
        """mean_m ‖θ_m − θ̄‖ / ‖θ̄‖ from the side band's means: ‖θ̄‖² = mean_m ‖θ_m‖² − mean_m
        ‖θ_m − θ̄‖² (inf when θ̄ = 0)."""
        avg_sq = (mean_sq - mean_dist_sq) * max(self.flat.numel, 1)
        return mean_dist / math.sqrt(avg_sq) if avg_sq > 0 else math.inf

    def finish_drift(self) -> None:
        """Report the last boundary's drift, which no later exchange carries: one mean of the side
        band (purpose `telemetry`) and a "drift" record."""
        if not self.drift_on or self._drift_sq is None:
            return
        side = self.exchange.mean(torch.tensor(self.drift_side(), dtype=torch.float64), "telemetry").wait()
        self.emit("drift", boundary=self._drift_step, drift=self.relative_drift(*side.tolist()))
        self._drift_sq = None

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

