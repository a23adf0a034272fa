"""The fragment strategies' timetable (Streaming DiLoCo, CoCoDC): the ordered work of every step and of
`finish()`, which the strategy carries out on its tensors and the planner on its transfers.

Step t, in this order (`step`):

1. the merges that are due (`merge_at ≤ t`), in start order;
2. at a slot, the choice of a fragment (`fragments.Schedule`: round robin or CoCoDC's adaptive rule;
   None: the slot is skipped) and the start of its sync, merged τ steps later;
3. with τ = 0, that sync's merge at once (so `fragments=1, overlap=0, alpha=0` is DiLoCo step for step);
4. with an automatic N (CoCoDC's `syncs_per_period = 0`), once, at the first step ≥ H: the decision
   on N, which the schedule follows from then on.

`finish()` after step t: every sync still in flight merges early (with the steps actually elapsed), in
start order; then one blocking sync of each fragment that a merge did not leave exactly at its anchor
θ̃_p at this step. Whether a merge lands exactly on θ̃_p is a rule of the merge and its options
(`compensation.lands_on_anchor`), never a comparison of values, so every rank decides alike.

The caller is told what to do through the `FragmentWork` methods, in that order; the timetable keeps
the schedule, the syncs in flight (`inflight.py`) and the step each fragment last landed on θ̃_p.
"""

from __future__ import annotations

from typing import Any, Protocol

from .compensation import lands_on_anchor
from .fragments import Schedule
from .inflight import InFlight, InFlightExchanges
from .timetable import Timetable


class FragmentWork(Protocol):
    """What the caller of a `FragmentTimetable` does when told (the strategy, the planner)."""

    def slot(self, t: int, choice: tuple[int, str] | None) -> None:
        """Step t is a slot and this is its choice (None: skipped); every rank must make the same."""

    def start(self, sync: InFlight) -> None:
        """Start the sync of `sync.fragment` (the exchange's fields are the caller's to fill in)."""

    def halfway(self, sync: InFlight, t: int) -> None:
        """Halfway through the overlap (step start + ⌊τ/2⌋, τ ≥ 2): a mean of two phases (a lossy
        reduce-scatter) starts its second here, in the background, at the same step on every rank."""

    def merge(self, sync: InFlight, t: int, exact: bool) -> None:
        """Wait for the sync's mean and merge it at step t; `exact`: the merge lands on θ̃_p."""

    def final_sync(self, fragment: int, t: int) -> None:
        """`finish()`: one blocking outer sync of `fragment`, after which it holds θ̃_p."""

    def decide_n(self, t: int) -> int:
        """An automatic N only: the syncs per period from now on, the same on every rank."""


class FragmentTimetable(Timetable):
    """Streaming DiLoCo's: round-robin slots, N = `syncs_per_period` (0: P), the α-merge or eager updates."""

    def __init__(
        self, options: Any, choice: str = "round_robin", merge: str = "alpha", automatic_n: bool = False
    ) -> None:
        super().__init__(options)
        self.H, self.P, self.tau = options.sync_every, options.fragments, options.overlap
        self.merge = "eager" if options.eager else merge  # the merge rule: alpha | taylor | damped | eager
        self.schedule = Schedule(self.H, self.P, options.syncs_per_period or self.P, choice)
        self.in_flight = InFlightExchanges()
        self.exact_at = [0] * self.P  # step at which fragment p last landed exactly on θ̃_p
        self.n_decided = not automatic_n

    def exchanges_at(self, t: int) -> bool:
        return self.schedule.is_slot(t) or self.decides_n_at(t)

    def decides_n_at(self, t: int) -> bool:
        """Is N decided at step t? An automatic N once, at the first step ≥ H."""
        return not self.n_decided and t >= self.H

    def step(self, t: int, work: FragmentWork) -> None:
        """Step t's work, in order (see the module docstring)."""
        for sync in self.in_flight:
            if self.tau >= 2 and t == sync.start + self.tau // 2:
                work.halfway(sync, t)
        self._merge_due(t, work)
        if self.schedule.is_slot(t):
            choice = self.schedule.choose(t, self.in_flight.fragments())
            work.slot(t, choice)
            if choice is not None:
                p, reason = choice
                sync = InFlight(
                    fragment=p, start=t, merge_at=t + self.tau, reason=reason, interval=self.schedule.record_start(p, t)
                )
                work.start(sync)
                self.in_flight.add(sync)
            self._merge_due(t, work)  # τ = 0: merge at once
        if self.decides_n_at(t):
            self.schedule.set_n(work.decide_n(t))
            self.n_decided = True

    def finish(self, t: int, work: FragmentWork) -> None:
        """`finish()` after step t: merge what is in flight, then a final sync of each fragment not at θ̃_p."""
        for sync in self.in_flight:
            self._merge(sync, t, work)
        for p in range(self.P):
            if self.exact_at[p] != t:
                work.final_sync(p, t)
                self.exact_at[p] = t

    def _merge_due(self, t: int, work: FragmentWork) -> None:
        for sync in self.in_flight.due(t):
            self._merge(sync, t, work)

    def _merge(self, sync: InFlight, t: int, work: FragmentWork) -> None:
        exact = lands_on_anchor(self.merge, self.opts.alpha, t - sync.start)
        work.merge(sync, t, exact)
        self.in_flight.remove(sync)
        if exact:
            self.exact_at[sync.fragment] = t

    # ---- resumable state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule.state_dict(),
            "exact_at": list(self.exact_at),
            "in_flight": self.in_flight.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state["schedule"])
        self.exact_at = [int(v) for v in state["exact_at"]]
        self.in_flight.load_state_dict(state["in_flight"])
