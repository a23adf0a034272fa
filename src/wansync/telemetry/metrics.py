"""metrics.jsonl: one JSON object per step, evaluation and sync event (written by rank 0); a NaN is null."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..rundir import jsonout


class MetricsWriter:
    def __init__(self, path: str | Path | None, append: bool = False):
        self._f = open(path, "a" if append else "w", buffering=1) if path else None

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(jsonout.dumps(record) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
