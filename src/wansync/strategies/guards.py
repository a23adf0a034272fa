"""Regime guards: one-line warnings, at the start of a run, for settings known to go wrong.

Each guard is a pure function of the strategy's name, its resolved options and, where the regime
depends on it, the run's length in steps; it warns, it never refuses (a user may mean to run outside the
regime, as the presets that reproduce a paper's collapse do). The thresholds come from short runs listed
with their numbers in docs/guards.md. A line names an option the way the caller gave it: `--outer-momentum`
on the command line, `outer_momentum=` in Python (`ws.strategy`, `ws.Run`, the Trainer).
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
# A sparse exchange (SparseLoCo, DeMo) should be able to send at least this share of each chunk's values
# over the run's rounds (rounds x density): below it the runs measured trail DiLoCo by half a nat and more.
MIN_SPARSE_REACH = 0.2


def outer_step_interval(strategy: str, options: Mapping[str, Any]) -> float | None:
    """Inner steps between two outer steps on the same parameters (None: the strategy has no outer
    optimizer). DiLoCo: H. Fragment strategies: H·P/N with N syncs per period; CoCoDC's automatic N
    may reach `max_syncs_per_fragment`·P, so its interval may shrink to H / max_syncs_per_fragment."""
    if "outer_momentum" not in options:
        return None
    h, p = options["sync_every"], options.get("fragments", 1)
    n = options.get("syncs_per_period") or (p * options.get("max_syncs_per_fragment", 1))
    return h * p / n


def spell(option: str, value: Any = None, python: bool = False) -> str:
    """`option` (with `value`) as the caller writes it: `--outer-momentum 0` or `outer_momentum=0`."""
    if python:
        return option if value is None else f"{option}={value}"
    flag = "--" + option.replace("_", "-")
    return flag if value is None else f"{flag} {value}"


def nesterov_too_often(strategy: str, options: Mapping[str, Any], steps: int | None, python: bool) -> str | None:
    interval = outer_step_interval(strategy, options)
    if interval is None or options["outer_momentum"] <= 0 or interval >= MIN_NESTEROV_INTERVAL:
        return None
    gain = options["outer_lr"] / (1 - options["outer_momentum"])
    return (
        f"{strategy}: outer Nesterov momentum {options['outer_momentum']:g} (gain {gain:.3g}) applied as often as every "
        f"{interval:.3g} inner steps (< {MIN_NESTEROV_INTERVAL}) overshoots; raise {spell('sync_every', python=python)} "
        f"or set {spell('outer_momentum', 0, python)} (docs/guards.md)"
    )


def overlap_near_interval(strategy: str, options: Mapping[str, Any], steps: int | None, python: bool) -> str | None:
    tau = options.get("overlap")
    interval = outer_step_interval(strategy, options)
    if not tau or interval is None or tau < MAX_OVERLAP_FRACTION * interval:
        return None
    return (
        f"{strategy}: {spell('overlap', python=python)} {tau} is {tau / interval:.0%} of a fragment's sync interval ({interval:.3g} steps; "
        f"keep it below {MAX_OVERLAP_FRACTION:.0%}): each merge lands just before, or after, the fragment's "
        f"next sync (docs/guards.md)"
    )


def slowmo_gain_too_high(strategy: str, options: Mapping[str, Any], steps: int | None, python: bool) -> str | None:
    if "slowmo_beta" not in options:
        return None
    gain = options["slowmo_lr"] / (1 - options["slowmo_beta"])
    if round(gain, 9) <= MAX_SLOWMO_GAIN:  # 1/(1-0.8) is 5.000000000000001
        return None
    return (
        f"{strategy}: SlowMo gain slowmo_lr/(1-slowmo_beta) = {options['slowmo_lr']:g}/(1-"
        f"{options['slowmo_beta']:g}) = {gain:.3g} (> {MAX_SLOWMO_GAIN:g}) amplifies each averaged step "
        f"that much; lower {spell('slowmo_beta', python=python)} or {spell('slowmo_lr', python=python)} (docs/guards.md)"
    )


def too_sparse_for_the_run(strategy: str, options: Mapping[str, Any], steps: int | None, python: bool) -> str | None:
    """A sparse exchange sends `density` of each chunk's values per round; what it does not send waits
    in the error buffer. Over the run's rounds it can send at most rounds x density of the values: below
    `MIN_SPARSE_REACH`, most of the update never leaves a worker within the run (SparseLoCo's 32/4096 over
    a 60-step run at H = 30: 1.6 %, 1.7 nats behind DiLoCo), and the run barely moves; over the same share
    sent in many rounds it catches up (the demo: 30 rounds, 23 %, as low as DiLoCo; docs/guards.md)."""
    if "density" not in options or not options.get("sparse", True) or not steps:  # async_diloco: only `sparse`
        return None
    rounds = steps // int(options.get("sync_every", 1))
    density = options["topk"] / options["chunk"] if options.get("topk") else float(options["density"])
    reach = rounds * density
    if reach >= MIN_SPARSE_REACH:
        return None
    needed = MIN_SPARSE_REACH / max(rounds, 1)
    return (
        f"{strategy}: {spell('density', python=python)} {density:.3g} over the {rounds} round(s) of "
        f"this {steps}-step run sends at most {reach:.1%} of each chunk's values (under {MIN_SPARSE_REACH:.0%}): most "
        f"of the update never "
        f"leaves a worker (on the tiny LM such runs trail DiLoCo by 0.5 to 1.7 nats); raise {spell('density', python=python)} to {min(needed, 1.0):.3g} "
        f"or more, or train longer (docs/guards.md)"
    )


class RegimeWarning(UserWarning):
    """A guard's line, as `ws.strategy()` issues it (`warnings.filterwarnings("ignore", category=RegimeWarning)`
    silences it)."""


GUARDS: tuple[Callable[[str, Mapping[str, Any], int | None, bool], str | None], ...] = (
    nesterov_too_often,
    overlap_near_interval,
    slowmo_gain_too_high,
    too_sparse_for_the_run,
)
# the guards that need the run's length: `ws.strategy` cannot know it, `ws.Run(steps=)` and the Trainer can
NEEDS_STEPS = (too_sparse_for_the_run,)


def regime_warnings(
    strategy: str, options: Mapping[str, Any], steps: int | None = None, python: bool = False, only_steps: bool = False
) -> list[str]:
    """The warning lines for this strategy's resolved options, over a run of `steps` (None: unknown, its
    guards pass), spelled for Python callers or the command line (empty inside every guard's regime).
    `only_steps`: just the guards that need the length (a caller that warned of the rest already)."""
    guards = NEEDS_STEPS if only_steps else GUARDS
    return [line for guard in guards if (line := guard(strategy, options, steps, python)) is not None]
