"""Mean ± 95% interval over seeds, Welch's t-test between two settings, and the phrase they support.

With three seeds a standard deviation says little; the interval that accounts for so few samples is
the t-distribution's: mean ± t(0.975, n−1)·s/√n, shown beside every figure. What decides whether two
settings differ *at this scale* is Welch's two-sided t-test (unequal variances; the test the CPDP paper
uses) at α = 0.05:

    t = (m_a − m_b) / √(s_a²/n_a + s_b²/n_b)
    ν = (s_a²/n_a + s_b²/n_b)² / ((s_a²/n_a)²/(n_a − 1) + (s_b²/n_b)²/(n_b − 1))     (Welch–Satterthwaite)
    p = 2·P(T_ν > |t|)

(`scipy.stats.ttest_ind_from_stats(equal_var=False)`). Whether the two 95 % intervals overlap is a
stricter and non-standard test (two intervals can overlap while p < 0.05); it is still said, not used.
A difference the test does not support is reported as "no difference at this scale", not as a win
for the larger mean. Pure functions, no I/O.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

NO_DIFFERENCE = "no difference at this scale"
ALPHA = 0.05  # Welch's test decides at this level (two-sided)

# t(0.975, df) for df = 1..30 (two-sided 95%), the standard table.
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
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
    half: float | None  # half-width of the 95% interval; None with a single value
    n: int
    sd: float | None = None  # the sample standard deviation s (n − 1 in the denominator); None with one value

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
    sd = statistics.stdev(vals)
    half = t_975(len(vals) - 1) * sd / math.sqrt(len(vals))
    return Interval(statistics.fmean(vals), half, len(vals), sd)


def welch_p(a: Interval, b: Interval) -> float | None:
    """The two-sided p-value of Welch's t-test of equal means (the module docstring's formula) from
    the two settings' means, standard deviations and seed counts; None when either has one seed.
    Both without spread: 0 when the means differ, 1 when they are equal (the test's limit)."""
    if a.sd is None or b.sd is None or a.n < 2 or b.n < 2:
        return None
    if a.sd == 0 and b.sd == 0:
        return 1.0 if a.mean == b.mean else 0.0
    from scipy.stats import ttest_ind_from_stats  # the report extra's; only the results page tests

    return float(ttest_ind_from_stats(a.mean, a.sd, a.n, b.mean, b.sd, b.n, equal_var=False).pvalue)


def compare(a: Interval, b: Interval, higher_is_better: bool) -> int:
    """+1 when `a` is better than `b` by Welch's test at `ALPHA`, −1 when worse, 0 when the test does
    not reject equal means (or a side has one seed)."""
    p = welch_p(a, b)
    if p is None or p >= ALPHA:
        return 0
    better = a.mean > b.mean if higher_is_better else a.mean < b.mean
    return 1 if better else -1


def p_text(p: float) -> str:
    """A p-value as a reader sees it: two significant digits, '< 0.001' below that."""
    return "p < 0.001" if p < 0.001 else f"p = {p:.2g}"


def decided_by(a: Interval, b: Interval) -> str:
    """What decided, for the brackets after a verdict: Welch's p against α, then whether the 95 %
    intervals overlap (said, not used)."""
    p = welch_p(a, b)
    if p is None:
        return "one seed: no test"
    test = p_text(p) if p < 0.001 else f"{p_text(p)} {'<' if p < ALPHA else '≥'} {ALPHA:g}"
    return f"Welch's t-test {test}; the 95 % intervals {'overlap' if a.overlaps(b) else 'do not overlap'}"


def compare_in_words(name_a: str, a: Interval, name_b: str, b: Interval, higher_is_better: bool) -> str:
    """The phrase Welch's test supports: who is better, or NO_DIFFERENCE, with the p-value beside it."""
    c = compare(a, b, higher_is_better)
    if c == 0:
        return f"{NO_DIFFERENCE} ({decided_by(a, b)})"
    win, lose = (name_a, name_b) if c > 0 else (name_b, name_a)
    return f"{win} is better than {lose} ({decided_by(a, b)})"
