"""Whole-round overlap (`overlap_rounds`): round k's pseudo-gradient mean crosses the link while round
k + 1's inner steps run, and reaches the global model one round late.

DiLoCoX (Qi et al. 2025, arXiv:2506.21263) calls it the one-step-delay overlap of communication and
local training: the all-reduce of round k's pseudo-gradient runs beside round k + 1's local training,
and the outer update it makes is applied one outer step late. For one worker m, with θ̃ the global
model and s_m where this worker's round began, at the end of round k::

    Δ_m(k) = s_m − θ_m                    # this round's own progress (DiLoCo's θ̃ − θ_m when s_m = θ̃)
    Δ̄(k−1) = wait()                       # the mean launched a round ago (none at k = 1)
    θ̃ ← OuterOpt(θ̃, Δ̄(k−1))              # DiLoCo's outer step, one round late
    θ_m ← θ̃ − Δ_m(k);  s_m ← θ_m          # the new global model, plus this worker's round not yet averaged
    launch mean(Δ_m(k))                    # in the background, until the end of round k + 1

and at the end of the run: Δ̄ of the last round launched, its outer step, then the steps after the last
boundary averaged at once (blocking), and θ_m ← θ̃ on every worker.

Where round k + 1 begins is the choice the paper's public descriptions leave open (its algorithm box
was not available to us; what they state is the overlap and the one-step delay). We keep the worker's
own round on top of the new global model instead of restarting it from the stale θ̃, for two reasons:
restarting throws the round's local steps away until their mean lands, the "delayed" variant that
eager updates (Kale, Douillard, Donchev 2025, arXiv:2502.12996) measure as clearly worse than no
overlap; and with this rule one worker under outer SGD at lr 1 without momentum trains exactly as it
would alone (θ_m ← θ̃ − Δ_m(k) telescopes to the local trajectory), so the delay loses no step. The
worker's Δ_m(k) counts once in θ̃: it replaces itself by the workers' mean of it when Δ̄(k) lands.
No further correction for the delay: the outer optimizer is the strategy's own (DiLoCo's Nesterov,
SparseLoCo's plain step), applied to a mean one round old.

It costs one more copy of the model (s_m; Δ_m(k) travels in its own buffer). A checkpoint taken while
a mean is in flight waits for it and records its result (and s_m): a resumed run applies that result
where the uninterrupted one would, bit for bit; the wait is exposed communication, once per checkpoint.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..comm.exchange import MeanHandle
from .outer import Anchor

Launch = Callable[[torch.Tensor], MeanHandle]


class RoundOverlap:
    """One rank's overlapped rounds over `anchor` (θ̃ and the outer optimizer): `boundary` at each
    round's end, `finish` at the run's end; what is in flight in between."""

    def __init__(self, anchor: Anchor, comm: Any, purpose: str = "pseudo_grads"):
        self.anchor, self.comm, self.purpose = anchor, comm, purpose
        self.start: torch.Tensor | None = None  # s_m (None: the round began at θ̃, the first one)
        self.in_flight: MeanHandle | None = None  # Δ̄ of the last round, on its way

    def own_progress(self) -> torch.Tensor:
        """Δ_m(k) = s_m − θ_m, a new buffer in θ̃'s dtype and device."""
        return self.anchor.pseudo_gradient() if self.start is None else self.start - self.anchor.local()

    def land(self) -> bool:
        """θ̃ ← OuterOpt(θ̃, Δ̄) with the mean in flight, if any (waits for it)."""
        if self.in_flight is None:
            return False
        mean, self.in_flight = self.in_flight.wait(), None
        self.anchor.outer_step(mean)
        return True

    def halfway(self, t: int, rounds_of: int) -> None:
        """A mean of two phases (a lossy reduce-scatter): its second phase starts halfway through the
        round (step ⌊H/2⌋ of it, H ≥ 2: `MeanHandle.advance`, every rank at the same step), as Streaming
        DiLoCo's overlap does; otherwise it would start only when the mean is waited for."""
        if self.in_flight is not None and rounds_of >= 2 and t % rounds_of == rounds_of // 2:
            self.in_flight.advance()

    def boundary(self, launch: Launch) -> MeanHandle:
        """A round's end (module docstring): returns the new mean in flight. `launch(Δ_m)` starts the
        strategy's mean (async; it may write into Δ_m) and is called after the model moved."""
        delta = self.own_progress()
        self.land()
        self.anchor.flat.scatter(self.anchor.value - delta)  # θ_m ← θ̃ − Δ_m(k)
        self.start = self.anchor.local()  # as the model holds it (bf16: rounded)
        self.in_flight = launch(delta)
        return self.in_flight

    def finish(self, launch_blocking: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """The run's end: the last mean's outer step, then (`launch_blocking`, when steps were taken
        after the last boundary) their mean at once; every worker then holds θ̃."""
        delta = self.own_progress() if launch_blocking is not None else None
        self.land()
        if delta is not None and launch_blocking is not None:
            self.anchor.outer_step(launch_blocking(delta))
        self.anchor.load_into_model()
        self.start = None

    # ---- resumable ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """s_m and the mean in flight, waited for (a resumed run applies the same bits)."""
        landing = None if self.in_flight is None else self.in_flight.wait().detach().clone()
        return {"start": None if self.start is None else self.start.clone(), "landing": landing}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.start = None if state["start"] is None else state["start"].to(self.anchor.value).clone()
        landing = state["landing"]
        self.in_flight = (
            None
            if landing is None
            else MeanHandle.complete(self.comm, self.purpose, landing.to(self.anchor.value).clone())
        )
