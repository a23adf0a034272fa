"""One prediction: a strategy with its knobs, a model size, M workers (R ranks each), a link and a
step time -> wall clock, exposed communication, bytes per worker per step and the memory a rank
holds (`memory.py`); and the smallest H whose exposed communication stays below a target.

The numbers come from simulating the strategy's own schedule (`schedule.py`) step by step on the
emulator's cost model (`simulate.py`). Either the steady state of a long run: a warm-up (CoCoDC's
first period, which runs at N = P until N is decided; post-local SGD's DDP phase, DDP's first
gradient step), then two periods whose time, exposed communication and bytes are scaled to 1000
steps; or, given its number of steps, a whole run: every step from the first, the last partial
round and `finish()`'s last exchange included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

from ..errors import ConfigError
from ..net.topology import Topology
from ..strategies import resolve_options
from ..strategies.fragment_timetable import FragmentTimetable
from ..strategies.pace import Pace
from .asynchronous import AsyncRun, Figures, is_asynchronous, simulate_async
from .memory import async_bill, memory_bill
from .schedule import PathOf, Trace, Transfer, lossy_paths, planned_timetable, trace
from .simulate import DDP_OVERLAP, StepTimes, Timeline, simulate, transfer_seconds
from .sizes import ModelSize

STEPS = 1000
# The simulation walks every step (tens of µs each): a setting whose warm-up and two periods are longer
# would take minutes to hours (`plan --sync-every 100000000` never answered); it is refused instead.
MAX_SIMULATED_STEPS = 300_000  # H up to 100,000
#: An asynchronous steady state: the middle of a run of this many rounds of H steps (`AsyncRun.window`).
STEADY_ROUNDS = 40
H_CANDIDATES = (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100, 128, 200, 250, 500, 1000, 2000, 5000)


@dataclass(frozen=True)
class Setting:
    """Everything a prediction depends on."""

    strategy: str
    options: dict[str, Any]  # the strategy's options (defaults filled in by `setting`)
    size: ModelSize
    workers: int
    topology: Topology
    step_s: float  # compute per step: forward, backward, inner step
    other_s: float = 0.0  # the rest of a step outside communication (data, averaging)
    ranks_per_worker: int = 1
    overlap: float = DDP_OVERLAP  # share of the compute DDP's bucket all-reduces overlap
    host_bytes_per_s: float | None = None  # the real backend's rate here (see `transfer_seconds`)
    step_times: StepTimes | None = None  # per worker, per step (compute, other): replayed (`simulate`)
    inside: str = "ddp"  # how a worker's ranks hold the model: ddp (whole) | fsdp (sharded)
    optimizer: str = "adamw"  # the inner optimizer (its state is part of the memory bill)
    momentum: float = 0.0  # SGD's momentum (a buffer when > 0)
    agreement_bytes: int = 0  # a controller's agreement at each boundary (`--adapt`'s; `schedule.trace`)


def setting(
    strategy: str, options: dict[str, Any], size: ModelSize, workers: int, topology: Topology, step_s: float, **kw: Any
) -> Setting:
    """A Setting with the strategy's options validated and its defaults filled in."""
    return Setting(strategy, resolve_options(strategy, options), size, workers, topology, step_s, **kw)


@dataclass(frozen=True)
class Prediction:
    """A steady state (`whole` False: the window after `first` warm-up steps, scaled to 1000 steps) or
    a whole run (`whole`: the timeline's steps from the first, and `finish()` when it was simulated)."""

    setting: Setting
    timeline: Timeline
    syncs_per_period: int | None
    first: int = 0  # steps before the measured window (warm-up)
    whole: bool = False

    @cached_property
    def memory(self) -> dict[str, int]:
        """Rank 0's bytes by category, total, transient, host, per_gpu (`memory.py`)."""
        return memory_bill(self.setting, self.timeline.held_in_flight)

    @property
    def steps(self) -> int:
        """The steps the figures are for: the whole run's, or 1000 (a steady state)."""
        return self.timeline.steps if self.whole else STEPS

    @property
    def wall_s(self) -> float:
        """The wall clock of `steps` steps: the whole run's (`finish()` included), or per 1000 steps."""
        return self.timeline.wall_s if self.whole else self.wall_per_1000_s

    @property
    def compute_s(self) -> float:
        """The same steps' compute alone, as if no byte had to move."""
        return self.steps * (self.setting.step_s + self.setting.other_s)

    @property
    def utilization_pct(self) -> float:
        """Compute alone as a share of the wall clock."""
        return 100.0 * self.compute_s / self.wall_s if self.wall_s > 0 else 100.0

    @property
    def wall_per_1000_s(self) -> float:
        return self.timeline.window(self.first)[0] * STEPS / (self.timeline.steps - self.first)

    @property
    def exposed_pct(self) -> float:
        if self.whole:
            wall, exposed = self.timeline.wall_s, self.timeline.exposed_s
        else:
            wall, exposed, _ = self.timeline.window(self.first)
        return 100.0 * exposed / wall if wall > 0 else 0.0

    @property
    def bytes_per_step(self) -> float:
        """The payload a worker contributes per step (what its ledger books as `bytes`)."""
        if self.whole:
            return self.timeline.payload_bytes / self.timeline.steps
        return self.timeline.window(self.first)[2] / (self.timeline.steps - self.first)

    @property
    def sent_per_step(self) -> float:
        """What a worker puts on the wire per step to move it (its ledger's `sent`): a ring all-reduce
        about 2(M−1)/M of its payload, an all-gather (M−1) payloads, a lossy reduce-scatter 2(M−1)/M."""
        if self.whole:
            return self.timeline.sent_bytes / self.timeline.steps
        marks, first = self.timeline.sent_marks, self.first
        return (marks[-1] - (marks[first - 1] if first > 0 else 0)) / (self.timeline.steps - first)


