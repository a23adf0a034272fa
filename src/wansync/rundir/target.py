"""Time to target: the first evaluation at which a run reaches a validation loss or test accuracy.

The figure that compares strategies on a slow link is not the final loss but how soon each one gets
to a loss worth having: the step and the wall-clock second (the evaluation record's clock since
training started) of the first evaluation that reaches the target. Its resolution is the evaluation
interval. A run that never reaches it says so ("not reached"), it is not dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .jsonout import number


@dataclass(frozen=True)
class Target:
    metric: str  # the eval record's key: "val_loss" or "test_acc"
    value: float
    higher_is_better: bool
    source: str  # why this value: "given (--target-loss)", "DDP's final ..."

    def reached(self, value: float) -> bool:
        return value >= self.value if self.higher_is_better else value <= self.value


def given_target(target_loss: float | None, target_acc: float | None, kind: str) -> Target | None:
    """The target the user gave for a workload of `kind` ("lm": a loss; "vision": an accuracy in %)."""
    if kind == "vision":
        return None if target_acc is None else Target("test_acc", float(target_acc), True, "given (--target-acc)")
    return None if target_loss is None else Target("val_loss", float(target_loss), False, "given (--target-loss)")


def first_reached(evals: Sequence[dict[str, Any]], target: Target) -> tuple[int, float | None] | None:
    """(step, seconds) of the first evaluation, in step order, whose metric reaches the target; None if none does."""
    for e in sorted(evals, key=lambda e: e["step"]):
        v = number(e.get(target.metric))
        if v is not None and target.reached(v):
            return int(e["step"]), number(e.get("time"))
    return None


def target_record(evals: Sequence[dict[str, Any]], target: Target) -> dict[str, Any]:
    """What summary.json says about the target: metric, value, source, and step/time_s (null: not reached)."""
    hit = first_reached(evals, target)
    return {
        "metric": target.metric,
        "value": target.value,
        "source": target.source,
        "reached": hit is not None,
        "step": hit[0] if hit else None,
        "time_s": hit[1] if hit else None,
    }


def read_evals(path: str | Path) -> list[dict[str, Any]]:
    """The evaluation records of a metrics.jsonl; torn or damaged lines (a killed run) are skipped."""
    return read_records(path, "eval")


def read_records(path: str | Path, kind: str) -> list[dict[str, Any]]:
    """The records of type `kind` (eval, step, sync) of a metrics.jsonl, with a step number; torn or
    damaged lines (a killed run) are skipped."""
    out: list[dict[str, Any]] = []
    if not Path(path).is_file():  # missing, or a FIFO that would block the reader
        return out
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line) if line.strip() else None
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and rec.get("type") == kind and number(rec.get("step")) is not None:
                    out.append(rec)
    except OSError:
        pass
    return out
