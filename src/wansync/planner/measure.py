"""Measured step times: a few steps of the real model on this machine (one process), or every
step of every rank of a finished run, to replay with its stragglers."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..trainer.optim import build_optimizer
from ..telemetry.peerwait import PROFILE
from ..workloads import build_workload
from .simulate import StepTimes


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


def run_step_times(run_dir: str | Path) -> StepTimes:
    """Per rank of the run in `run_dir`, per step: (compute, other) seconds, from the profiles every
    rank writes (logs/profile_rank<R>.json, `steps_s`): what `wansync plan --step-times` replays."""
    logs = Path(run_dir) / "logs"
    out = []
    while (logs / PROFILE.format(len(out))).is_file():
        path = logs / PROFILE.format(len(out))
        try:
            steps = json.loads(path.read_text())["steps_s"]
            series = tuple(zip(map(float, steps["compute"]), map(float, steps["other"]), strict=True))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"--step-times: {path} holds no per-step times ({type(e).__name__}: {e}); "
                "it needs a run of `wansync train` from this version"
            ) from None
        if not series:
            raise ConfigError(f"--step-times: {path} has no training steps")
        bad = next(
            ((i, v) for i, pair in enumerate(series, 1) for v in pair if not (math.isfinite(v) and v >= 0)), None
        )
        if bad is not None:
            raise ConfigError(
                f"--step-times: {path} holds a step time of {bad[1]} s at step {bad[0]} (a time is "
                "finite and >= 0): the file is damaged"
            )
        out.append(series)
    if not out:
        raise ConfigError(
            f"--step-times: no {PROFILE.format(0)} under {logs}; give the directory of a "
            "finished `wansync train` run"
        )
    return tuple(out)
