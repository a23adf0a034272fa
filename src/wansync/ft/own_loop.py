"""Fault tolerance in a user's own loop (docs/fault_tolerance.md, "In your own loop"): the pieces the
CLI trainer uses, behind one options object.

    ws.init(fault_tolerant=True)                   # a worker is a process group of its own
    ft = ws.FaultTolerance(lighthouse="10.0.0.1:29510", worker=1, workers=4)
    sync = ws.strategy("diloco", model, optimizer, sync_every=50, fault_tolerant=ft)
    while sync.t < steps:                          # a restarted worker healed to its peers' step
        ...
    sync.finish()

`ws.strategy(..., fault_tolerant=ft)` does what the trainer does with its `ft.member.Member`: builds
the worker's `Quorum` (`ft.member.quorum_for`'s, on the lighthouse the options name) and hands it to
the strategy at construction, then joins (`Member.join`: at the start of a run every worker waits for
all the others; a restarted one meets them wherever they are and heals from a live peer: model,
inner optimizer, strategy state, and `sync.t` the peers' step). The strategy's `finish()` meets the
final quorum first (`Member.before_finish`); the quorum shuts down when the interpreter exits. Who
restarts a worker is the user's supervisor (torchrun, systemd, a shell loop), as the launcher is the
CLI's: the new process runs the same script, rejoins and heals; no checkpoint is read.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from .. import strategies
from ..comm.replicas import Replicas
from ..errors import ConfigError, check
from ..net import emulator_of
from .member import LIGHTHOUSE_ENV, RESTARTED_ENV, Member, reached_at
from .quorum import Quorum, require_torchft
from .support import check_supported

SUBJECT = "fault_tolerant="  # how the refusals name what was asked for


@dataclass
class FaultTolerance:
    """A worker's place in a fault-tolerant run of a user's own loop. Checked here, in one line each.

    Args:
        lighthouse: torchft's lighthouse, HOST:PORT (or http://HOST:PORT); default: $WANSYNC_LIGHTHOUSE.
            Start one with `torchft_lighthouse --min_replicas 1 --heartbeat_timeout_ms 2000 ...`.
        worker: this worker's index, 0 .. workers - 1, the same across its restarts; default: $RANK.
        workers: the run's workers, all of which the start of the run waits for; default: $WORLD_SIZE.
        peer_timeout: seconds a quorum waits for a late worker (the CLI's --peer-timeout); the start
            waits at most 3 x this for the others, then gives up in one line.
        log_dir: where logs/heals.jsonl and logs/quorum_rank<r>.jsonl go (the CLI's run's logs/); None: none.
        restarted: this process replaces a dead worker: it must heal from a live peer, and says so in
            one line when none is left. Default: $WANSYNC_RESTARTED is 1 or torchrun's
            $TORCHELASTIC_RESTART_COUNT > 0. Left False, a restarted worker still heals from live peers.
    """

    lighthouse: str | None = None
    worker: int | None = None
    workers: int | None = None
    peer_timeout: float = 30.0
    log_dir: str | Path | None = None
    restarted: bool | None = None

    def __post_init__(self) -> None:
        env = os.environ
        self.lighthouse = self.lighthouse or env.get(LIGHTHOUSE_ENV)
        check(
            bool(self.lighthouse),
            "fault tolerance needs a lighthouse: FaultTolerance(lighthouse='HOST:PORT') "
            f"or ${LIGHTHOUSE_ENV} (start one with torchft_lighthouse --min_replicas 1)",
        )
        assert self.lighthouse is not None
        url = self.lighthouse if "://" in self.lighthouse else f"http://{self.lighthouse}"
        try:
            port = urlsplit(url).port
        except ValueError:
            port = None
        check(
            bool(urlsplit(url).hostname) and port is not None and port >= 1,
            f"the lighthouse must be HOST:PORT, got {self.lighthouse!r}",
        )
        self.lighthouse = url
        self.worker = _int(self.worker, env.get("RANK"), "worker", "$RANK")
        self.workers = _int(self.workers, env.get("WORLD_SIZE"), "workers", "$WORLD_SIZE")
        check(self.workers >= 1, f"workers must be >= 1, got {self.workers}")
        check(0 <= self.worker < self.workers, f"worker must be in 0..{self.workers - 1}, got {self.worker}")
        check(
            isinstance(self.peer_timeout, (int, float))
            and not isinstance(self.peer_timeout, bool)
            and 0 < self.peer_timeout < math.inf,  # an infinite wait for a late worker is a hang
            f"peer_timeout must be a finite number of seconds > 0, got {self.peer_timeout!r}",
        )
        if self.restarted is None:
            self.restarted = env.get(RESTARTED_ENV) == "1" or int(env.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0


def _int(given: Any, from_env: str | None, name: str, env_name: str) -> int:
    value = given if given is not None else from_env
    check(value is not None, f"FaultTolerance needs {name}= (or {env_name}, as torchrun sets it)")
    if isinstance(value, (bool, float)):  # int() would take True as 1 and 2.5 as 2
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None


def fault_tolerant_strategy(
    name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ft: FaultTolerance, **options: Any
) -> strategies.Strategy:
    """`ws.strategy(name, model, optimizer, fault_tolerant=ft, **options)`: the strategy, joined to
    the run (a restarted worker healed); see the module docstring."""
    check(isinstance(ft, FaultTolerance), f"fault_tolerant= takes a ws.FaultTolerance(...), got {type(ft).__name__}")
    sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
    check_supported(
        name,
        inside="fsdp" if sharded else "ddp",
        codec=options.get("codec"),
        subject=SUBJECT,
        slow_policy=options.get("slow_policy"),
        overlap_rounds=bool(options.get("overlap_rounds")),
    )
    for given in ("group", "replicas", "mesh", "quorum"):
        check(
            options.get(given) is None,
            f"{SUBJECT} takes no {given}=: a fault-tolerant worker is one rank in a "
            "process group of its own, its exchanges over the quorum",
        )
    check(
        dist.is_initialized() and dist.get_world_size() == 1,
        "a fault-tolerant worker is a process group of its own (no collective may wait on a dead worker): "
        "call ws.init(fault_tolerant=True) first",
    )
    require_torchft()
    assert ft.lighthouse is not None and ft.worker is not None and ft.workers is not None
    log_dir = None if ft.log_dir is None else Path(ft.log_dir)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    quorum = Quorum(
        ft.worker,
        ft.lighthouse,
        ft.peer_timeout,
        hostname=reached_at(ft.lighthouse),
        emulator=emulator_of(),
        workers=ft.workers,
    )
    try:
        options = {k: v for k, v in options.items() if k not in ("group", "replicas", "mesh", "quorum")}
        sync = strategies.build(
            name, model, optimizer, replicas=Replicas(1, ft.worker, ft.workers, 0), quorum=quorum, **options
        )
        member = Member(quorum, ft.worker, ft.workers, log_dir, model, optimizer, sync, restarted=ft.restarted)
        member.join()  # a restarted worker heals here
    except BaseException:
        quorum.shutdown()
        raise
    atexit.register(quorum.shutdown)
    if quorum.heals:
        print(
            f"wansync: worker {ft.worker} rejoined the run and healed from a live peer at step {sync.t}",
            file=sys.stderr,
            flush=True,
        )

    def finish() -> None:
        """The final synchronization's quorum (a worker still behind heals there), then the strategy's."""
        member.before_finish()
        type(sync).finish(sync)

    sync.finish = finish  # this instance only, before the user holds it
    return sync
