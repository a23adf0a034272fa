"""An experiment's grid as a user writes it: strategy names checked against the registry, lists of
values (`a,b,c`, or `;` between values that hold commas), `--grid key=v1,v2` typed by the config key,
and the label a setting's run directory is named by (`runner.experiments` runs the grid)."""

from __future__ import annotations

import re
from typing import Any, Sequence

from .. import strategies as registry
from ..config import coerce, key_names
from ..errors import ConfigError

# Keys a grid may not vary (they name the place or the repetition, handled separately).
_NOT_GRIDDABLE = ("out",)


def available_strategies() -> list[str]:
    return list(registry.STRATEGIES)


def check_strategies(names: Sequence[str], context: str = "") -> list[str]:
    """Validate strategy names against the registry; one-line error naming the available ones."""
    avail = available_strategies()
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise ConfigError(f"no strategies given{context} (available: {', '.join(avail)})")
    for n in names:
        if n not in avail:
            raise ConfigError(f"unknown strategy '{n}'{context} (available: {', '.join(avail)})")
    if len(set(names)) != len(names):
        raise ConfigError(f"strategy listed twice{context}: {', '.join(names)}")
    return names


def split_values(text: str, what: str) -> list[str]:
    """'a,b,c' -> [a, b, c]; when a value itself holds commas (a --wan spec) separate with ';'. An
    empty value (`1,,2`, `wan=;lan`, a trailing comma) is refused, not dropped."""
    sep = ";" if ";" in text else ","
    values = [v.strip() for v in text.split(sep)]
    if not any(values):
        raise ConfigError(f"{what}: no values given")
    if "" in values:
        raise ConfigError(
            f"{what}: an empty value in {text!r} (values are separated by {sep!r}; write none for "
            f"a key's unset value)"
        )
    return values


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """['sync_every=1,2,4', 'lr=1e-3,3e-3'] -> {'sync_every': [1, 2, 4], 'lr': [0.001, 0.003]}.

    Keys are config keys (dashes allowed); values are parsed with the key's type."""
    grid: dict[str, list[Any]] = {}
    valid = key_names()
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"--grid {item!r}: expected key=value1,value2,...")
        if key not in valid:
            raise ConfigError(f"--grid: unknown config key '{key}' (valid keys: {', '.join(valid)})")
        if key in _NOT_GRIDDABLE:
            raise ConfigError(f"--grid: '{key}' cannot be swept (use --out for the experiment directory)")
        if key in grid:
            raise ConfigError(f"--grid: key '{key}' given twice")
        parsed = [coerce(key, t) for t in split_values(values, f"--grid {key}")]
        if len(set(map(repr, parsed))) != len(parsed):
            raise ConfigError(f"--grid {key}: a value is listed twice")
        grid[key] = parsed
    return grid


_SAFE = re.compile(r"[^A-Za-z0-9._+\-=]")


def _fmt(v: Any) -> str:
    if v == "":  # a key's unset value (wan=none)
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def setting_label(strategy: str, setting: dict[str, Any]) -> str:
    parts = [strategy] + [f"{k}={_fmt(v)}" for k, v in setting.items()]
    return _SAFE.sub("-", "__".join(parts))
