"""A measured compute time per step: a few steps of the real model on this machine, one process."""
from __future__ import annotations

import time
from typing import Any

import torch

from ..optim import build_optimizer
from ..workloads import build_workload


def measure_step_s(cfg: Any, warmup: int = 2, steps: int = 5) -> float:
    """Mean seconds of forward, backward and inner step over `steps` steps after `warmup`."""
    torch.manual_seed(cfg.seed)
    workload = build_workload(cfg, 0, 1)
    optimizer = build_optimizer(cfg, workload.model)
    took = 0.0
    for i in range(warmup + steps):
        batch = workload.next_batch()
        t0 = time.perf_counter()
        workload.loss(workload.model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        if i >= warmup:
            took += time.perf_counter() - t0
    return took / steps