@dataclass(frozen=True)
class AsyncPrediction(Prediction):
    """An asynchronous run's (`asynchronous.py`): a whole run, or its steady state (`AsyncRun.window`),
    each figure over every learner."""

    run: AsyncRun | None = None

    @property
    def result(self) -> AsyncRun:
        assert self.run is not None
        return self.run

    @cached_property
    def figures(self) -> Figures:
        return self.result.figures(self.whole)

    @property
    def wall_per_1000_s(self) -> float:
        return self.figures.seconds * STEPS / self.figures.steps

    @property
    def wall_s(self) -> float:
        return self.result.wall_s if self.whole else self.wall_per_1000_s

    @property
    def exposed_pct(self) -> float:
        return self.figures.exposed_pct

    @property
    def bytes_per_step(self) -> float:
        """A learner's ledger per run step: its contributions (the versions it takes are booked nowhere)."""
        return sum(sent for sent, _ in self.figures.bytes) / self.setting.workers / self.figures.steps

    @property
    def sent_per_step(self) -> float:
        return self.bytes_per_step  # a message goes as it is booked

    @cached_property
    def memory(self) -> dict[str, int]:
        return async_bill(self.setting)


def predict_async(s: Setting, steps: int | None = None) -> AsyncPrediction:
    """A whole run of `steps` steps, or the steady state of one of STEADY_ROUNDS rounds of H steps."""
    n = steps if steps is not None else STEADY_ROUNDS * int(s.options["sync_every"])
    run = simulate_async(s, n, workers_times(s))
    waited = sum(b - a for x in run.learners for a, b in x.waiting) / s.workers
    tl = Timeline(run.wall_s, waited, n * (s.step_s + s.other_s), n, 0, (), len(run.merges), [], [], 0)
    return AsyncPrediction(s, tl, None, 0, steps is not None, run)


def seconds_of(s: Setting) -> Callable[[Transfer], float]:
    return transfer_seconds(s.topology, s.workers, s.ranks_per_worker, s.host_bytes_per_s)


def run_trace(s: Setting, steps: int, finish: bool = False) -> Trace:
    seconds = seconds_of(s)
    # CoCoDC's T_c is the time a step spends outside the strategy's own sync work (forward,
    # backward, data, inner step): `step_s`, without the averaging `other_s` also holds.
    return trace(
        s.strategy,
        s.options,
        s.size,
        s.workers,
        steps,
        step_s=s.step_s,
        fragment_sync_s=seconds,
        ranks_per_worker=s.ranks_per_worker,
        finish=finish,
        path_of=paths_of(s),
        agreement_bytes=s.agreement_bytes,
    )


def paths_of(s: Setting) -> PathOf:
    """A lossy mean's path as the emulated run picks it on this setting's link (`schedule.lossy_paths`)."""
    return lossy_paths(s.options, s.workers, s.topology, s.ranks_per_worker, s.inside == "fsdp")


def warmup_steps(s: Setting) -> int:
    """Steps before the steady state: post-local SGD's DDP phase, CoCoDC's period at N = P, DDP's
    first gradient step (its initial buckets)."""
    o, tt = s.options, planned_timetable(s.strategy, s.options)
    if isinstance(tt, FragmentTimetable) and not tt.n_decided:
        return tt.H  # N is decided at the first step >= H
    first_grad = next((t for t in range(1, o.get("sync_every", 1) + 1) if tt.ddp_step(t)), 0)
    return max(o.get("switch_step", 0), first_grad)


def predict(s: Setting, steps: int | None = None, finish: bool = False) -> Prediction:
    """The steady state (warm-up, then two periods measured), or, given `steps`, a whole run of that
    many steps (with `finish()` when asked) measured from step 1. An asynchronous strategy's learners
    share no timetable: their run is simulated event by event (`asynchronous.py`, finals included)."""
    if is_asynchronous(s.strategy):
        return predict_async(s, steps)
    h = int(s.options.get("sync_every", 1))
    check_simulated_steps(steps if steps is not None else max(int(s.options.get("switch_step", 0)), h) + 2 * h, s)
    first = warmup_steps(s) if steps is None else 0
    n = steps if steps is not None else first + 2 * h
    tr = run_trace(s, n, finish)
    tl = simulate(
        tr,
        seconds_of(s),
        s.step_s,
        s.other_s,
        s.overlap,
        include_finish=finish,
        step_times=workers_times(s),
        steady_links=not s.topology.varies,
    )
    return Prediction(s, tl, tr.syncs_per_period if "fragments" in s.options else None, first, steps is not None)


