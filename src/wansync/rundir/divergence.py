"""Did a run diverge? One rule, used by `train` (summary.json, the closing warning), the report and
the runner: a run that exits 0 with a model worse than where it started is not a success.

A run *diverged* when its final evaluation is worse than its first one, or no better than chance:

- LM: final validation loss above the first evaluation's, or at/above ln(vocab) (a uniform guess);
  a non-finite final loss also counts;
- vision: final test accuracy below the first evaluation's, or at/below 100/classes percent.

With a single evaluation only the chance level applies.
"""

from __future__ import annotations

import math
from typing import Any, Sequence


def chance_level(facts: dict[str, Any]) -> float | None:
    """The chance level of a workload from its describe() facts: ln(vocab) nats for an LM, 100/classes
    percent for a classifier; None when neither is known."""
    if facts.get("vocab"):
        return math.log(int(facts["vocab"]))
    if facts.get("classes"):
        return 100.0 / int(facts["classes"])
    return None


def diverged(evals: Sequence[dict[str, Any]], chance: float | None) -> bool:
    """True when the evaluation records (in step order) end worse than they started or at chance."""
    if not evals:
        return False
    first, final = evals[0], evals[-1]
    if "val_loss" in final:
        loss = float(final["val_loss"])
        if not math.isfinite(loss):
            return True
        return (len(evals) > 1 and loss > float(first["val_loss"])) or (chance is not None and loss >= chance)
    acc = float(final["test_acc"])
    if not math.isfinite(acc):
        return True
    return (len(evals) > 1 and acc < float(first["test_acc"])) or (chance is not None and acc <= chance)


def warning(summary: dict[str, Any]) -> str:
    """The one-line warning printed at the end of a diverged run."""
    if "final_val_loss" in summary:
        what = f"final validation loss {summary['final_val_loss']:.4f}"
        chance = f"chance ln(vocab) = {summary['chance_level']:.4f}" if summary.get("chance_level") else ""
    else:
        what = f"final test accuracy {summary['final_test_acc']:.2f}%"
        chance = f"chance {summary['chance_level']:.2f}%" if summary.get("chance_level") else ""
    return (
        f"wansync: warning: the run diverged ({what}, first evaluation {summary['first_eval']:.4g}"
        + (f", {chance}" if chance else "")
        + "): marked diverged in summary.json"
    )


def quality_fields(evals: Sequence[dict[str, Any]], chance: float | None) -> dict[str, Any]:
    """summary.json's quality fields: the final and best quality, the first evaluation and the
    divergence flag, from the evaluation records (validation loss, or test accuracy in percent)."""
    if not evals:
        return {}
    final = evals[-1]
    out: dict[str, Any] = {}
    if "val_loss" in final:
        losses = [e["val_loss"] for e in evals if "val_loss" in e]
        out.update(
            final_val_loss=final["val_loss"],
            final_val_ppl=final.get("val_ppl", math.exp(min(final["val_loss"], 80.0))),
            best_val_loss=min(losses),
            best_val_ppl=math.exp(min(losses)),
        )
        if "val_bpb" in final:  # bits per byte: comparable across tokenizers
            out.update(final_val_bpb=final["val_bpb"], best_val_bpb=min(e["val_bpb"] for e in evals if "val_bpb" in e))
        key = "val_loss"
    elif "test_acc" in final:
        out.update(final_test_acc=final["test_acc"], peak_test_acc=max(e["test_acc"] for e in evals if "test_acc" in e))
        if "test_loss" in final:
            out["final_test_loss"] = final["test_loss"]
        key = "test_acc"
    else:
        return {}
    out.update(first_eval=evals[0].get(key), chance_level=chance, diverged=diverged(evals, chance))
    return out
