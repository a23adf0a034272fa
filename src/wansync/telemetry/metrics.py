"""metrics.jsonl: one JSON object per step, evaluation and sync event (written by rank 0)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsWriter:
    def __init__(self, path: str | Path | None, append: bool = False):
        self._f = open(path, "a" if append else "w", buffering=1) if path else None

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
