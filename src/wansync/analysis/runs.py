"""Finished runs as the report reads them back (the directory's layout: `rundir.layout`).

A :class:`Run` is one run directory as read back; a :class:`SettingRuns` is the runs of one label (all
seeds); a :class:`Quality` says which metric judges them (validation loss or test accuracy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..rundir.divergence import diverged
from ..rundir.layout import METRICS_FILE
from ..rundir.target import read_records
from ..rundir.jsonout import number
from ..telemetry.profiler import CATEGORIES

__all__ = ["CATEGORIES", "LM", "Quality", "Run", "SettingRuns", "VISION", "number"]


@dataclass
class Run:
    dir: Path
    label: str
    strategy: str
    seed: int | None
    setting: dict[str, Any]
    status: str  # "ok" or "failed: <message>" (a diverged run is ok)
    summary: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def steps(self) -> list[dict[str, Any]]:
        """The run's per-step records (metrics.jsonl: loss, time, exposed_s), read when asked."""
        return read_records(self.dir / METRICS_FILE, "step")

    def decisions(self) -> list[dict[str, Any]]:
        """What `--adapt` changed and why (metrics.jsonl's `adapt` records), read when asked."""
        return read_records(self.dir / METRICS_FILE, "adapt")

    def merges(self) -> list[dict[str, Any]]:
        """What an asynchronous run's syncer merged (metrics.jsonl's `merge` records), read when asked."""
        return read_records(self.dir / METRICS_FILE, "merge")

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
class SettingRuns:
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
    kind: str  # "lm" | "vision"
    eval_key: str  # key in eval records
    final_key: str  # key in summary.json
    best_key: str
    higher_is_better: bool
    name: str  # for axis labels
    unit: str

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target


LM = Quality("lm", "val_loss", "final_val_loss", "best_val_loss", False, "validation loss", "nats/token")
VISION = Quality("vision", "test_acc", "final_test_acc", "peak_test_acc", True, "test accuracy", "%")
