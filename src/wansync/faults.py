"""Fault injection for tests of failure handling: WANSYNC_FAULT="rank=1,step=5,action=kill".

Actions: `exit` (raise an error), `kill` (SIGKILL itself), `stop` (SIGSTOP itself: a hung
peer), `nan` (put a NaN into its gradient). Only active when the variable is set.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch
from torch import nn

ACTIONS = ("exit", "kill", "stop", "nan")


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    action: str

    @staticmethod
    def from_env() -> "Fault | None":
        text = os.environ.get("WANSYNC_FAULT", "")
        if not text:
            return None
        fields = dict(item.split("=", 1) for item in text.split(","))
        fault = Fault(int(fields["rank"]), int(fields["step"]), fields["action"])
        if fault.action not in ACTIONS:
            raise ValueError(f"WANSYNC_FAULT action must be one of {ACTIONS}, got {fault.action!r}")
        return fault

    def after_backward(self, rank: int, step: int, model: nn.Module) -> None:
        """Called after backward of 1-based `step`."""
        if rank != self.rank or step != self.step:
            return
        if self.action == "exit":
            raise RuntimeError(f"injected failure at step {step}")
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.action == "nan":
            p = next(p for p in model.parameters() if p.grad is not None)
            with torch.no_grad():
                p.grad.view(-1)[0] = float("nan")
