"""Every collective a strategy issues goes through here: counted, sized, timed.

The ledger is what tests count ("a CPDP boundary exchanges the gradients once and the
parameters once") and what the profiler reads for exposed communication. Purposes name *why*
bytes moved: `params`, `grads`, `pseudo_grads`, `optim_state`, `telemetry`, ...
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import NonFiniteError


@dataclass
class CommTotals:
    calls: int = 0
    bytes: int = 0
    waited_s: float = 0.0


@dataclass
class CommLedger:
    """Per-strategy counters by purpose, plus listeners notified of every wait."""

    totals: dict[str, CommTotals] = field(default_factory=lambda: defaultdict(CommTotals))
    on_wait: list[Callable[[str, float], None]] = field(default_factory=list)
    nonfinite: str | None = None         # None (no check), "abort" or "skip"
    dropped: int = 0                     # exchanges this worker sat out (non-finite, policy skip)

    def count(self, purpose: str, nbytes: int) -> None:
        t = self.totals[purpose]
        t.calls += 1
        t.bytes += nbytes

    def waited(self, purpose: str, seconds: float) -> None:
        self.totals[purpose].waited_s += seconds
        for fn in self.on_wait:
            fn(purpose, seconds)

    @property
    def bytes(self) -> int:
        """Bytes sent for training (the one-off initial broadcast is not counted)."""
        return sum(t.bytes for k, t in self.totals.items() if k != "init")

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {k: {"calls": v.calls, "bytes": v.bytes, "waited_s": v.waited_s} for k, v in self.totals.items()}

    def restore(self, snapshot: dict[str, dict[str, Any]]) -> None:
        """Continue counting from a checkpoint's snapshot."""
        for k, v in snapshot.items():
            self.totals[k] = CommTotals(int(v["calls"]), int(v["bytes"]), float(v["waited_s"]))


class Pending:
    """An in-flight collective; `wait()` returns its result and books the blocked time."""

    def __init__(self, work: Any, result: torch.Tensor, ledger: CommLedger, purpose: str,
                 finish: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self._work, self._result, self._ledger, self._purpose, self._finish = work, result, ledger, purpose, finish
        self._done = False

    def wait(self) -> torch.Tensor:
        if not self._done:
            t0 = time.perf_counter()
            if self._work is not None:
                self._work.wait()
            self._ledger.waited(self._purpose, time.perf_counter() - t0)
            if self._finish is not None:
                self._result = self._finish(self._result)
            self._done = True
        return self._result


def all_reduce_mean(buf: torch.Tensor, ledger: CommLedger, purpose: str, group: Any = None,
                    async_op: bool = False) -> Pending:
    """Average `buf` over the group in place (SUM then divide: gloo has no AVG).

    Non-finite guard (`ledger.nonfinite`): "abort" raises before a NaN/Inf leaves this worker;
    "skip" sends a zero contribution with weight 0 (one extra element) and divides by the
    number of valid contributions, so every rank drops the same worker the same way."""
    if ledger.nonfinite == "skip" and purpose in GUARDED:
        return _guarded_mean(buf, ledger, purpose, group, async_op)
    if ledger.nonfinite == "abort" and purpose in GUARDED and not bool(torch.isfinite(buf).all()):
        raise NonFiniteError(f"non-finite values in this worker's {purpose} before the exchange "
                             f"(--on-nonfinite abort)")
    ledger.count(purpose, buf.numel() * buf.element_size())
    n = dist.get_world_size(group)
    work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=True)
    pending = Pending(work, buf, ledger, purpose, finish=lambda t: t.div_(n))
    if not async_op:
        pending.wait()
    return pending


GUARDED = ("params", "pseudo_grads", "optim_state")


def _guarded_mean(buf: torch.Tensor, ledger: CommLedger, purpose: str, group: Any, async_op: bool) -> Pending:
    valid = bool(torch.isfinite(buf).all())
    ext = torch.cat([buf if valid else torch.zeros_like(buf), buf.new_ones(1) if valid else buf.new_zeros(1)])
    ledger.count(purpose, ext.numel() * ext.element_size())
    if not valid:
        ledger.dropped += 1
    work = dist.all_reduce(ext, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def finish(t: torch.Tensor) -> torch.Tensor:
        count = float(t[-1])
        if count == 0:
            raise NonFiniteError(f"every worker's {purpose} was non-finite: nothing left to average")
        buf.copy_(t[:-1]).div_(count)
        return buf
    pending = Pending(work, ext, ledger, purpose, finish=finish)
    if not async_op:
        pending.wait()
    return pending
