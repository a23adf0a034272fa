"""The strategy registry: every strategy by name, its options, and its class.

The names and options are `catalog.py`'s list, which imports no torch: the options of all
strategies together (`OPTIONS`, one entry per option name, see `options.collect`) are the
`[strategy]` config keys and the matching `--flags`, and each strategy validates its own, all
without torch. A strategy's class (the algorithm, on torch) is imported from the module of its name
the first time it is wanted: `strategy_class(name)`, `build`, `timetable`, and `STRATEGIES`, every
class by name. Adding a strategy is adding its module and its entry in the catalog; the classes and
the catalog are checked against each other (`tests/test_strategy_options.py`).
"""

from __future__ import annotations

import dataclasses
import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import ConfigError
from .catalog import OPTIONS_OF
from .options import Options, OptionSpec, collect
from .timetable import Timetable  # imported here, so the name `timetable` stays the function below

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .base import Strategy

    STRATEGIES: Mapping[str, type[Strategy]]  # made on first use (`__getattr__`)


def _simplest_first(name: str) -> tuple[int, str]:
    """The order of every listing: the fewest options first, so DDP, the baseline, leads listings,
    demos and reports."""
    return len(dataclasses.fields(OPTIONS_OF[name])), name


#: every strategy's name, in listing order (no torch; `STRATEGIES` holds the classes in the same order)
NAMES: tuple[str, ...] = tuple(sorted(OPTIONS_OF, key=_simplest_first))
OPTIONS: dict[str, OptionSpec] = collect({name: OPTIONS_OF[name] for name in NAMES})


def options_class(name: str) -> type[Options]:
    """Strategy `name`'s Options (no torch), or a one-line ConfigError naming the strategies."""
    try:
        return OPTIONS_OF[name]
    except KeyError:
        raise ConfigError(f"unknown strategy '{name}' (available: {', '.join(NAMES)})") from None


def strategy_class(name: str) -> type[Strategy]:
    """Strategy `name`'s class, from the module of its name (`diloco` is `diloco.py`): this imports
    torch. The class's `Options` must be the catalog's, so the flags are the options it builds with."""
    wanted = options_class(name)
    from .base import Strategy

    module = importlib.import_module(f"{__name__}.{name}")
    found = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, Strategy) and c.name == name]
    if len(found) != 1 or found[0].Options is not wanted:
        raise TypeError(
            f"{module.__name__} must define one Strategy called {name!r} whose Options are "
            f"{wanted.__qualname__} (the catalog's), found {[c.__qualname__ for c in found]}"
        )
    return found[0]


def __getattr__(attr: str) -> Any:
    """`STRATEGIES`: name -> class of every strategy, in listing order, made on first use (each class
    imports torch; the names, options, flags and help do not)."""
    if attr == "STRATEGIES":
        return MappingProxyType({name: strategy_class(name) for name in NAMES})
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def option_names(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(options_class(name))]


def make_options(name: str, **values: Any) -> Options:
    """The strategy's Options from keyword values (validated); None means the strategy's default."""
    valid = option_names(name)
    unknown = [k for k in values if k not in valid]
    if unknown:
        raise ConfigError(f"strategy {name} has no option {unknown[0]!r} (its options: {', '.join(valid) or 'none'})")
    return options_class(name)(**{k: v for k, v in values.items() if v is not None})


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
