"""What every periodic strategy shares: the boundary schedule, parameter averaging with drift
telemetry, and optional inner-optimizer-state averaging.

Drift at a boundary is the workers' RMS distance from their mean, relative to it,
`sqrt(mean_m ‖θ_m − θ̄‖²) / ‖θ̄‖` (θ_m before averaging; the consensus distance of Kong et al. 2021,
arXiv:2102.04828); it rises before the K ≥ 16 collapse. It costs no collective and no second
buffer: by the parallel-axis identity, mean_m ‖θ_m − θ̄‖² = mean_m ‖θ_m‖² − ‖θ̄‖² for θ̄ the mean,
so each worker measures ‖θ_m‖² before its exchange, sends it as one extra element of the parameter
buffer (`DRIFT_SIDE_BAND`), and the exchange, averaging in place, returns its mean beside θ̄, whose
‖θ̄‖² the mean's non-finite check measures anyway. The sync event reports that boundary's `drift`.
`drift_telemetry=False` removes the element and the float64 accumulation.

Both norms are accumulated in float64 (`exact_sq_norm`): their difference is drift² of their size,
~1e-5 at a drift of 3e-3, where a float32 dot of a million values is off by ~1e-6. The element
carries ‖θ_m‖² less the previous boundary's ‖θ̄‖² (the same on every worker), per value: the
float32 sum across workers then rounds a small number, not the whole norm. What the identity does
not see is θ̄'s own float32 rounding, a relative error in the drift of about
2⁻²⁴ / (√P · drift²): 3e-6 at P = 1.8M and drift 3e-3, 0.5 % at drift 1e-4.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..comm.norms import exact_sq_norm
from ..comm.codecs import get_codec
from ..comm.flat import FlatTensors
from .base import Strategy, local_shard, sync_tensors
from .catalog import PeriodicOptions
from .timetable import Timetable


# the side band a boundary's exchange carries: (‖θ_m‖² − ‖θ̄_prev‖²) / P, per value so that it stays
# in range for the buffer's dtype, even float16
DRIFT_SIDE_BAND = 1


class PeriodicTimetable(Timetable):
    """A boundary every H steps, the only steps that exchange; `finish()` averages once more after
    a step that was not one. H may change at a boundary (`retime`, `--adapt`): the rounds then count
    from there."""

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        self.origin = 0  # the boundary from which rounds of the current H count

    def is_boundary(self, t: int) -> bool:
        return t > self.origin and (t - self.origin) % self.opts.sync_every == 0

    def round_step(self, t: int) -> int:
        """Step t's place in its round (0 at a boundary)."""
        return (t - self.origin) % self.opts.sync_every

    def retime(self, t: int, sync_every: int) -> None:
        """From boundary t on, a boundary every `sync_every` steps."""
        self.origin, self.opts.sync_every = t, sync_every

    def exchanges_at(self, t: int) -> bool:
        return self.is_boundary(t)

    def final_sync(self, t: int) -> bool:
        return not self.is_boundary(t)


