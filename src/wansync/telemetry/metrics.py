"""metrics.jsonl: one JSON object per step, evaluation and sync event (written by rank 0); a NaN is null."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..rundir import files, jsonout


class MetricsWriter:
    def __init__(self, path: str | Path | None, append: bool = False):
        """`append`: lines go after the file's own (a resumed run's); else a new file takes its place."""
        self._f = (files.append(path) if append else files.fresh(path)) if path else None

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(jsonout.dumps(record) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
