"""The strategy registry: every module of this package is imported, and every `Strategy` subclass
with a `name` is a strategy. Adding one is adding one file.

The options of all strategies together (`OPTIONS`, one entry per option name, see `options.collect`)
are the `[strategy]` config keys and the matching `--flags`; each strategy validates its own.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from ..errors import ConfigError
from .base import Strategy
from .options import Options, OptionSpec, collect
from .timetable import Timetable


def _subclasses(cls: type[Strategy]) -> Iterator[type[Strategy]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _discover() -> dict[str, type[Strategy]]:
    """name -> class for every named Strategy subclass in this package, the simplest (fewest options)
    first: DDP, the baseline, leads listings, demos and reports."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    found: dict[str, type[Strategy]] = {}
    for cls in _subclasses(Strategy):
        if not cls.name or not cls.__module__.startswith(f"{__name__}."):
            continue
        if found.get(cls.name, cls) is not cls:
            raise TypeError(
                f"two strategies are called {cls.name!r}: {found[cls.name].__qualname__} and " f"{cls.__qualname__}"
            )
        found[cls.name] = cls
    return dict(sorted(found.items(), key=lambda item: (len(dataclasses.fields(item[1].Options)), item[0])))


STRATEGIES: dict[str, type[Strategy]] = _discover()
OPTIONS: dict[str, OptionSpec] = collect({name: cls.Options for name, cls in STRATEGIES.items()})


def strategy_class(name: str) -> type[Strategy]:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"unknown strategy '{name}' (available: {', '.join(STRATEGIES)})") from None


def option_names(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(strategy_class(name).Options)]


def make_options(name: str, **values: Any) -> Options:
    """The strategy's Options from keyword values (validated); None means the strategy's default."""
    valid = option_names(name)
    unknown = [k for k in values if k not in valid]
    if unknown:
        raise ConfigError(f"strategy {name} has no option {unknown[0]!r} (its options: {', '.join(valid) or 'none'})")
    return strategy_class(name).Options(**{k: v for k, v in values.items() if v is not None})


def check_given(name: str, values: Mapping[str, Any]) -> None:
    """The options a caller gave `ws.strategy` (None: not given) each act in this setting: one that would
    do nothing (`quant_range` at bits 32) is refused in one line, as on the command line."""
    own = {k: v for k, v in values.items() if k in option_names(name)}  # the rest: `build`'s own keywords
    idle = make_options(name, **own).idle([k for k, v in own.items() if v is not None])
    if idle is not None:
        raise ConfigError(idle[1])


def resolve_options(name: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """Strategy `name`'s options with its defaults filled in, validated, as a dict (what config.toml
    and checkpoints record). Keys of `values` the strategy does not have are ignored (a config holds
    every strategy's keys); None means the default."""
    own = option_names(name)
    return dataclasses.asdict(make_options(name, **{k: v for k, v in values.items() if k in own}))


def timetable(name: str, options: Mapping[str, Any]) -> Timetable:
    """Strategy `name`'s timetable from its options alone (no model, no process group): the one its
    strategy follows, for the planner to predict from (`timetable.py`)."""
    return strategy_class(name).Timetable(make_options(name, **options))


def build(
    name: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    group: Any = None,
    on_nonfinite: str | None = None,
    replicas: Any = None,
    quorum: Any = None,
    mesh: Any = None,
    **options: Any,
) -> Strategy:
    """Build a strategy on an existing process group (the public `wansync.strategy`).
    `on_nonfinite` (None, "abort", "skip"): what its exchange does with NaN/Inf model state.
    `replicas` (`comm.replicas.replica_groups(R)`): workers of R ranks each; for a model sharded
    with FSDP2 (`fully_shard`) found from its mesh, or from `mesh` (a 2-D workers x ranks mesh).
    `quorum` (`ft.quorum.Quorum`): fault tolerant, its exchanges average over the workers alive now."""
    cls = strategy_class(name)
    return cls(
        model,
        optimizer,
        make_options(name, **options),
        group=group,
        on_nonfinite=on_nonfinite,
        replicas=replicas,
        quorum=quorum,
        mesh=mesh,
    )
