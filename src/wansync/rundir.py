"""What a run directory and an experiment directory hold, shared by the runner, the report and the plots.

    OUT/experiment.json              PLAN_FILE: the plan (labels, settings, seeds, report targets)
    OUT/<label>/seed<k>/             one run: config.toml, metrics.jsonl, profile.json, summary.json
    OUT/<label>/seed<k>/failed.json  FAILED_FILE: a run that failed, with its one-line message

A :class:`Run` is one run directory as read back; a :class:`Setting` is the runs of one label (all
seeds); a :class:`Quality` says which metric judges them (validation loss or test accuracy).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .divergence import diverged
from .telemetry.profiler import CATEGORIES

__all__ = ["CATEGORIES", "FAILED_FILE", "LM", "PLAN_FILE", "Quality", "Run", "Setting", "VISION", "human_bytes",
           "number"]

PLAN_FILE = "experiment.json"
FAILED_FILE = "failed.json"


@dataclass
class Run:
    dir: Path
    label: str
    strategy: str
    seed: int | None
    setting: dict[str, Any]
    status: str                                   # "ok" or "failed: <message>" (a diverged run is ok)
    summary: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def diverged(self) -> bool:
        """Finished, but ended worse than it started or at chance: summary.json's flag, or for a run
        written before the flag existed the same rule on its evaluation records (`divergence.py`)."""
        if not self.ok:
            return False
        if "diverged" in self.summary:
            return bool(self.summary["diverged"])
        return diverged(self.evals, number(self.summary.get("chance_level")))


@dataclass
class Setting:
    label: str
    strategy: str
    setting: dict[str, Any]
    runs: list[Run]

    @property
    def ok_runs(self) -> list[Run]:
        return [r for r in self.runs if r.ok]

    @property
    def status(self) -> str:
        failed = [r for r in self.runs if not r.ok]
        if not failed:
            diverged = sum(r.diverged for r in self.runs)
            return f"diverged ({diverged}/{len(self.runs)} seeds)" if diverged else "ok"
        if len(failed) == len(self.runs):
            return failed[0].status
        return f"partial: {len(failed)}/{len(self.runs)} seeds {failed[0].status}"


@dataclass(frozen=True)
class Quality:
    kind: str             # "lm" | "vision"
    eval_key: str         # key in eval records
    final_key: str        # key in summary.json
    best_key: str
    higher_is_better: bool
    name: str             # for axis labels
    unit: str

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target


LM = Quality("lm", "val_loss", "final_val_loss", "best_val_loss", False, "validation loss", "nats/token")
VISION = Quality("vision", "test_acc", "final_test_acc", "peak_test_acc", True, "test accuracy", "%")


def number(v: Any) -> float | None:
    """A finite float from a JSON value, else None (a missing key, a string, NaN)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def human_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
