"""Sizes and durations as a person reads them, the same way in every table wansync prints."""
from __future__ import annotations

import math


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
