"""A workload of the user's (`--data pkg.module:factory`) behind the full `Workload` protocol.

The user writes the four things only they know: `model`, `next_batch()`, `loss(model, batch)` and
`evaluate(model)`. The rest has a default here, each one that keeps the run correct rather than
approximate: the data position is the number of batches served, and a resumed or healed worker
gets there by drawing that many batches again from a workload the factory built afresh from the
same seed (a workload with `skip_to`, or `state_dict`/`load_state_dict`, gets there its own way).
`evaluate` must name the metric the run is judged by (`kind` "lm": `val_loss`; "vision":
`test_loss` and `test_acc`); a missing one is one line, not a report without its column.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, DataError
from .base import WorkloadSpec
from .factory import call_factory, load_factory

REQUIRED = ("next_batch", "loss", "evaluate")
KINDS = ("lm", "vision")
METRICS = MappingProxyType({"lm": ("val_loss",), "vision": ("test_loss", "test_acc")})  # what each kind is judged by


def check_batch(batch: Any, source: str) -> None:
    """A batch is a tuple (or list) of tensors whose first dimension is the batch: a worker of several
    ranks splits it along that dimension, and the throughput counts its rows."""
    if not isinstance(batch, (tuple, list)) or not batch:
        raise DataError(
            f"--data {source}: next_batch() returned {type(batch).__name__}, not a tuple of tensors "
            f"whose first dimension is the batch (docs/your_model.md)"
        )
    bad = next((i for i, t in enumerate(batch) if not isinstance(t, torch.Tensor) or t.dim() == 0), None)
    if bad is not None:
        what = type(batch[bad]).__name__ if not isinstance(batch[bad], torch.Tensor) else "a 0-d tensor"
        raise DataError(
            f"--data {source}: next_batch() returned a {type(batch).__name__} whose item {bad} is {what}, "
            f"not a tensor whose first dimension is the batch (docs/your_model.md)"
        )


class UserWorkload:
    """The user's workload, its missing methods supplied (see the module docstring)."""

    def __init__(self, workload: Any, source: str) -> None:
        self.workload, self.source = workload, source
        self.model: nn.Module = workload.model
        self.kind: str = getattr(workload, "kind", "lm")
        self.batches = 0  # batches served: the data position when the workload keeps none

    def next_batch(self) -> Any:
        self.batches += 1
        try:
            batch = self.workload.next_batch()
        except StopIteration:  # an iterator run dry: torch and Python would say nothing more
            raise DataError(
                f"--data {self.source}: next_batch() raised StopIteration at batch {self.batches}: "
                f"its data is empty or ran out (next_batch() must serve batches for the whole run: "
                f"start the next epoch when one ends)"
            ) from None
        if self.batches == 1:  # the contract, checked where it is first met
            check_batch(batch, self.source)
        return batch

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.workload.loss(model, batch)

    def batch_size_items(self, batch: Any) -> int:
        own = getattr(self.workload, "batch_size_items", None)
        if own is not None:
            return int(own(batch))
        first = batch[0] if isinstance(batch, (tuple, list)) else batch
        return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        metrics = self.workload.evaluate(model)
        if not isinstance(metrics, dict):
            raise DataError(
                f"--data {self.source}: evaluate() returned {type(metrics).__name__}, not a dict of " f"metrics"
            )
        missing = [k for k in METRICS[self.kind] if k not in metrics]
        if missing:
            raise DataError(
                f"--data {self.source}: evaluate() of a kind {self.kind!r} workload must return "
                f"{' and '.join(METRICS[self.kind])}; {', '.join(missing)} is missing"
            )
        out = {k: float(v) for k, v in metrics.items()}
        if self.kind == "lm" and "val_ppl" not in out:
            out["val_ppl"] = math.exp(min(out["val_loss"], 80.0))
        return out

    def epoch_progress(self) -> float:
        own = getattr(self.workload, "epoch_progress", None)
        return float(own()) if own is not None else 0.0

    def state_dict(self) -> dict[str, Any]:
        own = getattr(self.workload, "state_dict", None)
        return {"batches": self.batches, "own": own() if own is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = getattr(self.workload, "load_state_dict", None)
        if own is not None and state.get("own") is not None:
            own(state["own"])
            self.batches = int(state["batches"])
        else:
            self.skip_to(int(state["batches"]))

    def skip_to(self, steps: int) -> None:
        """Serve next the batch number `steps` (its own `skip_to`, else by drawing the batches between)."""
        own = getattr(self.workload, "skip_to", None)
        if own is not None:
            own(steps)
            self.batches = steps
            return
        if steps < self.batches:
            raise DataError(
                f"--data {self.source}: cannot go back from batch {self.batches} to {steps} "
                f"without a skip_to(steps) method on the workload"
            )
        while self.batches < steps:
            self.next_batch()

    def describe(self) -> dict[str, Any]:
        own = getattr(self.workload, "describe", None)
        facts = dict(own()) if own is not None else {}
        facts.setdefault("model", type(self.model).__name__)
        facts.setdefault("params", sum(p.numel() for p in self.model.parameters()))
        facts.setdefault("data", self.source)
        return facts


def build_user_workload(source: str, spec: WorkloadSpec) -> UserWorkload:
    """The workload `--data source` builds for `spec`, under `torch.manual_seed(spec.seed)` (every worker
    builds the same initial model), checked against the contract."""
    factory = load_factory(source, "--data")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        workload = call_factory(factory, spec, source, "--data")
    missing = [name for name in REQUIRED if not callable(getattr(workload, name, None))]
    if not isinstance(getattr(workload, "model", None), nn.Module):
        missing.insert(0, "model (a torch.nn.Module)")
    if missing:
        raise ConfigError(
            f"--data {source} returned a {type(workload).__name__} without {', '.join(missing)} "
            f"(a workload has model, next_batch(), loss(model, batch) and evaluate(model); "
            f"docs/your_model.md)"
        )
    kind = getattr(workload, "kind", "lm")
    if kind not in KINDS:
        raise ConfigError(
            f"--data {source}: the workload's kind must be 'lm' (judged by val_loss) or 'vision' "
            f"(judged by test_acc), got {kind!r}"
        )
    return UserWorkload(workload, source)
