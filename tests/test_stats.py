"""Mean ± 95% t-interval over seeds, Welch's t-test, and the phrase they support."""

from __future__ import annotations

import math
import random

import pytest

from wansync.analysis.stats import ALPHA, NO_DIFFERENCE, Interval, compare, compare_in_words, interval, t_975, welch_p


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
    assert interval([1.0, 2.0, 3.0]).sd == 1.0
    assert interval([]) is None


def test_overlapping_intervals_are_no_difference_at_this_scale():
    a, b = interval([85.0, 86.0, 85.5]), interval([85.4, 86.2, 85.1])
    assert compare(a, b, higher_is_better=True) == 0
    assert compare_in_words("K=16", a, "K=4", b, True).startswith(NO_DIFFERENCE)


def test_disjoint_intervals_name_the_better_one_by_the_metrics_direction():
    low, high = interval([1.0, 1.1, 1.05]), interval([2.0, 2.1, 2.05])
    assert compare(high, low, higher_is_better=True) == 1 and compare(high, low, higher_is_better=False) == -1
    assert (
        compare_in_words("a", low, "b", high, higher_is_better=False)
        == "a is better than b (Welch's t-test p < 0.001; the 95 % intervals do not overlap)"
    )


def test_a_single_seed_never_counts_as_a_difference():
    assert compare(interval([1.0]), interval([100.0, 101.0]), True) == 0


# ---- Welch's t-test decides ---------------------------------------------------------------------------
def test_welchs_p_value_is_the_known_one():
    # R: t.test(c(1, 2, 3), c(4, 5, 7)) -> t = -3.1623, df = 3.4483, p-value = 0.04191
    assert welch_p(interval([1.0, 2.0, 3.0]), interval([4.0, 5.0, 7.0])) == pytest.approx(0.04191, abs=5e-5)
    # equal seeds and spread: Welch is Student's t with 2(n-1) df, so t = t(0.975, 4) gives p = 0.05 (the table's)
    d = t_975(4) * math.sqrt(2 / 3)
    assert welch_p(interval([-1.0, 0.0, 1.0]), interval([d - 1, d, d + 1])) == pytest.approx(ALPHA, abs=1e-4)


def test_overlapping_intervals_can_still_differ_by_welchs_test():
    a, b = interval([0.0, 1.0, 2.0]), interval([2.887, 3.887, 4.887])  # 5 standard errors apart
    assert a.overlaps(b) and welch_p(a, b) == pytest.approx(0.0241, abs=1e-4)
    assert compare(b, a, higher_is_better=True) == 1
    assert (
        compare_in_words("a", a, "b", b, True)
        == "b is better than a (Welch's t-test p = 0.024 < 0.05; the 95 % intervals overlap)"
    )


def test_welchs_test_rejects_whenever_the_intervals_do_not_overlap():
    """The reverse of the case above never happens: disjoint 95 % intervals always give p < 0.05."""
    rng, disjoint = random.Random(7), 0
    for _ in range(500):
        a = interval([rng.gauss(0, rng.choice((0.1, 1, 10))) for _ in range(rng.randint(2, 5))])
        b = interval([rng.gauss(rng.uniform(0, 30), rng.choice((0.1, 1, 10))) for _ in range(rng.randint(2, 5))])
        if not a.overlaps(b):
            disjoint += 1
            assert welch_p(a, b) < ALPHA, (a, b)
    assert disjoint > 50


def test_a_p_value_at_or_above_alpha_is_no_difference_and_says_so():
    a, b = interval([85.0, 86.0, 85.5]), interval([85.4, 86.2, 85.1])
    assert (
        compare_in_words("K=16", a, "K=4", b, True)
        == f"{NO_DIFFERENCE} (Welch's t-test p = 0.89 ≥ 0.05; the 95 % intervals overlap)"
    )
    assert compare_in_words("x", interval([1.0]), "y", b, True) == f"{NO_DIFFERENCE} (one seed: no test)"


def test_settings_without_spread_differ_exactly_when_their_means_do():
    assert welch_p(interval([2.0, 2.0]), interval([3.0, 3.0, 3.0])) == 0.0
    assert welch_p(interval([2.0, 2.0]), interval([2.0, 2.0, 2.0])) == 1.0
