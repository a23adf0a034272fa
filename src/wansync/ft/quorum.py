"""Fault-tolerant exchanges through torchft: quorum averages, and healing from a live peer.

Each worker is one torchft replica with its own `Manager` over a reconfigurable gloo group
(torchft's `ProcessGroupGloo`). The lighthouse (torchft's, started by the launcher or given as
HOST:PORT) decides who takes part in each quorum; a worker that died or stopped answering is
left out of the next one. A `Quorum` is handed to the strategy at construction, whose exchange
(`comm.exchange`) routes its means through it; the worker's side of the run around it (healing,
logs, the start-up join) is `ft.member`. The protocol:

- **A quorum at every synchronization slot** (`quorum(t)`, through the exchange's `meet` before the
  strategy computes anything it will exchange at step t), **and one for the final synchronization**
  (`quorum(t, finishing=True)`: after the last step's exchanges, before `finish`'s). The Manager's
  step orders them (`manager_step`: 2t, then 2t + 1), so a worker behind the others (a restarted
  one, at step 0; one stopped past the heartbeat timeout) *heals*: torchft's checkpoint transport
  fetches a live peer's state, sealed (`ft.transport`) (model, inner optimizer, strategy: anchors, outer
  optimizer, schedule, exchanges in flight) and `load` applies it. After the heal, `t` and
  `finishing` are the peers': a worker healed into their final quorum holds their state after
  the last step's exchanges and must not make them again. Every participant then decides the same
  exchanges from the same state.
- **The mean** (`mean`): a SUM all-reduce of the values and one weight over the quorum, divided by
  the sum of the weights (the contributors). A worker's weight is 0 when its values must not count:
  non-finite under "skip", or a copy of a peer's (it healed in this slot's quorum, after the steps
  whose work the exchange averages: its values are its source's, which would count twice). An all-reduce that fails (a peer died inside it) is retried under a
  shrink-only quorum (no joiner mid-exchange) from an untouched copy of the input. The survivors
  blocked in it (not next to the dead peer) give up after half of the quorum's timeout, so they
  all reach that retry quorum before it gives up on them.
- **The emulated link** (`--wan`): each quorum all-reduce runs under the worker's emulator like
  any collective of an emulated group (`net`): the modelled duration of an all-reduce over the
  participating workers (`net.collective_duration` over their global ranks, jitter drawn from the
  slot's step so every participant draws the same), FIFO on the emulator's link, completed at
  max(real end, modelled end) and recorded, so the exchange waits and books what the link says.
- **Participants** of the last exchange are kept for the sync events; `on_quorum` hears of every
  quorum (step, participants, the lighthouse's quorum id, whether this worker healed in it) and `before_exchange` of every
  exchange (fault injection: a worker killed inside an exchange).

**Workers of several ranks** (DDP or FSDP inside, `inside`: the worker's own process group). Each rank of
a worker is a group rank of the worker's torchft replica: the worker's first rank runs its manager
(the one that asks the lighthouse, once all the worker's ranks asked it) and its store; every rank
has its own process group across the workers, with the same rank of each (torchft's store prefix
per group rank), and averages its shard of the buffer there (`comm.exchange`; with FSDP inside, the
shard it holds). The quorum is the
worker's, the same for all its ranks; a restarted worker heals rank by rank, each from the same rank
of a live worker (torchft's checkpoint metadata per group rank). Whether a mean succeeded is agreed
among the worker's ranks before any of them goes on (`all_ranks`), so that they retry together.
A worker lives and dies whole: its launcher ends and restarts all its ranks together (`ft.supervisor`).

Exchanges are fp32 means, or a sparse payload's all-gather (`gather`: SparseLoCo), never summed on
the wire; a lossy codec's all-gather or reduce-scatter has no quorum form here (refused in `ft.support`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import socket
import time
import zlib
from datetime import timedelta
from typing import Any, Callable

import torch
from torch.futures import Future

from ..rundir.checkpoint import map_tensors
from ..trust.settings import current
from .listeners import admitted_lighthouse, listen_address, manager_bound, manager_store
from ..errors import ConfigError, PeerError
from ..net import CollectiveRecord, EmulatedWork, Emulator, collective_duration, jitter_draw

INSTALL = "fault tolerance needs torchft: pip install wansync[ft]"
RETRIES = 3
LINK_GROUP = "ft"  # the quorum's collectives in the emulator's records
# A collective gives up on a silent peer within this share of --peer-timeout. When a peer dies inside
# an all-reduce, only its ring neighbours see the connection drop; the others wait out this timeout.
# It must end well before the survivors' retry quorum (which waits up to --peer-timeout, like the
# lighthouse's join timeout) gives up on them: with equal timeouts the two raced.
COLLECTIVE_TIMEOUT_SHARE = 0.5
EXCHANGES_PER_SLOT = 1024  # jitter draws: seq = step x this + the exchange's index in the slot


def manager_step(t: int, finishing: bool) -> int:
    """torchft's step for the quorum of step t: the slot's (before its exchanges), then the final
    synchronization's (after them). A worker at a lower one heals from a peer at the highest."""
    return 2 * t + int(finishing)


