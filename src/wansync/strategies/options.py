"""Strategy options, each knob declared once: its default, its help and the rules its value obeys.

A strategy's `Options` is a dataclass deriving from `Options`, its fields made with
`option(default, help, *rules)` (the rules of `rules.py`). Everything else is derived from those declarations: the defaults,
the `--flag` and the `[strategy]` config key with its help (the registry's `OPTIONS`, built by
`collect`), and the validation (`Options.__post_init__`: each value's type, its rules, then the
class's `cross_check()` for rules that relate fields). Algorithms that nest nest their options
(post-local SGD's extend LocalSGD's, CPDP's SlowMo's, CoCoDC's Streaming DiLoCo's); a subclass that
only changes a default says so with `Base.with_default(name, value)`. Knobs that strategies of
different families share (`sync_every`, `outer_lr`, `outer_momentum`) are the factories at the end.

Every rule fails with the same one-line ConfigError the user sees on the command line, e.g.
`sync_every must be >= 1, got 0`.

Declaring and checking options imports no torch: the command line's flags and `--help` are made from
these declarations (`catalog.py`), and the names they choose among are `comm/choices.py`'s.
"""

from __future__ import annotations

import dataclasses
import numbers
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, get_type_hints

from ..comm.choices import (
    AGGREGATES,
    CODEC_NAMES,
    DEFAULT_KAPPA,
    LOSSY_COLLECTIVES,
    ROBUST_MEANS,
    check_bits,
    check_codec,
)
from ..errors import check
from ..rules import Rule, at_least, in_range, one_of, positive  # noqa: F401 - the rules options declare


def option(default: Any, help: str, *rules: Rule, needs: Needs | tuple[Needs, ...] = ()) -> Any:
    """A strategy option field: its default, one line of help, the rules its value obeys, and `needs`:
    the settings of the other options in which it acts at all (none: in every setting; several: it
    acts where each holds, and the first that does not says why)."""
    needs = (needs,) if isinstance(needs, Needs) else tuple(needs)
    return dataclasses.field(default=default, metadata={"help": help, "rules": rules, "needs": needs})


@dataclasses.dataclass(frozen=True)
class Needs:
    """When an option acts: `when(options)` is true in the settings where it changes the run. Elsewhere
    it would do nothing, and a user who gives it is told so in one line (`says`, formatted with the
    options' values) rather than have it recorded and ignored (`Options.idle`)."""

    when: Callable[[Any], bool]
    says: str

    def message(self, opts: Any, key: str) -> str:
        """The one line for option `key` given in the setting `opts` (a dataclass: Options, Config)."""
        return self.says.format(**{f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}, key=key)


# ---- the options base class ---------------------------------------------------------------------
_KINDS = MappingProxyType({bool: "true or false", int: "an integer", float: "a number", str: "a string"})


def typed(name: str, value: Any, kind: type) -> Any:
    """`value` as an option of type `kind` (an int is a valid float), or a one-line ConfigError."""
    if kind is not bool and isinstance(value, bool):
        ok = False
    elif kind is int:
        ok = isinstance(value, numbers.Integral)
    elif kind is float:
        ok = isinstance(value, numbers.Real)
    else:
        ok = isinstance(value, kind)
    check(ok, f"{name} must be {_KINDS.get(kind, kind.__name__)}, got {value!r}")
    return kind(value)


@dataclasses.dataclass
class Options:
    """A strategy's knobs; this base class has none (DDP's)."""

    if TYPE_CHECKING:  # a strategy reads its own subclass's fields through `self.opts: Options`

        def __getattr__(self, name: str) -> Any: ...
        def __setattr__(self, name: str, value: Any) -> None: ...

    def __post_init__(self) -> None:
        kinds = get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = typed(f.name, getattr(self, f.name), kinds[f.name])
            setattr(self, f.name, value)
            for rule in f.metadata.get("rules", ()):
                rule(f.name, value)
        self.cross_check()
        check_idle(self, [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default])

    def idle(self, given: Iterable[str]) -> tuple[str, str] | None:
        """The first of `given` (option names a user gave) that acts in no way in this setting, with
        its one-line reason (its `Needs`); None when every one of them acts."""
        for f in dataclasses.fields(self):
            for needs in f.metadata.get("needs", ()) if f.name in given else ():
                if not needs.when(self):
                    return f.name, needs.message(self, f.name)
        return None

    def cross_check(self) -> None:
        """Rules relating several fields, run after every field's own rules (extend with super())."""

    @classmethod
    def with_default(cls, name: str, default: Any) -> Any:
        """This class's option `name`, help and rules included, with another default (for a subclass:
        CPDP is SlowMo with β = 0.3)."""
        return dataclasses.field(default=default, metadata=cls.__dataclass_fields__[name].metadata)


def check_idle(opts: Options, given: Iterable[str]) -> None:
    """A one-line ConfigError for the first of `given` that would do nothing in this setting. Every
    Options checks its values that differ from the default; the commands and `ws.strategy` check every
    option the user gave, a default included (`strategies.check_given`)."""
    found = opts.idle(given)
    check(found is None, found[1] if found else "")


