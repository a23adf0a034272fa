"""JSON every reader accepts: a NaN or infinite float is written as null.

Python's `json.dumps` writes bare `NaN` and `Infinity`, which are not JSON (strict parsers, jq and
browsers refuse the whole file); a diverged run must still leave readable files.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every non-finite float, at any depth, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kw: Any) -> str:
    return json.dumps(finite(value), allow_nan=False, **kw)


def number(v: Any) -> float | None:
    """A finite float from a JSON value, else None (a missing key, a string, NaN)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None
