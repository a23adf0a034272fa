"""Which strategy, with which settings (`wansync plan --strategies`): each strategy at its best period H,
codec and way of holding the model inside a worker, under the constraints, then all of them ranked.

A plan predicts time, bytes and memory, not what a setting learns, so the rule leans on what the
papers found about learning: a longer period costs more than a lossy exchange of the pseudo-gradients.
DiLoCo's loss grows with H (arXiv:2311.08105), while Streaming DiLoCo exchanges 4-bit values
(arXiv:2501.18512) and INTELLECT-1 int8 ones (arXiv:2412.01152) at little loss. So, for each
strategy, among its settings whose memory per GPU fits the accelerator:

1. the smallest H whose exposed communication stays at or below the target (`TARGET_PCT`, or
   `--target-exposed`), whatever the codec: `predict.smallest_h`, the search `--target-exposed` makes;
2. at that H, the codec that loses least (`CODECS`: fp32, bf16, int8, fp4, in that order);
3. short of the target at every H, the least exposed setting (the longest H, the fewest bytes);
4. with several ranks per worker, DDP inside (each rank the whole model) where it fits, else FSDP
   (sharded): `INSIDE`, in that order.

The periods tried are those of `predict.periods` that the strategy can take (in a whole run of `steps`
steps, up to steps / 2: two rounds at least). A knob the user gave (`--sync-every`,
`--codec`, `--inside`, any other option) is kept, not searched; a strategy without the knob keeps its
exchange (DDP has no H; SparseLoCo and DeMo send their own sparse payload, and so does async_diloco
with `sparse`, where its codec does nothing). The strategies are then
ranked by predicted utilization (compute alone over the wall clock, `Prediction.utilization_pct`),
those whose chosen setting fits the GPU memory first, then by fewer bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .memory import memory_bill
from .prediction import Prediction, Setting, predict, smallest_h

TARGET_PCT = 10.0  # the exposed share a chosen setting stays under unless told otherwise
CODECS = ("fp32", "bf16", "int8", "fp4")  # from the one that loses nothing to the one that loses most
INSIDE = ("ddp", "fsdp")  # a worker's ranks: each the whole model, then sharded


@dataclass(frozen=True)
class Choice:
    """A strategy at its chosen setting: the prediction there, and whether it met the constraints."""

    prediction: Prediction
    reached: bool  # exposed communication at or below the target
    fits: bool  # memory per GPU at the peak within the accelerator's
    searched: tuple[str, ...]  # the knobs that were chosen (the others were given or do not exist)

    @property
    def strategy(self) -> str:
        return self.prediction.setting.strategy


def choose(
    s: Setting,
    capacity: float,
    target_pct: float = TARGET_PCT,
    steps: int | None = None,
    given: frozenset[str] = frozenset(),
) -> Choice:
    """Strategy `s.strategy` at its best setting (the module docstring's rule), from `s`'s options
    for every knob in `given` (config keys) and searching the others; `steps`: a whole run of that
    many steps, else the steady state."""
    o = s.options
    search_h = "sync_every" in o and "sync_every" not in given
    codecs = CODECS if "codec" in o and "codec" not in given and _codec_acts(s) else (o.get("codec", "fp32"),)
    insides = INSIDE if s.ranks_per_worker > 1 and "inside" not in given else (s.inside,)
    searched = tuple(
        k for k, on in (("sync_every", search_h), ("codec", len(codecs) > 1), ("inside", len(insides) > 1)) if on
    )
    tried: list[Choice] = []
    for inside in insides:
        here = dataclasses.replace(s, inside=inside)
        if inside != insides[-1] and all(memory_bill(_with(here, c), ())["per_gpu"] > capacity for c in codecs):
            continue  # it does not fit this way, whatever the period (fragments in flight only add to it)
        p, reached = _best(here, codecs, search_h, target_pct, steps, capacity)
        choice = Choice(p, reached, p.memory["per_gpu"] <= capacity, searched)
        if choice.fits:
            return choice
        tried.append(choice)
    return min(tried, key=lambda c: c.prediction.memory["per_gpu"])  # none fits: the one that needs least


def _codec_acts(s: Setting) -> bool:
    """Does the codec act in this setting (its declared `needs`: not beside async_diloco's sparse payload)?"""
    from ..strategies import make_options

    return make_options(s.strategy, **s.options).idle(["codec"]) is None


def _with(s: Setting, codec: str) -> Setting:
    return dataclasses.replace(s, options={**s.options, "codec": codec}) if "codec" in s.options else s


def _best(
    s: Setting,
    codecs: tuple[str, ...],
    search_h: bool,
    target_pct: float,
    steps: int | None,
    capacity: float,
) -> tuple[Prediction, bool]:
    """The module docstring's steps 1 to 3 for one way of holding the model: the prediction at the chosen
    H and codec, and whether it reaches the target. A longer period exposes no more (`predict.smallest_h`),
    and neither do fewer bytes on the wire (a lossy mean takes the cheaper of its two paths,
    `comm.mean_cost`): the codec with the fewest bytes (the last) reaches the target at the smallest H,
    so its H is searched once and the other codecs are tried at it."""
    if search_h:
        p, reached = smallest_h(_with(s, codecs[-1]), target_pct, steps)
        if p is not None and not reached:
            return p, False  # the longest period with the fewest bytes: the least exposed
        if p is not None:
            return _least_lossy(p.setting, codecs, target_pct, steps, capacity, known=p)
    return _least_lossy(s, codecs, target_pct, steps, capacity)


def _least_lossy(
    s: Setting,
    codecs: tuple[str, ...],
    target_pct: float,
    steps: int | None,
    capacity: float,
    known: Prediction | None = None,
) -> tuple[Prediction, bool]:
    """At `s`'s period: the codec that loses least among those reaching the target (and fitting, when
    one does); short of the target, the least exposed. `known`: the prediction for `s` as it is."""
    found = []
    for codec in codecs:  # the one that loses least first
        if known is not None and codec == s.options.get("codec", codec):
            p, reached = known, known.exposed_pct <= target_pct
        else:
            p, reached = _at(_with(s, codec), target_pct, steps)
        if reached and p.memory["per_gpu"] <= capacity:
            return p, True
        found.append((p, reached))
    return min(found, key=lambda pr: (not pr[1], pr[0].exposed_pct if not pr[1] else 0.0))


def _at(s: Setting, target_pct: float, steps: int | None) -> tuple[Prediction, bool]:
    p = predict(s, steps, finish=steps is not None)
    return p, p.exposed_pct <= target_pct


def rank(choices: list[Choice]) -> list[Choice]:
    """Those that fit the GPU memory first, then by predicted utilization (highest first), then by
    fewer bytes per worker per step."""
    return sorted(choices, key=lambda c: (not c.fits, -c.prediction.utilization_pct, c.prediction.bytes_per_step))