# ---- the union over strategies: one config key per option name ----------------------------------
@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """One `[strategy]` config key / `--flag`: the fields of that name in the strategies that have it."""

    name: str
    type: type
    defaults: dict[str, Any]  # strategy -> its default
    helps: dict[str, str]  # strategy -> its help line

    @property
    def strategies(self) -> list[str]:
        return list(self.defaults)

    @property
    def help(self) -> str:
        """One line: each distinct help text, then the strategies it applies to with their defaults."""
        users: dict[str, list[str]] = {}
        for strategy, text in self.helps.items():
            users.setdefault(text, []).append(f"{strategy} {_show(self.defaults[strategy])}")
        return "; ".join(f"{text} (default: {', '.join(u)})" for text, u in users.items())


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def collect(options: Mapping[str, type[Options]]) -> dict[str, OptionSpec]:
    """The union of the options of every strategy (name -> its Options class), by option name.

    Raises TypeError for a declaration the config cannot carry: a field not made with `option()`
    (no help), or one name with two types in two strategies."""
    found: dict[str, OptionSpec] = {}
    for strategy, cls in options.items():
        kinds = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "help" not in f.metadata:
                raise TypeError(f"option {f.name!r} of strategy {strategy} has no help: declare it with option()")
            kind = kinds[f.name]
            if kind not in _KINDS:
                raise TypeError(
                    f"option {f.name!r} of strategy {strategy} is a {kind}; "
                    f"options are {', '.join(k.__name__ for k in _KINDS)}"
                )
            spec = found.setdefault(f.name, OptionSpec(f.name, kind, {}, {}))
            if spec.type is not kind:
                other = spec.strategies[0]
                raise TypeError(
                    f"option {f.name!r} is {spec.type.__name__} in strategy {other} but "
                    f"{kind.__name__} in strategy {strategy}"
                )
            spec.defaults[strategy] = f.default
            spec.helps[strategy] = f.metadata["help"]
    return found


# ---- knobs shared across strategy families ------------------------------------------------------
def sync_every(default: int) -> Any:
    return option(default, "H (K in CPDP): inner steps between synchronizations", at_least(1))


def outer_lr(default: float = 0.7) -> Any:
    return option(default, "outer (Nesterov) SGD learning rate", positive)


def overlap_rounds() -> Any:
    return option(
        False,
        "whole-round overlap (DiLoCoX): each round's mean travels during the next round's inner steps "
        "and is applied one round late",
    )


def outer_momentum(default: float = 0.9) -> Any:
    return option(default, "outer SGD momentum (Nesterov when > 0)", in_range(0, 1))


def codec(what: str = "exchanged model state", needs: tuple[Needs, ...] = ()) -> Any:
    return option(
        "fp32",
        f"codec for {what}: {'|'.join(CODEC_NAMES)} (lossy ones exchange the change since the last " "synchronization)",
        _known_codec,
        needs=needs,
    )


def _known_codec(name: str, value: str) -> None:
    """An option rule: the codec registry's own one-line error for an unknown codec."""
    check_codec(value)


def codec_collective() -> Any:
    return option(
        "auto",
        "how a lossy codec's mean travels: allgather (every payload to every worker) | "
        "reduce_scatter (about two payloads per rank whatever the workers) | auto (allgather up to 2 "
        "workers; from 3, the one the link model times shorter, else reduce_scatter)",
        one_of(LOSSY_COLLECTIVES),
        needs=LOSSY_CODEC(
            "codec_collective {codec_collective} is how a lossy codec's mean travels; an fp32 mean is one "
            "all-reduce, so it would be ignored: drop it, or choose a lossy codec (bf16, int8 or fp4)"
        ),
    )


def error_feedback() -> Any:
    return option(
        False,
        "keep what the lossy codec dropped of this worker's contribution and add it to the next " "(error feedback)",
        needs=LOSSY_CODEC(
            "error_feedback needs a lossy codec (bf16, int8 or fp4): fp32 loses nothing to feed back, so it "
            "would be ignored: drop it"
        ),
    )


def LOSSY_CODEC(says: str) -> Needs:  # noqa: N802 - reads as the condition it declares
    """The knobs of a lossy mean act only where the codec loses something."""
    return Needs(lambda o: o.codec != "fp32", says)


# ---- the robust mean of pseudo-gradients (`comm.robust`) ------------------------------------------
def robust_mean() -> Any:
    return option(
        "off",
        "robust mean of the exchanged pseudo-gradients: off | median (each worker's clipped to "
        "robust_kappa x the median of their L2 norms before the mean)",
        one_of(ROBUST_MEANS),
    )


def robust_kappa() -> Any:
    return option(
        DEFAULT_KAPPA,
        "kappa: robust_mean median clips a pseudo-gradient whose norm exceeds kappa x the median norm to that",
        positive,
        needs=Needs(
            lambda o: o.robust_mean != "off",
            "robust_kappa {robust_kappa:g} is the robust mean's clip, and robust_mean is off, so it would do "
            "nothing: drop it, or add robust_mean median",
        ),
    )


