"""Regime guards: one-line warnings, at the start of a run, for settings known to go wrong.

Each guard is a pure function of the strategy's name and its resolved options; it warns, it never
refuses (a user may mean to run outside the regime, as the presets that reproduce a paper's collapse
do). The thresholds come from short runs listed with their numbers in docs/guards.md.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

# Outer Nesterov momentum (DiLoCo's lr 0.7, momentum 0.9: a gain lr/(1-momentum) = 7) needs the outer
# steps on the same parameters to be at least this many inner steps apart.
MIN_NESTEROV_INTERVAL = 25
# The overlap τ should stay below this fraction of a fragment's sync interval (at or above it, the
# merge lands just before the fragment's next sync, or after it when the interval shrinks below τ).
MAX_OVERLAP_FRACTION = 0.9
# SlowMo's (and CPDP's) effective step gain α/(1−β) above this is outside the regime.
MAX_SLOWMO_GAIN = 5.0


def outer_step_interval(strategy: str, options: Mapping[str, Any]) -> float | None:
    """Inner steps between two outer steps on the same parameters (None: the strategy has no outer
    optimizer). DiLoCo: H. Fragment strategies: H·P/N with N syncs per period; CoCoDC's automatic N
    may reach `max_syncs_per_fragment`·P, so its interval may shrink to H / max_syncs_per_fragment."""
    if "outer_momentum" not in options:
        return None
    h, p = options["sync_every"], options.get("fragments", 1)
    n = options.get("syncs_per_period") or (p * options.get("max_syncs_per_fragment", 1))
    return h * p / n


def nesterov_too_often(strategy: str, options: Mapping[str, Any]) -> str | None:
    interval = outer_step_interval(strategy, options)
    if interval is None or options["outer_momentum"] <= 0 or interval >= MIN_NESTEROV_INTERVAL:
        return None
    gain = options["outer_lr"] / (1 - options["outer_momentum"])
    return (
        f"{strategy}: outer Nesterov momentum {options['outer_momentum']:g} (gain {gain:.3g}) applied as often as every "
        f"{interval:.3g} inner steps (< {MIN_NESTEROV_INTERVAL}) overshoots; raise sync_every or set "
        f"--outer-momentum 0 (docs/guards.md)"
    )


def overlap_near_interval(strategy: str, options: Mapping[str, Any]) -> str | None:
    tau = options.get("overlap")
    interval = outer_step_interval(strategy, options)
    if not tau or interval is None or tau < MAX_OVERLAP_FRACTION * interval:
        return None
    return (
        f"{strategy}: overlap {tau} is {tau / interval:.0%} of a fragment's sync interval ({interval:.3g} steps; "
        f"keep it below {MAX_OVERLAP_FRACTION:.0%}): each merge lands just before, or after, the fragment's "
        f"next sync (docs/guards.md)"
    )


def slowmo_gain_too_high(strategy: str, options: Mapping[str, Any]) -> str | None:
    if "slowmo_beta" not in options:
        return None
    gain = options["slowmo_lr"] / (1 - options["slowmo_beta"])
    if round(gain, 9) <= MAX_SLOWMO_GAIN:  # 1/(1-0.8) is 5.000000000000001
        return None
    return (
        f"{strategy}: SlowMo gain slowmo_lr/(1-slowmo_beta) = {options['slowmo_lr']:g}/(1-"
        f"{options['slowmo_beta']:g}) = {gain:.3g} (> {MAX_SLOWMO_GAIN:g}) amplifies each averaged step "
        f"that much; lower --slowmo-beta or --slowmo-lr (docs/guards.md)"
    )


class RegimeWarning(UserWarning):
    """A guard's line, as `ws.strategy()` issues it (`warnings.filterwarnings("ignore", category=RegimeWarning)`
    silences it)."""


GUARDS: tuple[Callable[[str, Mapping[str, Any]], str | None], ...] = (
    nesterov_too_often,
    overlap_near_interval,
    slowmo_gain_too_high,
)


def regime_warnings(strategy: str, options: Mapping[str, Any]) -> list[str]:
    """The warning lines for this strategy's resolved options (empty inside every guard's regime)."""
    return [line for guard in GUARDS if (line := guard(strategy, options)) is not None]
