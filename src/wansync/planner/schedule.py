"""Which step exchanges what, taken from the strategies themselves.

For the periodic strategies the schedule is the strategy class's own methods (`is_boundary`,
`in_ddp_phase`, `phase_one_at`), called on an instance made without a model (`object.__new__`
plus its validated options): nothing but those methods runs. For Streaming DiLoCo and CoCoDC it
is `strategies.fragments.Schedule` itself (slots, round robin, fragments in flight), driven the
way `Streaming.after_inner_step` drives it: merges due first, then the slot's start, then (τ = 0)
its merge. CoCoDC's N is `transmission.syncs_per_period` from the step time and the modelled
fragment sync time, decided after step H as the strategy does. Its adaptive choice follows
R_p = ‖Δθ̃_p‖/I_p, which depends on training; the planner predicts it with round-robin choice
(same N, same bytes, same in-flight pattern when fragments are equal-sized).

The result is a list of `Transfer`s and, per step, the ordered `Action`s the training thread
takes: issue a transfer (in backward for DDP's gradient buckets, else in `step()`) and wait for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..comm.codecs import get_codec
from ..strategies import make_options, strategy_class
from ..strategies.cpdp import CPDP
from ..strategies.ddp import DDP
from ..strategies.fragments import Schedule
from ..strategies.periodic import Periodic
from ..strategies.post_local_sgd import PostLocalSGD
from ..strategies.streaming import Streaming
from ..strategies.transmission import syncs_per_period
from .sizes import ModelSize

AGREE_BYTES = (16, 8)        # CoCoDC's agreement on N: a float64 pair all-reduced, an int64 broadcast
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


def bare_strategy(name: str, options: dict[str, Any]) -> Any:
    """An instance of the strategy with its validated options and nothing else (no model, no group)."""
    cls = strategy_class(name)
    inst = object.__new__(cls)
    inst.opts = make_options(name, **options)
    return inst


def gradient_phase(inst: Any, t: int) -> bool:
    """Does step t's backward all-reduce the gradients (DDP's phase)?"""
    if isinstance(inst, DDP):
        return True
    if isinstance(inst, CPDP):
        return inst.phase_one_at(t)
    if isinstance(inst, PostLocalSGD):
        return inst.in_ddp_phase(t)
    return False


def fragment_transfer(step: int, p: int, numel: int, codec_name: str, workers: int) -> Transfer:
    """An exchange of a fragment through `Exchange.mean`: fp32 all-reduce, or all-gather of payloads."""
    codec = get_codec(codec_name)
    wire = codec.wire_bytes(numel)
    if codec.name == "fp32":
        return Transfer(step, "pseudo_grads", "allreduce", 4 * numel, wire, p)
    return Transfer(step, "pseudo_grads", "allgather", workers * wire, wire, p)


def blocking(t: Transfer) -> list[Action]:
    return [Action("issue", t), Action("wait", t)]


def trace(name: str, options: dict[str, Any], size: ModelSize, workers: int, steps: int, *,
          step_s: float = 0.0, fragment_sync_s: Callable[[Transfer], float] | None = None,
          ranks_per_worker: int = 1, finish: bool = False) -> Trace:
    """The strategy's actions over `steps` steps (and `finish()` when asked).

    `step_s` (the inner step time) and `fragment_sync_s` (modelled seconds of a transfer) are
    needed only for CoCoDC's automatic N."""
    inst = bare_strategy(name, options)
    if isinstance(inst, Streaming):
        return _fragment_trace(inst, size, workers, steps, step_s, fragment_sync_s, finish)
    return _periodic_trace(inst, size, steps, ranks_per_worker, finish)


def _grad_actions(inst: Any, size: ModelSize, t: int, ranks_per_worker: int, first: bool) -> list[Action]:
    """DDP's bucket all-reduces in step t's backward. The first gradient step uses DDP's initial
    bucket (without `find_unused_parameters`, torch puts every gradient in one bucket until it has
    seen the order backward produces them) and ends with the broadcast of the rebuilt bucket order
    (two small broadcasts, blocking)."""
    rebuild: list[Action] = []
    if gradient_phase(inst, t):
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


