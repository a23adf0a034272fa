"""Links that change during a run: a piecewise-constant profile, and seeded random "other traffic".

A :class:`LinkSchedule` names the links it applies to (directed site pairs; a site's own link is the
pair (s, s); none: every link) and says what they are at run time t (seconds since the run's
emulated network came up, the same origin on every rank):

- ``steps``: from ``at_s`` on, the bandwidth becomes ``bandwidth_bps`` (or the base bandwidth times
  ``scale``) and the RTT ``rtt_s``; before the first step the link is as the topology gives it. Steps
  are strictly increasing in time (a schedule cannot go back).
- ``traffic``: other flows take a share of the bandwidth that changes every ``period_s``: in period
  k = ⌊t / period⌋ what is left is u ∈ [low, high], drawn from a generator seeded with (seed, the
  pair, k), so every rank, the planner and a rerun see the same link at the same time.

Both are pure functions of t: the emulator evaluates them at a transfer's start, the planner at the
time its simulation reaches; ``phase_start`` names the run time from which the links are as they are
now (the cost model remembers durations per phase).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from wansync.errors import ConfigError
from wansync.net.link import Link

__all__ = ["LinkSchedule", "Step", "Traffic"]


@dataclass(frozen=True)
class Step:
    """From ``at_s`` on: the bandwidth (absolute, or the base one times ``scale``) and the RTT."""

    at_s: float
    bandwidth_bps: float | None = None
    scale: float | None = None
    rtt_s: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.at_s) and self.at_s >= 0):
            raise ConfigError(f"a schedule step's time must be >= 0 s, got {self.at_s!r}")
        if self.bandwidth_bps is not None and self.scale is not None:
            raise ConfigError("a schedule step gives bw or scale, not both")
        if self.bandwidth_bps is not None and not (0 < self.bandwidth_bps < math.inf):
            raise ConfigError(f"a schedule step's bandwidth must be positive and finite, got {self.bandwidth_bps!r}")
        if self.scale is not None and not (0 < self.scale < math.inf):
            raise ConfigError(f"a schedule step's scale must be positive and finite, got {self.scale!r}")
        if self.rtt_s is not None and not (0 <= self.rtt_s < math.inf):
            raise ConfigError(f"a schedule step's rtt must be >= 0 and finite, got {self.rtt_s!r}")
        if self.bandwidth_bps is None and self.scale is None and self.rtt_s is None:
            raise ConfigError(f"the schedule step at {self.at_s:g} s changes nothing: give bw, scale or rtt")

    def apply(self, base: Link) -> Link:
        bw = (
            self.bandwidth_bps
            if self.bandwidth_bps is not None
            else base.bandwidth_bps * self.scale
            if self.scale is not None
            else base.bandwidth_bps
        )
        return replace(base, bandwidth_bps=bw, rtt_s=base.rtt_s if self.rtt_s is None else self.rtt_s)


@dataclass(frozen=True)
class Traffic:
    """Other flows on the link: in each period of ``period_s`` seconds the run gets a share u of the
    bandwidth, uniform in [``low``, ``high``], drawn from (``seed``, the pair, the period's index)."""

    seed: int
    period_s: float
    low: float
    high: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.period_s) and self.period_s > 0):
            raise ConfigError(f"traffic: every must be a positive time, got {self.period_s!r} s")
        if not (0 < self.low <= self.high <= 1):
            raise ConfigError(
                f"traffic: need 0 < low <= high <= 1 (shares of the bandwidth), got low "
                f"{self.low!r}, high {self.high!r}"
            )

    def share(self, pair: tuple[int, int], at_s: float) -> float:
        k = int(max(at_s, 0.0) // self.period_s)
        u = np.random.default_rng([self.seed & 0xFFFFFFFF, pair[0], pair[1], k]).random()
        return self.low + (self.high - self.low) * float(u)

    def period(self, at_s: float) -> int:
        return int(max(at_s, 0.0) // self.period_s)


@dataclass(frozen=True)
class LinkSchedule:
    """What some links are at run time t (module docstring). ``pairs``: directed site pairs (a site's
    own link is (s, s)); empty: every link of the topology."""

    pairs: tuple[tuple[int, int], ...] = ()
    steps: tuple[Step, ...] = ()
    traffic: Traffic | None = None

    def __post_init__(self) -> None:
        if not self.steps and self.traffic is None:
            raise ConfigError("a schedule needs steps or traffic")
        times = [s.at_s for s in self.steps]
        for before, after in zip(times, times[1:]):
            if not after > before:
                raise ConfigError(
                    f"schedule steps go back in time: {after:g} s after {before:g} s "
                    f"(each step's `at` must be later than the one before)"
                )

    def covers(self, pair: tuple[int, int]) -> bool:
        return not self.pairs or pair in self.pairs

    def apply(self, pair: tuple[int, int], base: Link, at_s: float) -> Link:
        """The link `pair` is at run time `at_s`, given what it is without this schedule."""
        link = base
        for step in self.steps:
            if step.at_s > at_s:
                break
            link = step.apply(base)
        if self.traffic is not None:
            link = replace(link, bandwidth_bps=link.bandwidth_bps * self.traffic.share(pair, at_s))
        return link

    def phase_start(self, at_s: float) -> float:
        """When the links as they are at `at_s` came to be: the last step passed, or the traffic's
        period's start (0 before either). Every time from it to `at_s` gives the same links."""
        start = max((s.at_s for s in self.steps if s.at_s <= at_s), default=0.0)
        if self.traffic is not None:
            start = max(start, self.traffic.period(at_s) * self.traffic.period_s)
        return start

    def changes(self) -> list[float]:
        """The run times at which a step changes the links (the traffic's periods aside)."""
        return [s.at_s for s in self.steps]
