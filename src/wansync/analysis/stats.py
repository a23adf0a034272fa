"""Mean ± 95% interval over seeds, and the phrase two intervals support.

With three seeds a standard deviation says little; the interval that accounts for so few samples is
the t-distribution's: mean ± t(0.975, n−1)·s/√n. Two settings differ *at this scale* only when their
intervals do not overlap; overlapping intervals are reported as "no difference at this scale", not
as a win for the larger mean. Pure functions, no I/O.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

NO_DIFFERENCE = "no difference at this scale"

# t(0.975, df) for df = 1..30 (two-sided 95%), the standard table.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z975 = 1.959964


def t_975(df: int) -> float:
    """The two-sided 95% quantile of Student's t with `df` degrees of freedom (df >= 1): the table up
    to 30, beyond it the Cornish-Fisher expansion around the normal quantile (error < 1e-3)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Interval:
    mean: float
    half: float | None            # half-width of the 95% interval; None with a single value
    n: int

    @property
    def low(self) -> float:
        return self.mean - (self.half or 0.0)

    @property
    def high(self) -> float:
        return self.mean + (self.half or 0.0)

    def overlaps(self, other: Interval) -> bool:
        """True when the two intervals share a point, or when either has no width estimate (one seed)."""
        if self.half is None or other.half is None:
            return True
        return self.low <= other.high and other.low <= self.high

    def text(self, digits: int = 4) -> str:
        m = f"{self.mean:.{digits}g}" if abs(self.mean) < 1000 else f"{self.mean:,.0f}"
        return m if self.half is None else f"{m} ± {self.half:.2g}"


def interval(values: Sequence[float]) -> Interval | None:
    """Mean ± t(0.975, n−1)·s/√n of `values` (None when empty; no half-width with one value)."""
    vals = [float(v) for v in values]
    if not vals:
        return None
    if len(vals) == 1:
        return Interval(vals[0], None, 1)
    half = t_975(len(vals) - 1) * statistics.stdev(vals) / math.sqrt(len(vals))
    return Interval(statistics.fmean(vals), half, len(vals))


def compare(a: Interval, b: Interval, higher_is_better: bool) -> int:
    """+1 when `a` is better than `b` with disjoint intervals, −1 when worse, 0 when they overlap."""
    if a.overlaps(b):
        return 0
    better = a.mean > b.mean if higher_is_better else a.mean < b.mean
    return 1 if better else -1


def compare_in_words(name_a: str, a: Interval, name_b: str, b: Interval, higher_is_better: bool) -> str:
    """The phrase two intervals support: who is better, or NO_DIFFERENCE."""
    c = compare(a, b, higher_is_better)
    if c == 0:
        return NO_DIFFERENCE + (" (one seed: no interval)" if a.half is None or b.half is None
                                else " (the intervals overlap)")
    win, lose = (name_a, name_b) if c > 0 else (name_b, name_a)
    return f"{win} is better than {lose} (the intervals do not overlap)"
