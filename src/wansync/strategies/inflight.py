"""The fragment exchanges between their start and their merge, kept so a checkpoint can be taken
at any step.

A checkpoint records, for each exchange in flight, this worker's pseudo-gradient (and θ(t_p) when
the merge needs it). A resumed run relaunches those exchanges, in their original order, before it
issues anything else, and merges them at their original steps, so it continues bit for bit. The
relaunch is a replay: the restored ledger already counts its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..comm.exchange import MeanHandle


@dataclass
class InFlight:
    """One fragment exchange between its start and its merge: when (the timetable's), and what
    (the strategy's, filled in when it launches the exchange)."""

    fragment: int
    start: int
    merge_at: int
    interval: int  # I_p: steps since the fragment's previous start
    reason: str
    delta: torch.Tensor | None = None  # this worker's pseudo-gradient, the exchange's input
    theta_start: torch.Tensor | None = None  # θ_{m,p}(t_p), when the merge needs it
    handle: MeanHandle | None = None  # None until (re)launched
    weight: float | None = None  # what this worker's contribution weighs (`strategies.pace`)

    def state_dict(self) -> dict[str, Any]:
        return {
            "fragment": self.fragment,
            "start": self.start,
            "merge_at": self.merge_at,
            "interval": self.interval,
            "reason": self.reason,
            "delta": self.delta.clone(),
            "theta_start": None if self.theta_start is None else self.theta_start.clone(),
            **({"weight": self.weight} if self.weight is not None else {}),
        }

    @classmethod
    def from_state(cls, s: dict[str, Any]) -> "InFlight":
        return cls(
            fragment=int(s["fragment"]),
            start=int(s["start"]),
            merge_at=int(s["merge_at"]),
            interval=int(s["interval"]),
            reason=str(s["reason"]),
            delta=s["delta"].clone(),
            theta_start=None if s["theta_start"] is None else s["theta_start"].clone(),
            weight=s.get("weight"),
        )


class InFlightExchanges:
    """The exchanges in flight, in start order."""

    def __init__(self) -> None:
        self._items: list[InFlight] = []

    def __iter__(self) -> Iterator[InFlight]:
        return iter(list(self._items))

    def add(self, x: InFlight) -> None:
        self._items.append(x)

    def remove(self, x: InFlight) -> None:
        self._items.remove(x)

    def fragments(self) -> set[int]:
        return {x.fragment for x in self._items}

    def due(self, t: int) -> list[InFlight]:
        """The exchanges to merge at step t, in start order."""
        return [x for x in self._items if x.merge_at <= t]

    def relaunch_restored(self, launch: Callable[[InFlight], None]) -> None:
        """After a resume: launch the restored exchanges again, in their original order."""
        for x in self._items:
            if x.handle is None:
                launch(x)

    def state_dict(self) -> list[dict[str, Any]]:
        return [x.state_dict() for x in self._items]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self._items = [InFlight.from_state(s) for s in state]
