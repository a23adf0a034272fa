"""Time accounting whose categories add up to the wall clock by construction.

The training thread's time line is cut at every `lap(category)`: the interval since the
previous lap is charged to exactly one category, so the categories always sum to the
measured wall clock (the residual is only float rounding). Time measured *inside* an interval
(e.g. waits inside `sync.step()`) is re-charged with `move`, which keeps the sum unchanged.
"""
from __future__ import annotations

import time
from typing import Any

CATEGORIES = ("compute", "exposed_comm", "sync_math", "data", "eval", "checkpoint", "other")


class Profiler:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self._mark = self.start
        self.totals = dict.fromkeys(CATEGORIES, 0.0)

    def lap(self, category: str) -> float:
        """Charge the time since the last lap to `category`; returns that interval."""
        now = time.perf_counter()
        dt = now - self._mark
        self.totals[category] += dt
        self._mark = now
        return dt

    def move(self, src: str, dst: str, seconds: float) -> None:
        seconds = min(max(0.0, seconds), max(0.0, self.totals[src]))
        self.totals[src] -= seconds
        self.totals[dst] += seconds

    def wall(self) -> float:
        return time.perf_counter() - self.start

    def report(self) -> dict[str, Any]:
        self.lap("other")
        wall = self._mark - self.start
        total = sum(self.totals.values())
        return {"wall_clock_s": wall, "categories_s": dict(self.totals), "sum_s": total,
                "residual_s": wall - total,
                "residual_pct": 100.0 * (wall - total) / wall if wall > 0 else 0.0}