def robust_of(opts: Any) -> Any:
    """The exchange's `comm.robust.RobustMean` for these options (None: off, or a strategy without it)."""
    from ..comm.robust import RobustMean

    return RobustMean(opts.robust_kappa) if getattr(opts, "robust_mean", "off") == "median" else None


OUTER_STATE_DEVICES = ("model", "cpu")


def outer_state_device() -> Any:
    return option(
        "model",
        "where the anchors and outer momentum live and the outer step runs: model (beside "
        "the model) | cpu (host memory, pinned beside an accelerator)",
        one_of(OUTER_STATE_DEVICES),
    )


def anchor_device(value: str) -> str | None:
    """The `Anchor`'s device for an `outer_state_device` option (None: the model's)."""
    return None if value == "model" else value


# ---- the knobs of a sparse exchange (SparseLoCo, DeMo, async_diloco's sparse payload; `comm.sparse`) ---
# `needs`: where a strategy's sparse payload is one choice among others (async_diloco's `sparse`), the
# setting in which it is sent
def density(default: float, needs: tuple[Needs, ...] = ()) -> Any:
    return option(
        default,
        "fraction of each chunk's values a sparse exchange sends, the largest in magnitude " "(1: every value)",
        in_range(0, 1, low_included=False, high_included=True),
        needs=needs,
    )


def topk(needs: tuple[Needs, ...] = ()) -> Any:
    return option(
        0,
        "values sent per chunk, as the reference code counts them (its default 32; a smaller chunk "
        "sends at most all of its own); 0: from density",
        at_least(0),
        needs=needs,
    )


def chunk(default: int = 64, needs: tuple[Needs, ...] = ()) -> Any:
    return option(
        default,
        "side of the blocks a sparse exchange cuts a matrix into (the largest divisor of each "
        "dimension not above it) and length of a vector's chunks",
        at_least(1),
        needs=needs,
    )


def value_bits(default: int, needs: tuple[Needs, ...] = ()) -> Any:
    return option(
        default,
        "bits per value a sparse exchange sends: 2-8 (statistical quantizer of 2**bits bins, a "
        "lookup table per tensor) or 32 (float32, unquantized)",
        check_bits,
        needs=needs,
    )


def quant_range(needs: tuple[Needs, ...] = ()) -> Any:
    return option(
        6.0,
        "the statistical quantizer's bins span this many standard deviations of a tensor's sent " "values",
        positive,
        needs=(
            *needs,
            Needs(
                lambda o: o.bits < 32,
                "quant_range {quant_range:g} spans the quantizer's bins, and bits {bits} sends float32 values "
                "unquantized, so it would do nothing: drop it, or give bits 2-8",
            ),
        ),
    )


def error_decay(needs: tuple[Needs, ...] = ()) -> Any:
    return option(
        0.999,
        "β: the error buffer's decay, e ← β·e + Δ before each send",
        in_range(0, 1, high_included=True),
        needs=needs,
    )


def dct(needs: tuple[Needs, ...] = ()) -> Any:
    return option(False, "choose each chunk's values in the 2-D DCT domain (DeMo's transform)", needs=needs)


def aggregate() -> Any:
    return option(
        "chosen",
        "how the workers' sparse values are averaged: chosen (per index, over the workers that "
        "sent it: the reference code's) | all (their sum over every worker / M)",
        one_of(AGGREGATES),
    )


def check_sparse_options(opts: Any, default_density: float) -> None:
    """The cross-field rules of the sparse knobs: one way to say how much a chunk sends, and no more
    than a chunk holds."""
    check(
        not (opts.topk and opts.density != default_density),
        f"give density or topk, not both (topk {opts.topk} sends that many values per chunk whatever the density)",
    )
    check(
        opts.topk <= opts.chunk * opts.chunk,
        f"topk must be at most a chunk's values ({opts.chunk} x {opts.chunk} = {opts.chunk * opts.chunk}), "
        f"got {opts.topk}",
    )


def sparse_codec(opts: Any, shapes: Any, dct: bool) -> Any:
    """The sparse payload (`comm.sparse.SparseCodec`) a strategy with these options sends for tensors of
    these shapes (its own local tensors; the planner's model sizes)."""
    from ..comm.chunks import ChunkLayout
    from ..comm.sparse import SparseCodec
    from ..comm.chunks import DEFAULT_CHUNK

    layout = ChunkLayout.of_shapes(shapes, opts.chunk)
    # the default shrinks to a small model's tensors (each one chunk); a chunk the user chose must cut something
    check(
        opts.chunk == DEFAULT_CHUNK or opts.chunk <= layout.largest_side,
        f"chunk {opts.chunk} is larger than every tensor of the model (its longest side is {layout.largest_side}): "
        f"no tensor would be cut into chunks; give at most {layout.largest_side}",
    )
    return SparseCodec(
        layout,
        density=opts.density,
        topk=opts.topk,
        bits=opts.bits,
        range_sigmas=opts.quant_range,
        dct=dct,
        # async_diloco has no `aggregate`: its syncer decodes each payload alone, where the two are one
        aggregate=getattr(opts, "aggregate", "chosen"),
    )
