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
from ..strategies import timetable
from ..strategies.fragment_timetable import FragmentTimetable
from ..strategies.inflight import InFlight
from ..strategies.timetable import Timetable
from ..strategies.transmission import syncs_per_period
from .sizes import ModelSize

AGREE_BYTES = 16             # CoCoDC's agreement on N: the mean of a float64 pair (T_c, T_s)
DRIFT_BYTES = 4              # the drift telemetry: one float32 element riding on the parameter exchange
REBUILD_BYTES = (108, 8)     # DDP's broadcast of rank 0's rebuilt bucket order after its first backward (tiny LM)


@dataclass
class Transfer:
    """One collective: its purpose, op and full-buffer bytes (the cost model's B), and the bytes this
    rank books on its ledger (its payload)."""
    step: int
    purpose: str               # grads | params | pseudo_grads | optim_state | telemetry | schedule
    op: str                    # allreduce | allgather | broadcast
    nbytes: int
    payload: int
    fragment: int | None = None
    between_workers: bool = True   # False: DDP's gradient all-reduce (over every rank)


@dataclass
class Action:
    kind: str                  # "issue" | "wait" | "book" (bytes booked on the ledger, carried by another collective)
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


def fragment_transfer(step: int, p: int, numel: int, codec_name: str, workers: int) -> Transfer:
    """An exchange of a fragment through `Exchange.mean`: fp32 all-reduce, or all-gather of payloads."""
    codec = get_codec(codec_name)
    wire = codec.wire_bytes(numel)
    if codec.name == "fp32":
        return Transfer(step, "pseudo_grads", "allreduce", 4 * numel, wire, p)
    return Transfer(step, "pseudo_grads", "allgather", workers * wire, wire, p)


def blocking(t: Transfer) -> list[Action]:
    return [Action("issue", t), Action("wait", t)]


def planned_timetable(name: str, options: dict[str, Any]) -> Timetable:
    """The strategy's timetable; CoCoDC's adaptive choice is predicted by round robin (see above)."""
    return timetable(name, {**options, "schedule": "round_robin"} if "schedule" in options else options)


def trace(name: str, options: dict[str, Any], size: ModelSize, workers: int, steps: int, *,
          step_s: float = 0.0, fragment_sync_s: Callable[[Transfer], float] | None = None,
          ranks_per_worker: int = 1, finish: bool = False) -> Trace:
    """The strategy's actions over `steps` steps (and `finish()` when asked).

    `step_s` (the inner step time) and `fragment_sync_s` (modelled seconds of a transfer) are
    needed only for CoCoDC's automatic N."""
    tt = planned_timetable(name, options)
    if isinstance(tt, FragmentTimetable):
        return _fragment_trace(tt, size, workers, steps, step_s, fragment_sync_s, finish)
    return _periodic_trace(tt, size, steps, ranks_per_worker, finish)


def _grad_actions(tt: Timetable, size: ModelSize, t: int, ranks_per_worker: int, first: bool) -> list[Action]:
    """DDP's bucket all-reduces in step t's backward. The first gradient step uses DDP's initial
    bucket (without `find_unused_parameters`, torch puts every gradient in one bucket until it has
    seen the order backward produces them) and ends with the broadcast of the rebuilt bucket order
    (two small broadcasts, blocking)."""
    rebuild: list[Action] = []
    if tt.ddp_step(t):
        sizes = [4 * size.params] if first else size.buckets
        buckets = [Transfer(t, "grads", "allreduce", b, b, between_workers=False) for b in sizes]
        if first:
            rebuild = [a for n in REBUILD_BYTES for a in blocking(Transfer(t, "ddp_rebuild", "broadcast", n, 0,
                                                                          between_workers=False))]
    elif ranks_per_worker > 1:           # the DDP inside each worker: one transfer (its link's latency is µs)
        buckets = [Transfer(t, "grads_in_worker", "allreduce", 4 * size.params, 0, between_workers=False)]
    else:
        return []
    return ([Action("issue", b, in_backward=True) for b in buckets]
            + [Action("wait", b, in_backward=True) for b in buckets] + rebuild)


