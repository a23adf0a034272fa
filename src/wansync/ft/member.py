"""This worker's side of a fault-tolerant run (docs/fault_tolerance.md): its membership in the quorum
and all that goes with it, so that the trainer only wires it in.

The trainer builds the worker's quorum first (`quorum_for`) and hands it to the strategy, whose
exchange averages through it (`comm.exchange`); then a `Member` around the two, which it calls
three times: `join` before the first step, `before_finish` before the final synchronization,
`shutdown` at the end. The member owns the rest:

- **Heals.** A healing peer receives this worker's model, inner optimizer and strategy heal state
  (`Strategy.heal_state`). Healed from a peer, this worker loads the three, reads on in its own
  shard from where a worker that trained to the peer's step would be (`Workload.skip_to`), and adds
  a line to logs/heals.jsonl.
- **The quorum log** (logs/quorum_rank<r>.jsonl, read by `ft.quorums`): every quorum this worker
  took part in; where the membership changed (the lighthouse's quorum id: a restarted worker in
  place of a dead one changes it, not the count) or it healed, the digest of its anchors and outer
  optimizer state, so that peers can be compared bit for bit (`ft.quorum.digest`).
- **The start-up join** (`join_quorum`) and **the final synchronization's quorum**
  (`meet_final_quorum`), the two quorums outside a step; a step's own is the exchange's `meet`.
- **Fault injection** inside an exchange (`trainer.faults`: a worker killed inside one), and at
  start-up, before the join (step=0: a worker stopped before it joins).
- **torchft's own log lines** go to the rank's log, not the terminal (`library_logs_to`).

The launcher (`ft.supervisor`) tells a worker where the lighthouse is (`LIGHTHOUSE_ENV`, unless
--lighthouse names it) and that it is a restart (`RESTARTED_ENV`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..config import Config
from ..errors import PeerError
from ..net import emulator_of
from ..rundir import files
from ..rundir.checkpoint import map_tensors
from ..runner.route import route_to
from ..strategies.base import Strategy, local_shard
from .quorum import Quorum, digest
from .quorums import HEALS_LOG, QUORUM_LOG

LIGHTHOUSE_ENV = "WANSYNC_LIGHTHOUSE"  # the address of the lighthouse the launcher started
RESTARTED_ENV = "WANSYNC_RESTARTED"  # "1": the launcher restarted this worker; it heals from a peer
LIFE_ENV = "WANSYNC_LIFE"  # which life of its worker a rank is (0, then one more per restart)
JOIN_TIMEOUTS = 3  # at start-up the others get this many --peer-timeout to arrive
JOIN_POLL_S = 0.2  # between start-up quorums that came back short of workers


def quorum_for(cfg: Config, rank: int, world: int) -> Quorum:
    """The quorum of global rank `rank` of `world` (its worker's: rank // --ranks-per-worker): on the
    lighthouse the launcher started (or --lighthouse's), under the emulated link of the worker's own
    group (`--wan`). Its peers reach it at its route's address to the lighthouse (127.0.0.1 for a
    local run), whatever this host's name resolves to. A worker of several ranks is the default
    process group of this process (`runner.worker`)."""
    lighthouse = os.environ.get(LIGHTHOUSE_ENV) or f"http://{cfg.lighthouse}"
    r = cfg.ranks_per_worker
    return Quorum(
        rank // r,
        lighthouse,
        cfg.peer_timeout,
        hostname=reached_at(lighthouse),
        emulator=emulator_of(),
        workers=world,
        inside=dist.group.WORLD if r > 1 else None,
    )


def reached_at(lighthouse: str) -> str | None:
    """This host's address on the route to the lighthouse (None when it has none: its name then)."""
    try:
        return route_to(urlsplit(lighthouse).hostname or "").address
    except (OSError, ValueError):
        return None


def join_quorum(sync: Strategy, quorum: Quorum, expected: int) -> None:
    """Before the first step, meet the others at their next quorum (at the start of a run, until
    `expected` workers are in it). A worker that started late (restarted) heals there to their step
    and makes that step's synchronization with them (`Strategy.sync_due`). It gives up (PeerError,
    one line) when the others have not all arrived within JOIN_TIMEOUTS x the quorum's timeout
    (--peer-timeout): each quorum waits at most what is left of that, and one that fails meanwhile
    is retried (the others may still be starting on a loaded machine)."""
    t = sync.t
    deadline = time.monotonic() + JOIN_TIMEOUTS * quorum.timeout_s
    within = f"within {JOIN_TIMEOUTS} x --peer-timeout ({JOIN_TIMEOUTS * quorum.timeout_s:g} s)"
    while True:
        left = deadline - time.monotonic()
        try:
            quorum.quorum(t, timeout_s=min(quorum.timeout_s, max(left, JOIN_POLL_S)))
            if sync.t != t or quorum.participants >= expected:
                break
            why = f"only {quorum.participants} of {expected} workers joined the fault-tolerant run {within}"
        except PeerError as e:
            why = (
                f"the lighthouse at {quorum.lighthouse} formed no quorum {within} (is it there, answering, and "
                f"waiting for no more workers than this run has?): {e}"
            )
        if time.monotonic() >= deadline:
            raise PeerError(why)
        time.sleep(JOIN_POLL_S)  # the others are not heartbeating yet, or the lighthouse not answering
    if sync.t != t:  # healed: at the others' step now
        sync.sync_due()


def library_logs_to(path: Path) -> None:
    """In a worker the launcher started, torchft's own lines (its Rust warnings, its Python logging
    warnings) go to the rank's log, appended, not to the terminal, where the launcher prints the one
    line that matters. Under torchrun a rank's stderr is the command's own and stays."""
    if os.environ.get("WANSYNC_LAUNCHED") != "1":
        return
    sys.stderr.flush()
    fd = files.open_in_place(path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)


def meet_final_quorum(sync: Strategy) -> None:
    """Before `finish`: the quorum its exchanges run in, where a worker still behind heals; none for
    a worker that healed into it (it met it already, and holds the last step's exchanges)."""
    if not sync.exchange.already_synced:
        sync.exchange.meet(sync.t, final=True)


class Member:
    """This worker in a fault-tolerant run (see the module docstring).

    Args:
        quorum: its membership, the one its strategy's exchange averages through.
        rank: this process's global rank (its own log, the faults aimed at it); the quorum and heal
            logs are its worker's (`quorum.worker`), written by the worker's first rank.
        workers: the run's workers, all of which the start-up join waits for.
        log_dir: the run's logs/ (None: no logs written; a user's loop without one).
        model, optimizer, sync: what a heal replaces.
        skip_to: after a heal, reads on in this worker's data from the peers' step (the trainer's
            `Workload.skip_to`); None: the loop reads its position from `sync.t` itself.
        faults: injected inside the exchanges (`trainer.faults.Faults`), or None.
        restarted: a restarted worker (None: as the launcher says, `RESTARTED_ENV`); it joins
            wherever the others are and heals there.
    """

    def __init__(
        self,
        quorum: Quorum,
        rank: int,
        workers: int,
        log_dir: Path | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sync: Strategy,
        faults: Any = None,
        skip_to: Callable[[int], None] | None = None,
        restarted: bool | None = None,
    ):
        self.quorum, self.rank, self.workers, self.log_dir = quorum, rank, workers, log_dir
        self.model, self.optimizer, self.sync, self.skip_to = model, optimizer, sync, skip_to
        self.restarted = os.environ.get(RESTARTED_ENV) == "1" if restarted is None else restarted
        self.faults = faults
        self._last_logged: tuple[Any, Any, int | None] = (None, None, None)  # quorum id, participants, step
        quorum.serve(self._state, self._heal)
        quorum.on_quorum = self._log
        if faults is not None:
            quorum.before_exchange = lambda t: faults.in_exchange(rank, t)
        if log_dir is not None:
            library_logs_to(log_dir / f"rank{rank}.log")

    def join(self) -> None:
        """Before the first step (`join_quorum`): every worker at the start of a run; a restarted
        one meets the others wherever they are and must heal from them (a PeerError, one line, when
        none was left: they ended the run without it)."""
        if self.faults is not None:
            self.faults.at_start(self.rank)
        join_quorum(self.sync, self.quorum, 1 if self.restarted else self.workers)
        if self.restarted and self.quorum.heals == 0:
            raise PeerError(
                "this restarted worker found no live peer to heal from: the others ended the " "run without it"
            )

    def before_finish(self) -> None:
        meet_final_quorum(self.sync)

    def shutdown(self) -> None:
        self.quorum.shutdown()

    def _state(self) -> dict[str, Any]:
        """What a healing peer receives: a sharded model's (FSDP inside) and its optimizer's local
        shards, as plain tensors (`local_shards`)."""
        return {
            "model": local_shards(self.model.state_dict()),
            "optimizer": local_shards(self.optimizer.state_dict()),
            "strategy": self.sync.heal_state(),
        }

    def _heal(self, state: dict[str, Any]) -> None:
        """Take a live peer's state; in its own shard, go where a worker that trained to the peer's
        step would be (each worker reads its own shard)."""
        load_model(self.model, state["model"])
        load_optimizer(self.optimizer, state["optimizer"])
        self.sync.load_heal_state(state["strategy"])
        if self.skip_to is not None:
            self.skip_to(self.sync.t)
        self._append(HEALS_LOG, {"rank": self.quorum.worker, "step": self.sync.t})

    def _log(self, record: dict[str, Any]) -> None:
        """One line of the quorum log (module docstring); none for the same quorum again (waiting
        for the others at the start)."""
        quorum_id, participants, step = self._last_logged
        changed = (record.get("quorum_id"), record["participants"]) != (quorum_id, participants)
        if not (record["healed"] or changed or record["step"] != step):
            return
        if record["healed"] or changed:
            state = self.sync.state_dict()
            record["anchor_digest"] = digest({k: state[k] for k in ("anchor", "anchors") if k in state})
        self._last_logged = (record.get("quorum_id"), record["participants"], record["step"])
        self._append(QUORUM_LOG.format(rank=self.quorum.worker), {"time": time.time(), **record})

    def _append(self, name: str, record: dict[str, Any]) -> None:
        """A line of a worker's log: its first rank's (the others went through the same quorums)."""
        if self.log_dir is None or self.quorum.local_rank != 0:
            return
        with files.append(self.log_dir / name) as f:
            f.write(json.dumps(record) + "\n")


def local_shards(state: Any) -> Any:
    """`state` with each DTensor (a model sharded inside the worker) replaced by this rank's local
    shard (`strategies.base.local_shard`): what the same rank of a restarted worker needs, in a form
    the transport can send."""
    return map_tensors(state, local_shard)


def load_model(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """A peer's model state (`local_shards`) into `model`: a sharded one's into each parameter's
    local shard, in place."""
    from torch.distributed.tensor import DTensor

    current = model.state_dict()
    if not any(isinstance(v, DTensor) for v in current.values()):
        model.load_state_dict(state)
        return
    differ = sorted(set(current) ^ set(state))
    if differ:
        raise PeerError(f"a peer's model state does not match this worker's (keys {', '.join(differ[:4])})")
    with torch.no_grad():
        for key, value in current.items():
            local_shard(value).copy_(state[key])


def load_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """A peer's optimizer state (`local_shards`) into `optimizer`: a sharded parameter's state
    tensors become DTensors again on that parameter's mesh and placements."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param = {}
    for index, entry in state.get("state", {}).items():
        p = params[int(index)]
        if isinstance(p, DTensor):
            local = p.to_local()
            entry = {
                k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
                if torch.is_tensor(v) and v.shape == local.shape and v.dim() > 0
                else v
                for k, v in entry.items()
            }
        per_param[index] = entry
    optimizer.load_state_dict({**state, "state": per_param})
