"""The torchrun environment of this process, read once: a run under torchrun adopts its ranks
instead of launching its own.

It is adopted only when it is complete and consistent: a stale or partial one must not silently
turn `--workers 2` into one worker. The command (`wansync train`, `compare`, `sweep`) reads it
before any work and hands the `TorchrunEnv` on; nothing reads the variables a second time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ConfigError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    master_addr: str
    master_port: int

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size}, rendezvous {self.master_addr}:{self.master_port}"


def torchrun_env(workers: int | None = None, ranks_per_worker: int = 1) -> TorchrunEnv | None:
    """The torchrun environment of this process, None when there is none. A partial, malformed
    or inconsistent one is refused in one line, as is a contradiction with `workers` (an explicit
    --workers, or the worker count of the run being resumed) or a world that workers of
    `ranks_per_worker` ranks cannot fill."""
    present = [v for v in TORCHRUN_VARS if os.environ.get(v)]
    if not present:
        return None
    missing = [v for v in TORCHRUN_VARS if v not in present]
    if missing:
        raise ConfigError(f"incomplete torchrun environment: {', '.join(present)} set but {', '.join(missing)} not "
                          f"(unset {', '.join(present)} to launch local workers, or start under torchrun)")
    world = _env_int("WORLD_SIZE", 1, None)
    env = TorchrunEnv(_env_int("RANK", 0, world - 1), world, os.environ["MASTER_ADDR"],
                      _env_int("MASTER_PORT", 1, 65535))
    if os.environ.get("LOCAL_WORLD_SIZE"):
        local_world = _env_int("LOCAL_WORLD_SIZE", 1, world)
        if os.environ.get("LOCAL_RANK"):
            _env_int("LOCAL_RANK", 0, local_world - 1)
    if world % ranks_per_worker:
        raise ConfigError(f"the torchrun environment says WORLD_SIZE={world}, which workers of --ranks-per-worker "
                          f"{ranks_per_worker} cannot fill (under torchrun --nnodes N --nproc-per-node R, pass "
                          f"--ranks-per-worker R)")
    if workers is not None and workers * ranks_per_worker != world:
        per = f" x --ranks-per-worker {ranks_per_worker}" if ranks_per_worker > 1 else ""
        raise ConfigError(f"the torchrun environment says WORLD_SIZE={world} (RANK, WORLD_SIZE, MASTER_ADDR, "
                          f"MASTER_PORT are set) but this run has --workers {workers}{per}: drop --workers under "
                          f"torchrun, or unset those variables to launch {workers} local workers")
    return env


def _env_int(name: str, low: int, high: int | None) -> int:
    text = os.environ[name]
    try:
        value = int(text)
        fits = value >= low and (high is None or value <= high)
    except ValueError:
        fits = False
    if not fits:
        bound = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise ConfigError(f"torchrun environment: {name} must be {bound}, got {text!r}")
    return value