def _boundary_actions(opts: Any, size: ModelSize, t: int, optim_state_numel: int) -> list[Action]:
    """`Periodic.average_params`: the blocking params mean (with drift telemetry, one more element that
    carries this worker's ‖θ_m‖², booked as `telemetry`), the optimizer state's mean when asked."""
    params = Transfer(t, "params", "allreduce", 4 * size.sync_numel + (DRIFT_BYTES if opts.drift_telemetry else 0),
                      4 * size.sync_numel)
    acts = blocking(params)
    if opts.drift_telemetry:
        acts.append(Action("book", Transfer(t, "telemetry", "allreduce", 0, DRIFT_BYTES)))
    if opts.sync_optimizer_state:
        acts += blocking(Transfer(t, "optim_state", "allreduce", 4 * optim_state_numel, 4 * optim_state_numel))
    return acts


def _periodic_trace(tt: Timetable, size: ModelSize, steps: int, ranks_per_worker: int, finish: bool) -> Trace:
    out = Trace()
    optim_numel = 2 * size.params                 # AdamW's two moments (the trainer's default optimizer)
    first = True
    for t in range(1, steps + 1):
        acts = _grad_actions(tt, size, t, ranks_per_worker, first)
        first = first and not tt.ddp_step(t)
        if tt.is_boundary(t):
            acts += _boundary_actions(tt.opts, size, t, optim_numel)
        out.steps.append(acts)
    if finish and tt.final_sync(steps):
        out.finish = _boundary_actions(tt.opts, size, steps, optim_numel)
    return out


class FragmentPlan:
    """The planner's side of a fragment timetable (`strategies.fragment_timetable.FragmentWork`): a
    transfer for every sync it starts, a wait for every merge, a blocking transfer for every final
    sync, and CoCoDC's N from the modelled sync time of a mean-sized fragment."""

    def __init__(self, tt: FragmentTimetable, numels: list[int], workers: int, step_s: float,
                 fragment_sync_s: Callable[[Transfer], float] | None):
        self.tt, self.numels, self.workers = tt, numels, workers
        self.step_s, self.fragment_sync_s = step_s, fragment_sync_s
        self.acts: list[Action] = []                 # the actions of the step (or finish) being planned
        self.flying: dict[int, Transfer] = {}        # fragment -> its sync in flight

    def transfer(self, t: int, p: int, numel: int) -> Transfer:
        return fragment_transfer(t, p, numel, self.tt.opts.codec, self.workers)

    def slot(self, t: int, choice: tuple[int, str] | None) -> None:
        """Every rank makes the same choice: nothing to plan."""

    def start(self, sync: InFlight) -> None:
        x = self.flying[sync.fragment] = self.transfer(sync.start, sync.fragment, self.numels[sync.fragment])
        self.acts.append(Action("issue", x))

    def merge(self, sync: InFlight, t: int, exact: bool) -> None:
        self.acts.append(Action("wait", self.flying.pop(sync.fragment)))

    def final_sync(self, fragment: int, t: int) -> None:
        self.acts += blocking(self.transfer(t, fragment, self.numels[fragment]))

    def decide_n(self, t: int) -> int:
        o, mean = self.tt.opts, round(sum(self.numels) / self.tt.P)
        t_s = self.fragment_sync_s(self.transfer(t, 0, mean)) if self.fragment_sync_s else 0.0
        self.acts += blocking(Transfer(t, "schedule", "allreduce", AGREE_BYTES, AGREE_BYTES))
        return syncs_per_period(o.gamma, self.tt.H, self.tt.P, self.step_s, t_s, per_fragment=o.max_syncs_per_fragment)

    def take(self) -> list[Action]:
        """The actions planned since the last call."""
        acts, self.acts = self.acts, []
        return acts


def _fragment_trace(tt: FragmentTimetable, size: ModelSize, workers: int, steps: int, step_s: float,
                    fragment_sync_s: Callable[[Transfer], float] | None, finish: bool) -> Trace:
    plan = FragmentPlan(tt, size.fragments(tt.P, tt.opts.partition), workers, step_s, fragment_sync_s)
    out = Trace()
    for t in range(1, steps + 1):
        tt.step(t, plan)
        out.steps.append(plan.take())
    out.syncs_per_period = tt.schedule.n
    if finish:
        tt.finish(steps, plan)
        out.finish = plan.take()
    return out