def _boundary_actions(inst: Periodic, size: ModelSize, t: int, optim_state_numel: int) -> list[Action]:
    """`Periodic.average_params`: the blocking params mean (with drift telemetry, one more element that
    carries this worker's ‖θ_m‖², booked as `telemetry`), the optimizer state's mean when asked."""
    drift_on = bool(getattr(inst.opts, "drift_telemetry", True))
    params = Transfer(t, "params", "allreduce", 4 * size.sync_numel + (DRIFT_BYTES if drift_on else 0),
                      4 * size.sync_numel)
    acts = blocking(params)
    if drift_on:
        acts.append(Action("book", Transfer(t, "telemetry", "allreduce", 0, DRIFT_BYTES)))
    if getattr(inst.opts, "sync_optimizer_state", False):
        acts += blocking(Transfer(t, "optim_state", "allreduce", 4 * optim_state_numel, 4 * optim_state_numel))
    return acts


def _periodic_trace(inst: Any, size: ModelSize, steps: int, ranks_per_worker: int, finish: bool) -> Trace:
    out = Trace()
    optim_numel = 2 * size.params                 # AdamW's two moments (the trainer's default optimizer)
    first = True
    for t in range(1, steps + 1):
        acts = _grad_actions(inst, size, t, ranks_per_worker, first)
        first = first and not gradient_phase(inst, t)
        if isinstance(inst, Periodic) and inst.is_boundary(t):
            acts += _boundary_actions(inst, size, t, optim_numel)
        out.steps.append(acts)
    if finish and isinstance(inst, Periodic) and not (isinstance(inst, PostLocalSGD) and inst.in_ddp_phase(steps)):
        if not inst.is_boundary(steps):
            out.finish = _boundary_actions(inst, size, steps, optim_numel)
    return out


def _fragment_trace(inst: Streaming, size: ModelSize, workers: int, steps: int, step_s: float,
                    fragment_sync_s: Callable[[Transfer], float] | None, finish: bool) -> Trace:
    o = inst.opts
    H, P, tau = o.sync_every, o.fragments, o.overlap
    numels = size.fragments(P, o.partition)
    adaptive_n = getattr(o, "schedule", None) is not None and o.syncs_per_period == 0
    schedule = Schedule(H, P, o.syncs_per_period or P, "round_robin")
    in_flight: dict[int, tuple[int, Transfer]] = {}          # fragment -> (merge step, transfer)
    merged_exact: dict[int, int] = {}      # fragment -> step at which a merge left it exactly at θ̃_p
    compensation = getattr(o, "compensation", "alpha")              # taylor and damped keep θ(t_p)

    def merge(p: int, t: int, acts: list[Action]) -> None:
        """The merge leaves θ̃_p's exact bits for α = 0 (α- and damped merge), and for the Taylor and
        damped merges only after 0 steps."""
        x = in_flight.pop(p)[1]
        acts.append(Action("wait", x))
        exact = (compensation == "alpha" or t == x.step) and (compensation == "taylor" or o.alpha == 0)
        if exact:
            merged_exact[p] = t

    def merge_due(t: int, acts: list[Action]) -> None:
        for p in [p for p, (at, _) in in_flight.items() if at <= t]:
            merge(p, t, acts)

    out = Trace()

    for t in range(1, steps + 1):
        acts: list[Action] = []
        merge_due(t, acts)
        if schedule.is_slot(t):
            choice = schedule.choose(t, set(in_flight))
            if choice is not None:
                p = choice[0]
                schedule.record_start(p, t)
                x = fragment_transfer(t, p, numels[p], o.codec, workers)
                in_flight[p] = (t + tau, x)
                acts.append(Action("issue", x))
            merge_due(t, acts)
        if adaptive_n and t >= H and out.syncs_per_period is None:
            mean = round(sum(numels) / P)
            t_s = fragment_sync_s(fragment_transfer(t, 0, mean, o.codec, workers)) if fragment_sync_s else 0.0
            schedule.set_n(syncs_per_period(o.gamma, H, P, step_s, t_s, per_fragment=o.max_syncs_per_fragment))
            out.syncs_per_period = schedule.n
            for b, op in zip(AGREE_BYTES, ("allreduce", "broadcast")):
                acts += blocking(Transfer(t, "schedule", op, b, b))
        out.steps.append(acts)
    if out.syncs_per_period is None:
        out.syncs_per_period = schedule.n
    if finish:
        for p in sorted(in_flight, key=lambda p: in_flight[p][1].step):
            merge(p, steps, out.finish)
        for p in range(P):
            if merged_exact.get(p) != steps:
                out.finish += blocking(fragment_transfer(steps, p, numels[p], o.codec, workers))
    return out