def check_simulated_steps(n: int, s: Setting) -> None:
    """One line when the prediction would simulate more than MAX_SIMULATED_STEPS steps."""
    if n > MAX_SIMULATED_STEPS:
        knobs = ", ".join(f"{k} {s.options[k]}" for k in ("sync_every", "switch_step") if s.options.get(k))
        raise ConfigError(
            f"the planner simulates each step of the warm-up and two periods: {n:,} steps here ({knobs}), "
            f"at most {MAX_SIMULATED_STEPS:,}; plan a shorter period"
        )


def workers_times(s: Setting) -> StepTimes | None:
    """Each worker's step times: the replayed ones (worker w replays series w mod their number), else
    from the topology's worker speeds (`step_s` times each worker's slowdown), through the strategy's
    slow policy: the steps of a round each worker computes (`Pace.planned_slots`; an idle step takes
    no compute). None: identical workers."""
    if s.step_times is not None:
        if s.ranks_per_worker != 1:
            raise ConfigError("replayed step times (--step-times) need one rank per worker")
        return tuple(s.step_times[w % len(s.step_times)] for w in range(s.workers))
    if not s.topology.speeds or s.topology.workers != s.workers:
        return None
    times = [s.step_s * s.topology.slowdown(w) for w in range(s.workers)]
    pace = Pace(
        s.options.get("slow_policy", "wait"),
        int(s.options.get("sync_every", 1)),
        float(s.options.get("deadline", 0.0)),
        None,
        workers=s.workers,
    )
    pace.agreed = times
    return tuple(
        tuple((t if computes else 0.0, s.other_s) for computes in pace.planned_slots(w))
        for w, t in zip(range(s.workers), times)
    )


def takes_h(options: dict[str, Any], h: int) -> bool:
    """Can the strategy run with period H = `h`? A fragment strategy's period must hold its P fragments,
    exceed its overlap τ and hold its N syncs when N is fixed."""
    o = options
    return "fragments" not in o or not (
        o["fragments"] > h
        or o["overlap"] >= h
        or (o["syncs_per_period"] and not o["fragments"] <= o["syncs_per_period"] <= h)
    )


def periods(steps: int | None = None) -> tuple[int, ...]:
    """The periods H a plan tries: H_CANDIDATES; in a whole run of `steps` steps those up to steps / 2,
    two rounds at least (a period as long as the run would exchange only in `finish()`)."""
    return tuple(h for h in H_CANDIDATES if steps is None or 2 * h <= steps)


def smallest_h(
    s: Setting, target_pct: float, steps: int | None = None, candidates: tuple[int, ...] | None = None
) -> tuple[Prediction | None, bool]:
    """The prediction at the smallest H of `candidates` (`periods(steps)` by default; those the strategy
    can take) whose exposed communication is at most `target_pct`, the other knobs unchanged, and True;
    when none reaches it, the prediction at the largest (the least exposed) and False; (None, False)
    without candidates. `steps`: predict whole runs of that many steps (`finish()` included), else the
    steady state.

    The exposed share does not grow with H (`tests/test_planner.py`), so the candidates are walked
    at doubling strides from the smallest until one reaches the target, then bisected: a handful of
    predictions, the longest periods simulated only when no shorter one reaches it."""
    hs = [h for h in (periods(steps) if candidates is None else candidates) if takes_h(s.options, h)]
    if not hs:
        return None, False
    tried: dict[int, Prediction] = {}

    def at(i: int) -> Prediction:
        if i not in tried:
            o = {**s.options, "sync_every": hs[i]}
            tried[i] = predict(dataclasses.replace(s, options=o), steps, finish=steps is not None)
        return tried[i]

    def reaches(i: int) -> bool:
        return at(i).exposed_pct <= target_pct

    low, stride = -1, 1  # hs[low] is known not to reach the target (-1: none tried)
    while True:
        high = min(low + stride, len(hs) - 1)
        if reaches(high):
            break
        if high == len(hs) - 1:
            return at(high), False
        low, stride = high, 2 * stride
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if reaches(mid) else (mid, high)
    return at(high), True


def recommend_h(s: Setting, target_pct: float, steps: int | None = None) -> int | None:
    """The smallest H (K for CPDP) whose predicted exposed communication is at most `target_pct`,
    the strategy's other knobs unchanged; None when no candidate reaches it or there is no H."""
    if "sync_every" not in s.options:
        return None
    p, reached = smallest_h(s, target_pct, steps)
    return int(p.setting.options["sync_every"]) if p is not None and reached else None
