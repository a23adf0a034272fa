"""Which step exchanges what, taken from the strategies themselves.

Every strategy's timetable (`strategies.timetable(name, options)`: the object the strategy follows,
built from its options alone) says which steps all-reduce gradients over every rank (DDP's phase),
which end at a boundary and whether `finish()` averages once more. For Streaming DiLoCo and CoCoDC
it also drives the work of every step and of `finish()` (`strategies.fragment_timetable`: merges
due, the slot's start, τ = 0 merges; CoCoDC's N decided once at the first step ≥ H), and the
planner carries it out on transfers instead of tensors (`FragmentPlan`). CoCoDC's N is
`transmission.syncs_per_period` from the step time and the modelled fragment sync time. Its
adaptive choice follows R_p = ‖Δθ̃_p‖/I_p, which depends on training; the planner predicts it with
round-robin choice (same N, same bytes, same in-flight pattern when fragments are equal-sized).

The result is a list of `Transfer`s and, per step, the ordered `Action`s the training thread
takes: issue a transfer (in backward for DDP's gradient buckets, else in `step()`) and wait for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..comm.codecs import get_codec
from ..comm.mean_cost import lossy_path, mean_collectives
from ..comm.sparse import is_sparse
from ..net import Topology
from ..strategies import strategy_class, timetable
from ..strategies.fragment_timetable import FragmentTimetable
from ..strategies.inflight import InFlight
from ..strategies.timetable import Timetable
from ..strategies.transmission import syncs_per_period
from .sizes import ModelSize

AGREE_BYTES = 16  # CoCoDC's agreement on N: the mean of a float64 pair (T_c, T_s)
DRIFT_BYTES = 4  # the drift telemetry: one float32 element riding on the parameter exchange
REBUILD_BYTES = (108, 8)  # DDP's broadcast of rank 0's rebuilt bucket order after its first backward (tiny LM)


@dataclass
class Transfer:
    """One collective: its purpose, op and full-buffer bytes (the cost model's B), the bytes this
    rank books on its ledger (its payload), and what a worker puts on the wire for it (`sent`)."""

    step: int
    purpose: str  # grads | params | pseudo_grads | optim_state | telemetry | schedule | adapt
    op: str  # allreduce | allgather | alltoall | broadcast
    nbytes: int
    payload: int
    fragment: int | None = None
    between_workers: bool = True  # False: DDP's gradient all-reduce (over every rank)
    sent: int = 0


@dataclass
class Action:
    kind: str  # "issue" | "wait" | "book" (bytes booked on the ledger, carried by another collective)
    transfer: Transfer
    in_backward: bool = False


@dataclass
class Trace:
    """The actions of steps 1..steps (index 0 is step 1), then `finish()`'s."""

    steps: list[list[Action]] = field(default_factory=list)
    finish: list[Action] = field(default_factory=list)
    syncs_per_period: int | None = None

    def transfers(self) -> list[Transfer]:
        return [a.transfer for acts in [*self.steps, self.finish] for a in acts if a.kind == "issue"]


PathOf = Callable[[int], str]  # a worker's buffer of n values -> its lossy mean's path (`lossy_paths`)


def lossy_paths(
    opts: Any, workers: int, topology: Topology | None = None, ranks_per_worker: int = 1, shards: bool = False
) -> PathOf:
    """How the exchange sends a lossy mean of a worker's buffer of n values (`comm.mean_cost.lossy_path`,
    timed on `topology` when given: the emulated run's choice; with `shards`, each rank's ⌈n/R⌉)."""
    get = opts.get if isinstance(opts, dict) else lambda key, default: getattr(opts, key, default)
    codec, choice, r = get("codec", "fp32"), get("codec_collective", "auto"), ranks_per_worker
    return lambda n: lossy_path(codec, choice, workers, -(-n // r) if shards else n, topology, r, shards)


def mean_transfers(
    step: int,
    purpose: str,
    numel: int,
    opts: Any,
    workers: int,
    *,
    extra: int = 0,
    fragment: int | None = None,
    path_of: PathOf | None = None,
    codec: Any = None,
) -> list[Transfer]:
    """The collectives of one `Exchange.mean` of `numel` values in the strategy's codec (or `codec`,
    a sparse payload's), in order (`comm.mean_cost.mean_collectives`: an fp32 all-reduce, a lossy
    or sparse all-gather, or a lossy all-to-all then all-gather); the first carries the payload the
    ledger books. `path_of`: the lossy path (`lossy_paths`; by default without a link model)."""
    codec = get_codec(codec if codec is not None else getattr(opts, "codec", "fp32"))
    path = "allgather" if is_sparse(codec) else (path_of or lossy_paths(opts, workers))(numel + extra)
    steps = mean_collectives(numel, codec, path, workers, extra)
    payload = 4 * numel if codec.name == "fp32" else codec.wire_bytes(numel)
    return [
        Transfer(step, purpose, c.op, c.nbytes, payload if i == 0 else 0, fragment, sent=c.sent)
        for i, c in enumerate(steps)
    ]


def fragment_transfer(
    step: int, p: int, numel: int, opts: Any, workers: int, path_of: PathOf | None = None
) -> list[Transfer]:
    """The collectives of a fragment's sync (its pseudo-gradients' mean)."""
    return mean_transfers(step, "pseudo_grads", numel, opts, workers, fragment=p, path_of=path_of)


def blocking(transfers: Transfer | list[Transfer]) -> list[Action]:
    """Issue each collective and wait for it, in order."""
    ts = [transfers] if isinstance(transfers, Transfer) else transfers
    return [a for t in ts for a in (Action("issue", t), Action("wait", t))]


def planned_timetable(name: str, options: dict[str, Any]) -> Timetable:
    """The strategy's timetable; CoCoDC's adaptive choice is predicted by round robin (see above)."""
    return timetable(name, {**options, "schedule": "round_robin"} if "schedule" in options else options)


def trace(
    name: str,
    options: dict[str, Any],
    size: ModelSize,
    workers: int,
    steps: int,
    *,
    step_s: float = 0.0,
    fragment_sync_s: Callable[[Transfer], float] | None = None,
    ranks_per_worker: int = 1,
    finish: bool = False,
    path_of: PathOf | None = None,
    agreement_bytes: int = 0,
) -> Trace:
    """The strategy's actions over `steps` steps (and `finish()` when asked).

    `step_s` (the inner step time) and `fragment_sync_s` (modelled seconds of a transfer) are
    needed only for CoCoDC's automatic N; `path_of`: a lossy mean's path (`lossy_paths`).
    `agreement_bytes`: a controller's agreement of that many bytes at every round's boundary
    (`trainer.adapt.Tuner`, which turns DiLoCo's and SparseLoCo's knobs): an all-reduce issued after
    the boundary's exchange and waited for at the next boundary, before its exchange. It rides behind
    the exchange on the link, and an overlapped mean's later phase waits behind it."""
    tt = planned_timetable(name, options)
    if isinstance(tt, FragmentTimetable):
        if agreement_bytes:
            raise ValueError(f"{name}: a controller's agreement is planned for periodic rounds only")
        return _fragment_trace(tt, size, workers, steps, step_s, fragment_sync_s, finish, path_of)
    sparse = sparse_exchange(name, tt, size)
    return _periodic_trace(tt, size, workers, steps, ranks_per_worker, finish, path_of, sparse, agreement_bytes)


def sparse_exchange(name: str, tt: Timetable, size: ModelSize) -> tuple[Any, str] | None:
    """(the payload, its purpose) of a strategy whose exchange is sparse (SparseLoCo, DeMo), for the
    model's trainable tensors (the whole model's layout: with FSDP inside each rank chunks its own
    shard, which moves the bytes by a few per cent); None for the others."""
    cls = strategy_class(name)
    codec = cls.wire_codec(tt.opts, size.shapes or [(n,) for n in size.grad_numels])
    return (codec, cls.exchange_purpose) if is_sparse(codec) else None


IN_WORKER_CHUNKS = 8


def _parts(total: int, n: int) -> list[int]:
    """`total` bytes in `n` near-equal parts."""
    q, rem = divmod(total, max(1, n))
    return [q + (1 if i < rem else 0) for i in range(max(1, n))]


def ring_sent(nbytes: int, ranks: int) -> int:
    """What a rank sends in a ring all-reduce of `nbytes` over `ranks` (`comm.mean_cost`)."""
    return mean_collectives(nbytes // 4, "fp32", "", ranks)[0].sent


def _grad_actions(
    tt: Timetable, size: ModelSize, t: int, ranks_per_worker: int, first: bool, world: int
) -> list[Action]:
    """DDP's bucket all-reduces in step t's backward. The first gradient step uses DDP's initial
    bucket (without `find_unused_parameters`, torch puts every gradient in one bucket until it has
    seen the order backward produces them) and ends with the broadcast of the rebuilt bucket order
    (two small broadcasts, blocking)."""
    rebuild: list[Action] = []
    if tt.ddp_step(t):
        sizes = [4 * size.params] if first else size.buckets
        sent = {b: ring_sent(b, world) for b in set(sizes)}  # buckets of a few sizes: each sent computed once
        buckets = [Transfer(t, "grads", "allreduce", b, b, between_workers=False, sent=sent[b]) for b in sizes]
        if first:
            rebuild = [
                a
                for n in REBUILD_BYTES
                for a in blocking(Transfer(t, "ddp_rebuild", "broadcast", n, 0, between_workers=False))
            ]
    elif ranks_per_worker > 1:  # the DDP (or FSDP) inside each worker, issued as backward makes its
        total = 4 * size.params  # gradients: IN_WORKER_CHUNKS equal parts carry the overlap (the time
        buckets = [
            Transfer(t, "grads_in_worker", "allreduce", part, 0, between_workers=False)  # line needs
            for part in _parts(total, min(IN_WORKER_CHUNKS, len(size.buckets)))
        ]  # their spread)
    else:
        return []
    return (
        [Action("issue", b, in_backward=True) for b in buckets]
        + [Action("wait", b, in_backward=True) for b in buckets]
        + rebuild
    )


def _boundary_actions(
    opts: Any,
    size: ModelSize,
    t: int,
    optim_state_numel: int,
    workers: int,
    path_of: PathOf | None = None,
    sparse: Any = None,
    purpose: str = "params",
) -> list[Action]:
    """`Periodic.average_params`: the blocking params mean in the strategy's codec (with drift
    telemetry, one more element that carries this worker's ‖θ_m‖², booked as `telemetry`), the
    optimizer state's mean (fp32) when asked. A sparse exchange (`sparse`: its payload, SparseLoCo's
    and DeMo's): the blocking all-gather of the trainable tensors' payload under `purpose`, then the
    float buffers' plain fp32 mean (none in an LM)."""
    if sparse is not None:
        acts = blocking(mean_transfers(t, purpose, sparse.layout.numel, opts, workers, codec=sparse))
        if size.sync_numel > size.params:
            acts += blocking(mean_transfers(t, "params", size.sync_numel - size.params, opts, workers, codec="fp32"))
        return acts
    drift = int(opts.drift_telemetry)
    acts = blocking(mean_transfers(t, "params", size.sync_numel, opts, workers, extra=drift, path_of=path_of))
    if drift:
        acts.append(Action("book", Transfer(t, "telemetry", "allreduce", 0, DRIFT_BYTES)))
    if opts.sync_optimizer_state:
        state = mean_collectives(optim_state_numel, "fp32", "", workers)[0]
        acts += blocking(Transfer(t, "optim_state", "allreduce", state.nbytes, state.nbytes, sent=state.sent))
    return acts


def _periodic_trace(
    tt: Timetable,
    size: ModelSize,
    workers: int,
    steps: int,
    ranks_per_worker: int,
    finish: bool,
    path_of: PathOf | None = None,
    sparse: tuple[Any, str] | None = None,
    agreement_bytes: int = 0,
) -> Trace:
    out = Trace()
    payload, purpose = sparse if sparse is not None else (None, "params")
    optim_numel = 2 * size.params  # AdamW's two moments (the trainer's default optimizer)
    overlap = RoundPlan(tt.opts, size, workers, path_of, payload) if getattr(tt.opts, "overlap_rounds", False) else None
    first, agreed = True, None  # agreed: the last boundary's agreement, in flight
    for t in range(1, steps + 1):
        acts = _grad_actions(tt, size, t, ranks_per_worker, first, workers * ranks_per_worker)
        first = first and not tt.ddp_step(t)
        boundary = tt.is_boundary(t)
        if boundary and agreed is not None:
            acts.append(Action("wait", agreed))
        if overlap is not None:
            acts += overlap.step(t, boundary)
        elif boundary:
            acts += _boundary_actions(tt.opts, size, t, optim_numel, workers, path_of, payload, purpose)
        if boundary and agreement_bytes:
            agreed = Transfer(
                t, "adapt", "allreduce", agreement_bytes, agreement_bytes, sent=ring_sent(agreement_bytes, workers)
            )
            acts.append(Action("issue", agreed))
        out.steps.append(acts)
    if overlap is not None and finish:
        out.finish = overlap.finish(steps, tt.final_sync(steps))
    elif finish and tt.final_sync(steps):
        out.finish = _boundary_actions(tt.opts, size, steps, optim_numel, workers, path_of, payload, purpose)
    return out


class RoundPlan:
    """`overlap_rounds` (`strategies.round_overlap`): at a round's end the mean launched a round before
    is waited for and this round's issued (a two-phase lossy mean's second phase halfway through the
    round, else when it is waited for), then the float buffers' plain mean and the optimizer state's,
    blocking; at the end the last one waited for, then the steps since (if any) averaged at once, with
    the float buffers."""

    def __init__(self, opts: Any, size: ModelSize, workers: int, path_of: PathOf | None, sparse: Any):
        self.opts, self.size, self.workers, self.path_of, self.sparse = opts, size, workers, path_of, sparse
        self.waiting: list[Transfer] = []  # issued, not yet waited for
        self.later: list[Transfer] = []  # a two-phase mean's second phase, not yet issued

    def _mean(self, t: int) -> list[Transfer]:
        numel = self.sparse.layout.numel if self.sparse is not None else self.size.sync_numel
        return mean_transfers(
            t, "pseudo_grads", numel, self.opts, self.workers, path_of=self.path_of, codec=self.sparse
        )

    def _buffers(self, t: int) -> list[Action]:
        if self.sparse is None or self.size.sync_numel <= self.size.params:
            return []
        return blocking(
            mean_transfers(t, "params", self.size.sync_numel - self.size.params, self.opts, self.workers, codec="fp32")
        )

    def _optimizer_state(self, t: int) -> list[Action]:
        if not getattr(self.opts, "sync_optimizer_state", False):
            return []
        state = mean_collectives(2 * self.size.params, "fp32", "", self.workers)[0]
        return blocking(Transfer(t, "optim_state", "allreduce", state.nbytes, state.nbytes, sent=state.sent))

    def _land(self) -> list[Action]:
        acts = [*(Action("wait", x) for x in self.waiting), *blocking(self.later)]
        self.waiting, self.later = [], []
        return acts

    def step(self, t: int, boundary: bool) -> list[Action]:
        h = self.opts.sync_every
        if self.later and h >= 2 and t % h == h // 2:  # `RoundOverlap.halfway`
            acts = [*(Action("wait", x) for x in self.waiting), *(Action("issue", x) for x in self.later)]
            self.waiting, self.later = self.later, []
            return acts
        if not boundary:
            return []
        acts = self._land()
        first, *self.later = self._mean(t)
        self.waiting = [first]
        return [*acts, Action("issue", first), *self._buffers(t), *self._optimizer_state(t)]

    def finish(self, steps: int, partial: bool) -> list[Action]:
        return [*self._land(), *([*blocking(self._mean(steps)), *self._buffers(steps)] if partial else [])]


class FragmentPlan:
    """The planner's side of a fragment timetable (`strategies.fragment_timetable.FragmentWork`): a
    transfer for every sync it starts, a wait for every merge, a blocking transfer for every final
    sync, and CoCoDC's N from the modelled sync time of a mean-sized fragment."""

    def __init__(
        self,
        tt: FragmentTimetable,
        numels: list[int],
        workers: int,
        step_s: float,
        fragment_sync_s: Callable[[Transfer], float] | None,
        path_of: PathOf | None = None,
    ):
        self.tt, self.numels, self.workers, self.path_of = tt, numels, workers, path_of
        self.step_s, self.fragment_sync_s = step_s, fragment_sync_s
        self.acts: list[Action] = []  # the actions of the step (or finish) being planned
        self.flying: dict[int, list[Transfer | None]] = {}  # fragment -> its sync's collectives in flight
        # (None: one already waited for)

    def transfer(self, t: int, p: int, numel: int) -> list[Transfer]:
        return fragment_transfer(t, p, numel, self.tt.opts, self.workers, self.path_of)

    def slot(self, t: int, choice: tuple[int, str] | None) -> None:
        """Every rank makes the same choice: nothing to plan."""

    def start(self, sync: InFlight) -> None:
        """The sync's first collective is issued now; a lossy reduce-scatter's all-gather follows when
        it is waited for (`comm.exchange`)."""
        xs = self.flying[sync.fragment] = self.transfer(sync.start, sync.fragment, self.numels[sync.fragment])
        self.acts.append(Action("issue", xs[0]))

    def halfway(self, sync: InFlight, t: int) -> None:
        """A lossy reduce-scatter's all-gather, issued halfway through the overlap (`MeanHandle.advance`)."""
        first, *rest = self.flying[sync.fragment]
        if rest:
            self.acts += [Action("wait", first), *(Action("issue", x) for x in rest)]
            self.flying[sync.fragment] = [None, *rest]  # the first done

    def merge(self, sync: InFlight, t: int, exact: bool) -> None:
        first, *rest = self.flying.pop(sync.fragment)
        if first is None:  # the rest issued halfway: wait for them
            self.acts += [Action("wait", x) for x in rest]
        else:
            self.acts += [Action("wait", first), *blocking(rest)]

    def final_sync(self, fragment: int, t: int) -> None:
        self.acts += blocking(self.transfer(t, fragment, self.numels[fragment]))

    def decide_n(self, t: int) -> int:
        o, mean = self.tt.opts, round(sum(self.numels) / self.tt.P)
        t_s = sum(self.fragment_sync_s(x) for x in self.transfer(t, 0, mean)) if self.fragment_sync_s else 0.0
        self.acts += blocking(Transfer(t, "schedule", "allreduce", AGREE_BYTES, AGREE_BYTES))
        return syncs_per_period(o.gamma, self.tt.H, self.tt.P, self.step_s, t_s, per_fragment=o.max_syncs_per_fragment)

    def take(self) -> list[Action]:
        """The actions planned since the last call."""
        acts, self.acts = self.acts, []
        return acts


def _fragment_trace(
    tt: FragmentTimetable,
    size: ModelSize,
    workers: int,
    steps: int,
    step_s: float,
    fragment_sync_s: Callable[[Transfer], float] | None,
    finish: bool,
    path_of: PathOf | None = None,
) -> Trace:
    plan = FragmentPlan(tt, size.fragments(tt.P, tt.opts.partition), workers, step_s, fragment_sync_s, path_of)
    out = Trace()
    for t in range(1, steps + 1):
        tt.step(t, plan)
        out.steps.append(plan.take())
    out.syncs_per_period = tt.schedule.n
    if finish:
        tt.finish(steps, plan)
        out.finish = plan.take()
    return out
