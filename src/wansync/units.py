"""Sizes and durations as a person reads and writes them, the same way in every table wansync prints."""

from __future__ import annotations

import math
import re
from types import MappingProxyType


def human_bytes(n: float | None) -> str:
    """`n` bytes with a decimal unit (B, kB, MB, GB, TB) and 3 significant digits; "–" for none."""
    if n is None:
        return "–"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def human_seconds(s: float) -> str:
    """`s` seconds in the largest unit that keeps it at 1 or more (s, min, h, d); "inf" when unbounded."""
    if not math.isfinite(s):
        return "inf"
    if s >= 86400:
        return f"{s / 86400:.3g} d"
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 60:
        return f"{s / 60:.3g} min"
    return f"{s:.3g} s"


BYTE_UNITS = MappingProxyType(
    {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
)


def parse_bytes(text: str) -> float:
    """Bytes from a size a person writes: a positive number and a unit, decimal (kB, MB, GB, TB)
    or binary (KiB, MiB, GiB, TiB), any case, with or without a space: "80GB", "141 GB", "24GiB".
    A ValueError that says what was wrong, in one line."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in BYTE_UNITS:
        raise ValueError(
            f"{text!r} is not a size: give a number and a unit, e.g. 80GB or 24GiB "
            "(units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    try:
        value = float(m.group(1)) * BYTE_UNITS[unit]
    except ValueError:
        raise ValueError(f"{text!r} is not a size: {m.group(1)!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{text!r} is not a size: it must be positive and finite")
    return value