class Periodic(Strategy):
    """Local inner steps; `boundary()` at the timetable's boundaries (every `opts.sync_every` steps)."""

    Options, Timetable = PeriodicOptions, PeriodicTimetable

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
        self.flat = FlatTensors(sync_tensors(self.module))
        # drift telemetry: ‖θ̄‖² at the last boundary (or of the broadcast initial state), the same on
        # every worker: the reference the side band subtracts (None: none yet, the reference is 0)
        self._ref_sq: float | None = None
        self._home: torch.Tensor | None = None
        self._home_ptrs: list[int] = []  # where the model's tensors lie when they live in _home
        self.codec = get_codec(self.opts.codec)
        self._last_mean: torch.Tensor | None = None  # lossy codec without an anchor: θ̄ of the last average
        self._residual: torch.Tensor | None = None  # error feedback: what the codec dropped last time
        self._computed_at = 0  # steps computed at the last boundary (`pace`)

    def after_inner_step(self) -> None:
        if self.timetable.is_boundary(self.t):
            self.round_boundary()

    def finish(self) -> None:
        if self.timetable.final_sync(self.t):
            self.boundary()

    def broadcast_initial_state(self) -> None:
        super().broadcast_initial_state()
        if self.drift_on:  # the first boundary's reference: every worker holds rank 0's
            self._ref_sq = exact_sq_norm(self.flat.gather())
        if self.needs_reference:
            self.keep_reference()

    @property
    def needs_reference(self) -> bool:
        """Does a boundary measure each worker's change from a reference (`reference`)? A lossy codec
        sends the change, and a robust mean clips it (`comm.robust`)."""
        return self.codec.name != "fp32" or self.exchange.robust is not None

    def origin(self) -> torch.Tensor | None:
        """What a parameter mean's pseudo-gradients are measured from (θ_m − origin is −Δ_m): the
        reference where one is kept, an anchor θ̃ or the last mean; None where none is (LocalSGD's
        plain fp32 mean, without a robust mean)."""
        kept = getattr(self, "anchor", None) is not None or self._last_mean is not None
        return self.reference() if kept else None

    def keep_reference(self) -> None:
        """The lossy codec's reference θ_ref, identical on every worker: the model as it is now."""
        self._last_mean = self.flat.gather()

    def reference(self) -> torch.Tensor:
        """What a lossy exchange measures the workers' change from: the parameters every worker held
        after the last synchronization (the anchor θ̃ where the strategy keeps one)."""
        assert self._last_mean is not None
        return self._last_mean

    # ---- resumable state: the drift's reference rides along (telemetry only) ------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "drift_ref": self._ref_sq,
            "last_mean": self._last_mean,
            "residual": self._residual,
            **({"computed_at": self._computed_at} if self.pace.active else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._ref_sq = state.get("drift_ref")  # a checkpoint from before: the next reference is 0
        self._computed_at = int(state.get("computed_at", 0))
        for name in ("last_mean", "residual"):
            value = state.get(name)
            setattr(self, f"_{name}", None if value is None else value.clone())

    # ---- shared pieces ---------------------------------------------------------------------
    def home(self) -> torch.Tensor | None:
        """The flat buffer of `wire_numel` elements whose first P the model's tensors live in (they
        move there at the first boundary, as torch's averager re-points them): a boundary averages
        it in place, so θ_m is never gathered and θ̄ lands where the model reads it. None when a
        tensor cannot move (a non-contiguous one keeps its layout, `FlatTensors.adopt`)."""
        if self._home is not None and all(t.data_ptr() == p for t, p in zip(self.flat.tensors, self._home_ptrs)):
            return self._home
        if not self.tensors_movable or not all(t.is_contiguous() for t in self.flat.tensors):
            return None
        home = torch.empty(self.wire_numel, dtype=self.flat.dtype, device=self.flat.device)
        torch.cat([t.detach().reshape(-1) for t in self.flat.tensors], out=home[: self.flat.numel])
        self.flat.adopt(home[: self.flat.numel], self.flat.views(home[: self.flat.numel]))
        self._home, self._home_ptrs = home, [t.data_ptr() for t in self.flat.tensors]
        return home

    def average_params(self) -> tuple[torch.Tensor, dict[str, Any]]:
        """θ̄ = mean(θ_m) as a flat buffer, and the sync event's fields. The buffer is the model's
        home (`home`): the model holds θ̄ when this returns, and a strategy that gives it other
        values next writes them there (`FlatTensors.scatter` is one copy).

        With drift telemetry the buffer carries this worker's ‖θ_m‖² (less the reference) as one
        more element, averaged with the values (the sum is elementwise: it changes none of their
        bits), and the event reports the boundary's `drift` (see the module docstring)."""
        if self.codec.name != "fp32":
            return self.average_changes()
        extra, n = self.wire_numel - self.flat.numel, self.flat.numel
        home = self.home()
        if home is not None:
            wire = home
        else:  # tensors that stay where they are: gather them
            wire = torch.empty(self.wire_numel, dtype=self.flat.dtype, device=self.flat.device)
            torch.cat([t.detach().reshape(-1) for t in self.flat.tensors], out=wire[:n])
        ref = self._ref_sq or 0.0
        if extra:
            wire[n] = (exact_sq_norm(wire[:n]) - ref) / max(n, 1)
        sent = self.exchange.mean(
            wire,
            "params",
            inplace=True,
            extra=extra,
            mean_sq=bool(extra),
            weight=self.steps_weight(),
            origin=self.origin(),
        )
        info: dict[str, Any] = {"bytes": self.flat.nbytes}
        if extra:
            avg_sq = sent.mean_sq
            mean_sq, whole_avg_sq = self.exchange.worker_sum([float(wire[n]) * max(n, 1) + ref, avg_sq])
            info["drift"] = self.relative_drift(mean_sq, whole_avg_sq)  # of the worker's whole model
            self._ref_sq = avg_sq if math.isfinite(avg_sq) else None
        if home is None:
            self.flat.scatter(wire[:n])  # the model holds θ̄, as with a home
        if self._last_mean is not None:  # the next boundary's reference (a robust mean's, without an anchor)
            self._last_mean.copy_(wire[:n])
        if getattr(self.opts, "sync_optimizer_state", False):
            self.average_optimizer_state()
        return wire[:n], info

    def average_changes(self) -> tuple[torch.Tensor, dict[str, Any]]:
        """`average_params` with a lossy codec: the workers exchange their change since the last
        synchronization, θ_m − θ_ref (θ_ref identical everywhere: `reference`), which quantizes far
        better than the parameters themselves (their deltas are small; the pseudo-gradients DiLoCo's
        compressed variants send), and θ̄ = θ_ref + mean(θ_m − θ_ref). With error feedback each worker
        adds what the codec dropped of its previous change. The drift is the same identity on the
        changes: mean_m ‖d_m − d̄‖² = mean_m ‖d_m‖² − ‖d̄‖², relative to ‖θ̄‖."""
        extra, n = self.wire_numel - self.flat.numel, self.flat.numel
        ref = self.reference().to(self.flat.device)
        wire = torch.empty(self.wire_numel, dtype=torch.float32, device=self.flat.device)
        self.flat.minus(ref, out=wire[:n])
        if extra:
            wire[n] = exact_sq_norm(wire[:n]) / max(n, 1)
        if self.opts.error_feedback and self._residual is None:
            self._residual = torch.zeros(n, dtype=torch.float32, device=self.flat.device)
        sent = self.exchange.mean(
            wire,
            "params",
            self.codec,
            inplace=True,
            extra=extra,
            mean_sq=bool(extra),
            collective=self.opts.codec_collective,
            residual=self._residual if self.opts.error_feedback else None,
            weight=self.steps_weight(),
            origin=0.0,
        )
        avg = wire[:n].add_(ref)  # θ̄ = θ_ref + d̄
        info: dict[str, Any] = {"bytes": self.codec.wire_bytes(n), "codec": self.codec.name}
        if extra:
            mean_sq, change_sq, avg_sq = self.exchange.worker_sum(
                [float(wire[n]) * max(n, 1), sent.mean_sq, exact_sq_norm(avg)]
            )
            info["drift"] = math.sqrt(max(mean_sq - change_sq, 0.0) / avg_sq) if avg_sq > 0 else math.inf
        self.flat.scatter(avg)  # the model holds θ̄
        if self._last_mean is not None:
            self._last_mean.copy_(avg)
        if getattr(self.opts, "sync_optimizer_state", False):
            self.average_optimizer_state()
        return avg, info

    def steps_weight(self) -> float | None:
        """What this worker's parameters weigh at this boundary: the steps it computed since the last
        one (`strategies.pace`; None under slow_policy wait: an unweighted mean)."""
        weight = self.pace.weight(self._computed_at)
        self._computed_at = self.pace.computed
        return weight

    @property
    def drift_on(self) -> bool:
        return bool(getattr(self.opts, "drift_telemetry", True))

    @property
    def wire_numel(self) -> int:
        """The parameter exchange's length: the values, plus the drift side band with telemetry."""
        return self.flat.numel + (DRIFT_SIDE_BAND if self.drift_on else 0)

    @staticmethod
    def relative_drift(mean_sq: float, avg_sq: float) -> float:
        """sqrt(mean_m ‖θ_m − θ̄‖²) / ‖θ̄‖ from mean_m ‖θ_m‖² and ‖θ̄‖² (0 when rounding makes their
        difference negative, inf when θ̄ = 0, nan when either is not finite)."""
        if not (math.isfinite(mean_sq) and math.isfinite(avg_sq)):
            return math.nan
        return math.sqrt(max(mean_sq - avg_sq, 0.0) / avg_sq) if avg_sq > 0 else math.inf

    def average_optimizer_state(self) -> None:
        """Average every floating-point tensor of the inner optimizer's state (momentum, Adam
        moments) in one flat exchange (each rank its shards' when sharded inside the worker). Step
        counters stay as they are (they agree anyway)."""
        tensors = [
            local_shard(v)
            for st in self.optimizer.state.values()
            for v in st.values()
            if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0
        ]
        if not tensors:
            return
        flat = FlatTensors(tensors)
        buf = flat.gather()
        self.exchange.mean(buf, "optim_state", inplace=True)
        flat.scatter(buf)