def require_torchft() -> None:
    """One line, not a traceback, when the optional dependency is missing. Before torchft first
    loads, its Rust logs are set to warnings (RUST_LOG, unless set): they are read once, then, and
    its INFO lines, several per quorum, would fill the terminal and every log without bound."""
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        raise ConfigError(INSTALL) from exc


class Quorum:
    """This worker's membership in the fault-tolerant group (see the module docstring).

    Args:
        worker: this worker's index (the replica id torchft reports).
        lighthouse: the lighthouse's address, http://HOST:PORT.
        timeout_s: how long a quorum waits for a silent peer (--peer-timeout); a collective waits
            COLLECTIVE_TIMEOUT_SHARE of it.
        hostname: the address peers reach this worker at (its Manager, its store, the checkpoint
            server a healing peer fetches from): its route's to the lighthouse (`ft.member`), never a
            name that may resolve to loopback.
        emulator: the emulated link (`--wan`) the all-reduces run under; None: not emulated.
        workers: the run's processes, workers x ranks per worker (their global ranks place them on
            the link's sites).
        inside: a worker of several ranks (DDP or FSDP inside): the process group of its ranks, one of
            which this process is (None: a worker of one rank). See "Workers of several ranks".
    """

    def __init__(
        self,
        worker: int,
        lighthouse: str,
        timeout_s: float,
        hostname: str | None = None,
        emulator: Emulator | None = None,
        workers: int = 1,
        inside: Any = None,
    ):
        require_torchft()
        import torch.distributed as dist
        from torchft import Manager

        from .transport import HealTransport

        timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.lighthouse = lighthouse
        self.emulator, self.workers, self.inside = emulator, workers, inside
        self.worker = worker
        self.local_rank, self.ranks_per_worker = (
            (0, 1) if inside is None else (dist.get_rank(inside), dist.get_world_size(inside))
        )
        self._pg = members_recording_gloo(timedelta(seconds=timeout_s * COLLECTIVE_TIMEOUT_SHARE))
        hostname = hostname or socket.gethostname()
        trust = current()
        address = listen_address(trust, hostname)
        self._store = manager_store(hostname, inside, trust, address)
        self._lighthouse_end, lighthouse_at = admitted_lighthouse(lighthouse, trust, timeout_s)
        # the heal server takes its port first: the manager's is only picked (then bound by torchft)
        self.transport = transport = HealTransport(timeout=timeout, host=hostname, trust=trust)
        manager_port = trust.listen.port("manager") if address else None
        try:
            with manager_bound(address):
                self.manager = Manager(
                    pg=self._pg,
                    load_state_dict=None,
                    state_dict=None,
                    min_replica_size=1,
                    use_async_quorum=False,
                    replica_id=f"worker_{worker}",
                    store_addr=hostname,
                    store_port=self._store.port,
                    rank=self.local_rank,
                    world_size=self.ranks_per_worker,
                    lighthouse_addr=lighthouse_at,
                    port=manager_port,
                    hostname=hostname,
                    timeout=timeout,
                    quorum_timeout=timeout,
                    connect_timeout=timeout,
                    init_sync=False,
                    checkpoint_transport=transport,
                )
        except RuntimeError as exc:  # torchft's connect timeout: the cause is the address
            raise PeerError(
                f"cannot reach the lighthouse at {lighthouse} within --peer-timeout ({timeout_s:g} s): "
                f"{first_line(exc)}"
            ) from exc
        self.participants: int | None = None  # of the last exchange
        self.heals = 0
        self._t = 0  # the step of the last quorum (the peers' after a heal)
        self.finishing = False  # was it the final synchronization's (the peers' after a heal)
        self.copied = False  # healed in the last quorum: a peer's values, weight 0
        self._exchanges_in_slot = 0
        self._load: Callable[[dict[str, Any]], None] | None = None
        self.on_quorum: Callable[[dict[str, Any]], None] | None = None
        self.before_exchange: Callable[[int], None] | None = None

    def serve(self, save: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]) -> None:
        """What a healing peer receives (`save`, copied: the transport serves tensors by reference
        while this worker trains on; each tensor's own elements, not the whole storage a view lies
        in, which a deepcopy would copy and send) and how this worker applies a peer's (`load`)."""
        self._load = load
        self.manager.register_state_dict_fn(
            "wansync", self._healed, lambda: map_tensors(save(), lambda t: t.detach().clone(), copy.deepcopy)
        )

    def _healed(self, state: dict[str, Any]) -> None:
        self.heals += 1
        assert self._load is not None
        self._load(state)

    def quorum(
        self,
        t: int,
        shrink_only: bool = False,
        left_out_is_fatal: bool = False,
        finishing: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        """Agree on who takes part from step t on (`finishing`: in the final synchronization);
        heal from a peer when this worker is behind. `left_out_is_fatal` (training, not the
        start-up join): a worker the others went on without (quorums formed while it was stopped or
        cut off) must heal in this quorum; with no live peer to heal from (the others ended), a
        PeerError rather than train on alone. `timeout_s`: this quorum's wait, if shorter than the
        quorum's timeout (what is left of the start-up join's)."""
        self._t, self.finishing, self._exchanges_in_slot = t, finishing, 0
        heals, t0, last_id = self.heals, time.perf_counter(), self._pg.quorum_id
        self.manager.load_state_dict({"step": manager_step(t, finishing), "batches_committed": 0})
        try:
            self.manager.start_quorum(
                shrink_only=shrink_only, timeout=None if timeout_s is None else timedelta(seconds=timeout_s)
            )
        except Exception as exc:  # noqa: BLE001 - torchft's quorum timeout or lost lighthouse, in one line
            # torchft re-raises a failed quorum (the same exception, its traceback one retry longer each
            # time) at every later start: forget it, so that a retry asks the lighthouse again
            self.manager._quorum_future = None
            raise QuorumFailed(f"the fault-tolerant quorum failed: {first_line(exc)}") from exc
        if self.manager.errored():
            raise QuorumFailed(f"the fault-tolerant quorum failed: {self.manager.errored().original_exception}")
        self.participants = self.manager.num_participants()
        if self.heals > heals:  # now where the peers are: a retry asks for their quorum
            self._t, finished = divmod(self.manager.current_step(), 2)
            self.finishing = bool(finished)
        if not shrink_only:  # a retry's quorum admits no joiner, so heals no one
            self.copied = self.heals > heals
        left_out = last_id is not None and (self._pg.quorum_id or 0) > last_id + 1
        if left_out_is_fatal and left_out and self.heals == heals:
            raise PeerError(
                "this worker was left out (stopped or cut off past the heartbeat timeout) and, back, found "
                "no live peer to heal from: it stops rather than train on alone"
            )
        if self.on_quorum is not None:
            self.on_quorum(
                {
                    "step": self._t,
                    "participants": self.participants,
                    "quorum_id": self._pg.quorum_id,
                    "healed": self.heals > heals,
                    "seconds": round(time.perf_counter() - t0, 4),
                }
            )

    def slot(self, t: int, finishing: bool = False) -> None:
        """The quorum before step t's exchanges (`finishing`: the final synchronization's), asked
        again, up to RETRIES times, when it fails while it forms: a worker killed while the quorum's
        groups are configured makes every other member's configure wait out its keys (half of
        --peer-timeout) and the lighthouse cancel a quorum a member left; the next one leaves the dead
        worker out. A retry follows this worker's own failed quorum, not a stop: it is not held to
        the left-out rule. Every rank of a worker retries together."""
        for attempt in range(RETRIES + 1):
            failed: QuorumFailed | None = None
            try:
                self.quorum(t, left_out_is_fatal=attempt == 0, finishing=finishing)
            except QuorumFailed as exc:
                failed = exc
            if self.all_ranks(failed is None):
                return
            if attempt == RETRIES:
                raise failed or QuorumFailed(f"the fault-tolerant quorum failed {RETRIES + 1} times in a row")

    def mean(self, values: torch.Tensor, valid: bool) -> tuple[torch.Tensor, int]:
        """(the weighted mean of `values` over the quorum, the number of contributors)."""
        from torch.distributed import ReduceOp

        flat = values.detach().reshape(-1)
        if self.before_exchange is not None:
            self.before_exchange(self._t)
        valid = valid and not self.copied
        for attempt in range(RETRIES + 1):
            wire = torch.cat([flat if valid else torch.zeros_like(flat), flat.new_full((1,), float(valid))])
            ok = self._wait(self.manager.allreduce(wire, reduce_op=ReduceOp.SUM), wire)
            if self.all_ranks(ok and self.manager.errored() is None):
                self.participants = self.manager.num_participants()
                contributors = int(round(float(wire[-1])))
                return wire[:-1].view_as(values).div_(max(1, contributors)), contributors
            if attempt < RETRIES:
                self.quorum(self._t, shrink_only=True, finishing=self.finishing)
        raise PeerError(f"an exchange failed {RETRIES + 1} times in a row under the fault-tolerant quorum")

    def gather(self, wire: torch.Tensor) -> list[torch.Tensor]:
        """Every quorum member's `wire` (the same number of bytes on each), in the quorum's order: a
        sparse payload's all-gather (`comm.sparse_mean`), the robust mean's norms (`comm.exchange`). Its last byte is the payload's validity
        flag, set to 0 here for a worker that healed in this slot (its values are its source's).
        Retried as `mean` is, from the same bytes."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        if self.before_exchange is not None:
            self.before_exchange(self._t)
        if self.copied:
            wire[-1] = 0
        for attempt in range(RETRIES + 1):
            count = self.manager.num_participants()
            rows = [torch.empty_like(wire) for _ in range(count)]
            try:
                work = self._pg.allgather([rows], [wire], AllgatherOptions())
                ok = self._wait(work, wire, "allgather", count)
            except Exception as exc:  # noqa: BLE001 - a peer died inside it: retried below
                self.manager.report_error(exc)
                ok = False
            if self.all_ranks(ok and self.manager.errored() is None):
                self.participants = count
                return rows
            if attempt < RETRIES:
                self.quorum(self._t, shrink_only=True, finishing=self.finishing)
        raise PeerError(f"an exchange failed {RETRIES + 1} times in a row under the fault-tolerant quorum")

    def all_ranks(self, ok: bool) -> bool:
        """Did the worker's every rank get its shard's mean? One rank's failed all-reduce (its peer
        rank in a dying worker was killed a moment later than another's) sends all of them into the
        retry quorum together: the worker's manager forms a quorum only when all its ranks ask, and
        every shard must be averaged over the same workers."""
        if self.inside is None:
            return ok
        import torch.distributed as dist

        flag = torch.tensor([int(ok)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.inside)
        return bool(flag.item())

    def modelled_seconds(self, numel: int, shards: bool = False) -> float | None:
        """The emulated link's duration of one `mean` of `numel` float32 values and their weight over
        every worker (None when the link is not emulated), as `comm.mean_cost.mean_seconds` times a
        fixed group's: a worker of several ranks averages one shard per rank (each with its weight),
        all at once over its site's uplink, then puts the whole together; `shards` (FSDP inside):
        `numel` is this rank's own shard, and nothing is put together."""
        if self.emulator is None:
            return None
        from ..comm.mean_cost import mean_seconds

        r = self.ranks_per_worker
        return mean_seconds(
            numel + (1 if shards else r), "fp32", self.emulator.topology, self.workers // r, r, shards=shards
        )

    def _wait(self, work: Any, wire: torch.Tensor, op: str = "allreduce", count: int = 1) -> bool:
        """Wait for a quorum all-reduce (an all-gather of `count` members' `wire`, `op`); under the
        emulator, until the link says it is done."""
        if self.emulator is None:
            return work.wait()
        seq = self._t * EXCHANGES_PER_SLOT + self._exchanges_in_slot
        self._exchanges_in_slot += 1
        members = self._pg.members or list(range(self.participants or 1))
        try:
            on_link(self.emulator, work, wire, members, self.workers, seq, self.ranks_per_worker, op, count).wait()
        except Exception:  # noqa: BLE001 - a peer died inside it, or the link timed out: retried above
            return False
        return True

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
        if self._lighthouse_end is not None:
            self._lighthouse_end.close()


def on_link(
    emulator: Emulator,
    work: Any,
    wire: torch.Tensor,
    members: list[int],
    workers: int,
    seq: int,
    parallel: int = 1,
    op: str = "allreduce",
    count: int = 1,
) -> EmulatedWork:
    """`work` (a quorum all-reduce of `wire` over the global ranks `members` of `workers`, or with `op`
    "allgather" the all-gather of `count` members' `wire`; one of `parallel` at once over the sites'
    uplinks, one per rank of a worker) as a collective of the emulated link: its modelled duration,
    FIFO on the emulator's link, recorded; the returned Work completes at max(real end, modelled end)
    (see `net.backend`)."""
    issue, topology = time.perf_counter(), emulator.topology
    nbytes = wire.numel() * wire.element_size() * (count if op == "allgather" else 1)  # the cost model's B
    modelled = collective_duration(
        op,
        nbytes,
        workers,
        topology,
        members,
        parallel=parallel,
        at_s=emulator.run_time(issue) if topology.varies else 0.0,
    )
    modelled += jitter_draw(topology, workers, emulator.seed, zlib.crc32(LINK_GROUP.encode()), seq, members)
    start = emulator.reserve(issue, modelled)
    record = CollectiveRecord(
        op=op,
        nbytes=nbytes,
        group=LINK_GROUP,
        seq=seq,
        issue=issue,
        start=start,
        modelled_s=modelled,
        modelled_end=start + modelled,
    )
    fut = Future(devices=[wire.device]) if wire.is_cuda else Future()
    emulator.schedule([work], record, fut, wire, wire.is_cuda)
    return EmulatedWork(fut, record, wire)


def members_recording_gloo(timeout: timedelta) -> Any:
    """torchft's ProcessGroupGloo that keeps the id and the global ranks of the quorum it was last
    configured for (`quorum_id`, `members`: the participating workers; None before the first quorum).
    The lighthouse numbers quorums in order, one more each time the membership changes. torchft 0.2.0's
    Manager calls `configure` (the ranks are its arguments); its newest builds (torchft-nightly) call
    `reconfigure` with torch 2.14's ReconfigureOptions instead: the quorum id is its `uuid`, and each
    member's handle (torchft's JSON) names its global rank."""
    from torchft import ProcessGroupGloo

    class MembersRecordingGloo(ProcessGroupGloo):
        members: list[int] | None = None
        quorum_id: int | None = None

        def configure(self, *args: Any, **kwargs: Any) -> None:
            ranks = kwargs.get("global_ranks", args[7] if len(args) > 7 else None)
            self.members = sorted(ranks) if ranks else None
            self.quorum_id = kwargs.get("quorum_id", args[4] if len(args) > 4 else None)
            super().configure(*args, **kwargs)

        def reconfigure(self, opts: Any) -> Any:
            ranks = [json.loads(handle).get("global_rank") for handle in opts.handles]
            self.members = None if None in ranks else sorted(ranks)
            self.quorum_id = opts.uuid
            return super().reconfigure(opts)

    return MembersRecordingGloo(timeout=timeout)


class QuorumFailed(PeerError):
    """The quorum did not form (torchft's timeout, a lost lighthouse, a group that did not configure)."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def digest(state: Any) -> str:
    """sha256 of every tensor in a nested dict/list, in order: equal digests mean bitwise-equal state."""
    h = hashlib.sha256()

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(str((x.dtype, tuple(x.shape))).encode())
            h.update(x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                visit(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(state)
    return h.hexdigest()
