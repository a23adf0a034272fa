"""Fault injection for tests of failure handling: WANSYNC_FAULT="rank=1,step=5,action=kill".

Actions after the backward of that step: `exit` (raise an error), `kill` (SIGKILL itself),
`stop` (SIGSTOP itself: a hung peer), `nan` (put a NaN into its gradient), `pause` (sleep
`seconds`: a straggler, alive but late). With step=0, `exit`, `kill`, `stop` and `pause` strike at
start-up instead, before a fault-tolerant worker joins the others (`at_start`). Inside the first
exchange at or after that step, before its values go on the wire (fault-tolerant runs):
`kill_in_exchange` (SIGKILL itself while its peers are in the exchange). After the checkpoint
of that step is saved (the barrier passed) and before rank 0 prunes: `delay` (sleep `seconds`,
default 5: the window in which a peer that went on can die). In the mean of pseudo-gradients of
that step, before the robust mean and the wire (`comm.exchange`'s `fault`): `scale` (multiply this
worker's pseudo-gradient by `factor`, default 1000: a silent fault whose values are finite, e.g.
"rank=1,step=40,action=scale,factor=1000"; a worker of several ranks needs one fault per rank).
From the start (any step): `flip_heal` (this rank's heal server flips one byte of each of the next
`times` payloads it sends, default 1: a transfer corrupted on the way, which the healing peer must
refuse before parsing and ask again). Several faults are separated by ';'. Only active when the variable is set.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass

import torch
from torch import nn

ACTIONS = ("exit", "kill", "stop", "nan", "delay", "kill_in_exchange", "pause", "scale", "flip_heal")


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    action: str
    seconds: float = 5.0
    factor: float = 1000.0
    times: int = 1

    @staticmethod
    def parse(text: str) -> "Fault":
        fields = dict(item.split("=", 1) for item in text.split(","))
        fault = Fault(
            int(fields["rank"]),
            int(fields["step"]),
            fields["action"],
            float(fields.get("seconds", 5.0)),
            float(fields.get("factor", 1000.0)),
            int(fields.get("times", 1)),
        )
        if fault.action not in ACTIONS:
            raise ValueError(f"WANSYNC_FAULT action must be one of {ACTIONS}, got {fault.action!r}")
        return fault

    def at_start(self, rank: int) -> None:
        """Called once a fault-tolerant worker is set up, before it joins the others (step=0)."""
        if rank == self.rank and self.step == 0 and self.action in ("exit", "kill", "stop", "pause"):
            self._strike(0)

    def after_backward(self, rank: int, step: int, model: nn.Module) -> None:
        """Called after backward of 1-based `step`."""
        if rank != self.rank or step != self.step:
            return
        self._strike(step, model)

    def _strike(self, step: int, model: nn.Module | None = None) -> None:
        if self.action == "exit":
            raise RuntimeError(f"injected failure at step {step}")
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.action == "pause":
            time.sleep(self.seconds)
        if self.action == "nan" and model is not None:
            p = next(p for p in model.parameters() if p.grad is not None)
            with torch.no_grad():
                p.grad.view(-1)[0] = float("nan")

    def after_checkpoint(self, rank: int, step: int) -> None:
        """Called once every rank has saved the checkpoint of `step`."""
        if rank == self.rank and step == self.step and self.action == "delay":
            time.sleep(self.seconds)

    def in_exchange(self, rank: int, step: int) -> None:
        """Called by a fault-tolerant exchange of `step` before this worker's values go on the wire."""
        if rank == self.rank and step >= self.step and self.action == "kill_in_exchange":
            os.kill(os.getpid(), signal.SIGKILL)

    def heal_flips(self, rank: int) -> int:
        """How many of this rank's heal payloads go out with one byte flipped (`flip_heal`; else 0)."""
        return self.times if rank == self.rank and self.action == "flip_heal" else 0

    def pseudo_gradient_scale(self, rank: int, step: int) -> float:
        """What this rank's pseudo-gradient in a mean of `step` is multiplied by (`scale`; else 1)."""
        return self.factor if rank == self.rank and step == self.step and self.action == "scale" else 1.0


@dataclass(frozen=True)
class Faults:
    faults: tuple[Fault, ...]

    @staticmethod
    def from_env() -> "Faults | None":
        text = os.environ.get("WANSYNC_FAULT", "")
        if not text:
            return None
        return Faults(tuple(Fault.parse(part) for part in text.split(";") if part.strip()))

    def after_backward(self, rank: int, step: int, model: nn.Module) -> None:
        for fault in self.faults:
            fault.after_backward(rank, step, model)

    def after_checkpoint(self, rank: int, step: int) -> None:
        for fault in self.faults:
            fault.after_checkpoint(rank, step)

    def at_start(self, rank: int) -> None:
        for fault in self.faults:
            fault.at_start(rank)

    def in_exchange(self, rank: int, step: int) -> None:
        for fault in self.faults:
            fault.in_exchange(rank, step)

    def heal_flips(self, rank: int) -> int:
        return sum(fault.heal_flips(rank) for fault in self.faults)

    def pseudo_gradient_scale(self, rank: int, step: int) -> float:
        return math.prod(fault.pseudo_gradient_scale(rank, step) for fault in self.faults)
