"""Short human labels for a comparison's settings: "CoCoDC, N = 8, α-merge" where the run directory says
`cocodc__syncs_per_period=8__compensation=alpha`. The directory name stays the key (it is unique and
safe on disk); prose and figures use the label. A key this module does not know is shown as
"key value", never dropped, so two settings never share a label because one was left out.
"""

from __future__ import annotations

import math
from collections import Counter
from types import MappingProxyType
from typing import Any, Callable, Mapping

STRATEGY_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "ddp": "DDP",
        "local_sgd": "LocalSGD",
        "post_local_sgd": "Post-local SGD",
        "slowmo": "LocalSGD+SlowMo",
        "cpdp": "CPDP",
        "diloco": "DiLoCo",
        "streaming": "Streaming DiLoCo",
        "cocodc": "CoCoDC",
        "sparseloco": "SparseLoCo",
        "demo": "DeMo",
        "async_diloco": "Async DiLoCo",
    }
)
# the period is K for the methods that average parameters, H for those with an outer optimizer
_K_PERIOD = frozenset({"local_sgd", "post_local_sgd", "slowmo", "cpdp"})


def _num(v: Any) -> str:
    if isinstance(v, float) and math.isfinite(v):
        return format(v, "g")
    return str(v)


def _flag(on: str, off: str) -> Callable[[Any], str]:
    return lambda v: on if str(v).lower() in ("true", "1") else off


def _eq(symbol: str) -> Callable[[Any], str]:
    return lambda v: f"{symbol} = {_num(v)}"


_WORDS: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
        "compensation": MappingProxyType({"alpha": "α-merge", "taylor": "Taylor merge", "damped": "damped merge"}),
        "schedule": MappingProxyType(
            {"round_robin": "round-robin", "adaptive": "adaptive order", "adaptive_fair": "adaptive-fair order"}
        ),
        "lr_scaling": MappingProxyType({"none": "fixed lr", "linear": "linear-scaled lr"}),
        "aggregate": MappingProxyType({"chosen": "chosen-index mean", "all": "mean over all"}),
        "slow_policy": MappingProxyType(
            {"wait": "wait for the slow worker", "deadline": "deadline", "balanced": "balanced work"}
        ),
        "partition": MappingProxyType({"strided": "strided fragments", "contiguous": "contiguous fragments"}),
        "outer_scaling": MappingProxyType({"none": "unscaled outer step"}),
        "staleness_rule": MappingProxyType(
            {"none": "no staleness rule", "polynomial": "polynomial staleness", "delayed_nesterov": "delayed Nesterov"}
        ),
    }
)

# how each known key reads; the order here is the order in a label
_SHOWN: Mapping[str, Callable[[Any], str]] = MappingProxyType(
    {
        "sync_every": _eq("H"),  # K for the averaging methods: `human_label`
        "switch_step": lambda v: f"local from step {_num(v)}",
        "slowmo_beta": _eq("β"),
        "fragments": _eq("P"),
        "overlap": _eq("τ"),
        "syncs_per_period": _eq("N"),
        "alpha": _eq("α"),
        "lam": _eq("λ"),
        "gamma": _eq("γ"),
        "outer_lr": lambda v: f"outer lr {_num(v)}",
        "outer_momentum": lambda v: f"outer momentum {_num(v)}",
        "lr": lambda v: f"lr {_num(v)}",
        "density": lambda v: f"density {_num(v)}",
        "topk": lambda v: f"top-{_num(v)}",
        "chunk": lambda v: f"chunk {_num(v)}",
        "bits": lambda v: f"{_num(v)}-bit",
        "codec": lambda v: str(v),
        "codec_collective": lambda v: f"{v} collective",
        "error_feedback": _flag("error feedback", "no error feedback"),
        "eager": _flag("eager", "not eager"),
        "overlap_rounds": _flag("overlapped rounds", "rounds not overlapped"),
        "dct": _flag("DCT", "no DCT"),
        "deadline": lambda v: f"deadline {_num(v)} s",
        "max_syncs_per_fragment": lambda v: f"≤ {_num(v)} syncs per fragment",
        "merge_quorum": lambda v: f"quorum {_num(v)}",
        "grace": lambda v: f"grace {_num(v)} s",
        "dynamic_h": _flag("H by speed", "equal H"),
        "max_staleness": lambda v: f"staleness ≤ {_num(v)}",
        "sparse": _flag("sparse payload", "dense payload"),
    }
)


def _part(strategy: str, key: str, value: Any) -> str:
    if key == "sync_every" and strategy in _K_PERIOD:
        return f"K = {_num(value)}"
    if key in _WORDS:
        return _WORDS[key].get(str(value), f"{key.replace('_', ' ')} {value}")
    if key in _SHOWN:
        return _SHOWN[key](value)
    return f"{key.replace('_', ' ')} {_num(value)}"


def setting_words(strategy: str, setting: Mapping[str, Any]) -> list[str]:
    """Each of a `strategy`'s settings in words ("N = 8", "α-merge"), in a fixed order."""
    order = list(_SHOWN) + list(_WORDS)
    keys = sorted(setting, key=lambda k: (order.index(k) if k in order else len(order), k))
    return [_part(strategy, k, setting[k]) for k in keys]


def human_label(strategy: str, setting: Mapping[str, Any]) -> str:
    """ "CoCoDC, N = 8, α-merge": the strategy's name, then each setting in a fixed order."""
    return ", ".join([STRATEGY_NAMES.get(strategy, strategy), *setting_words(strategy, setting)])


def label_of_key(key: str) -> str:
    """The label of a run directory's setting key (`strategy__k=v__...`, `runner.grid.setting_label`)."""
    strategy, *pairs = key.split("__")
    setting = {k: v for k, _, v in (p.partition("=") for p in pairs)}
    return human_label(strategy, setting)


def distinct(names: Mapping[str, str]) -> dict[str, str]:
    """Labels by key, where two keys would share a label (a setting not recorded) each keeps its key."""
    seen = Counter(names.values())
    return {k: v if seen[v] == 1 else k for k, v in names.items()}
