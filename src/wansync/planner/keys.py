"""What `wansync plan` reads of a run's configuration, declared once: a key it does not read would
leave its answer byte for byte the same, so it is refused in one line rather than seem to count.

A plan predicts the wall clock, the bytes and the memory of a setting. It reads the strategy, its
options that move those, the world, the link, the model's size, the batch, the precision and the
run's length (`--steps`: a whole run instead of the steady state). It does not read what a run learns
(learning rates, momenta of the outer step, compensation), what it writes (evaluation, checkpoints,
logs) or how it is guarded (fault tolerance, secrets, timeouts).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Iterable

from ..errors import ConfigError

#: The general config keys a plan reads; `--data` only to measure a step (`--measure`).
READS = frozenset(
    {
        "strategy",
        "workers",
        "ranks_per_worker",
        "wan",
        "model",
        "tokenizer",
        "bpe_vocab",
        "batch_size",
        "seq_len",
        "precision",
        "inside",
        "optimizer",
        "momentum",
        "steps",
    }
)
MEASURE_READS = frozenset({"data"})

#: Strategy options that change what a run learns, never its time, bytes or memory.
LEARNING_ONLY = frozenset(
    {
        "outer_lr",
        "outer_momentum",
        "slowmo_beta",
        "slowmo_lr",
        "alpha",
        "lam",
        "outer_scaling",
        "compensation",
        "error_decay",
        "momentum_decay",
        "quant_range",
        "aggregate",
        "staleness_rule",
        "dn_period",
    }
)
#: Strategies whose workers are one rank each (`config.check_asynchronous`): `plan --strategies all`
#: leaves them out of a world of several ranks per worker, saying so under its table.
ONE_RANK_PER_WORKER = frozenset({"async_diloco"})
#: Strategy options the planner does not model, with what a user should add by hand.
NOT_MODELLED = MappingProxyType(
    {
        "robust_mean": "the planner does not model the robust mean (one all-gather of a norm per worker at each "
        "exchange: add a round trip per exchange by hand): plan without it",
        "robust_kappa": "robust_kappa scales the robust mean's clip, which changes what a run learns, not its time: "
        "plan without it",
    }
)

#: Why a run-only key is refused, by key (the rest get the general reason).
RUN_ONLY_WHY = MappingProxyType(
    {
        "adapt": "--adapt changes H and the codec while a run goes, and a plan predicts one setting: plan "
        "--target-exposed P prints the smallest H whose exposed share stays under P% (plan each --codec for its)",
        "width": "the planner sizes the named models at width 1: give --params N for another width",
        "seed": "a plan's figures do not depend on the seed",
    }
)


def reads(key: str) -> bool:
    """Whether a plan reads config key `key` in some setting (what `plan --help` lists)."""
    from ..strategies import OPTIONS

    if key in OPTIONS:
        return key not in LEARNING_ONLY and key not in NOT_MODELLED
    return key in READS or key in MEASURE_READS


def check_plan_keys(given: Iterable[str], options: Iterable[str], measure: bool) -> None:
    """One line for the first key of `given` (flags and config-file keys) a plan would not read;
    `options`: the names of the strategy's options (`strategies.option_names`)."""
    own = set(options)
    reads = READS | (MEASURE_READS if measure else frozenset())
    for key in sorted(given):
        flag = f"--{key.replace('_', '-')}"
        if key in own:
            if key in LEARNING_ONLY:
                raise ConfigError(
                    f"plan predicts time, bytes and memory, and {flag} changes what a run learns, not those: drop it"
                )
            if key in NOT_MODELLED:
                raise ConfigError(f"plan: {NOT_MODELLED[key]} ({flag})")
        elif key not in reads:
            why = RUN_ONLY_WHY.get(key, "it acts on a run (what it learns, writes or survives), not on a prediction")
            raise ConfigError(f"plan would ignore {flag}: {why}; drop it")
