"""Mean ± 95% t-interval over seeds, and the phrase two intervals support."""
from __future__ import annotations

import math

import pytest

from wansync.analysis.stats import NO_DIFFERENCE, Interval, compare, compare_in_words, interval, t_975


def test_the_t_quantile_is_the_tables_for_few_seeds_and_approaches_the_normal():
    assert t_975(2) == pytest.approx(4.303)
    assert t_975(30) == pytest.approx(2.042)
    assert t_975(60) == pytest.approx(2.000, abs=1e-3)
    assert t_975(10_000) == pytest.approx(1.960, abs=1e-3)
    with pytest.raises(ValueError):
        t_975(0)


def test_three_seeds_give_mean_plus_minus_t_times_the_standard_error():
    iv = interval([1.0, 2.0, 3.0])
    assert iv.mean == 2.0 and iv.n == 3
    assert iv.half == pytest.approx(4.303 * 1.0 / math.sqrt(3))


def test_one_seed_has_no_width_and_none_has_no_interval():
    assert interval([5.0]) == Interval(5.0, None, 1)
    assert interval([]) is None


def test_overlapping_intervals_are_no_difference_at_this_scale():
    a, b = interval([85.0, 86.0, 85.5]), interval([85.4, 86.2, 85.1])
    assert compare(a, b, higher_is_better=True) == 0
    assert compare_in_words("K=16", a, "K=4", b, True).startswith(NO_DIFFERENCE)


def test_disjoint_intervals_name_the_better_one_by_the_metrics_direction():
    low, high = interval([1.0, 1.1, 1.05]), interval([2.0, 2.1, 2.05])
    assert compare(high, low, higher_is_better=True) == 1 and compare(high, low, higher_is_better=False) == -1
    assert compare_in_words("a", low, "b", high, higher_is_better=False) == "a is better than b (the intervals do not overlap)"


def test_a_single_seed_never_counts_as_a_difference():
    assert compare(interval([1.0]), interval([100.0, 101.0]), True) == 0
