"""The training thread's time line over a trace, on the emulator's cost model and FIFO link.

Each step: the backward takes `compute_s` (forward, backward, inner step); DDP's gradient buckets
are issued during it, bucket k when the gradients it holds are ready, assumed spread evenly over
the last `overlap` fraction of the compute (default 2/3: the backward's share); the thread then
waits for the last bucket. Then `step()`'s actions run in order: a blocking exchange is issued and
waited for at once, an overlapped fragment sync is issued at t_p and waited for τ steps later
(exposed by whatever of it is left then). The rest of the step (`other_s`: data, averaging, outer
steps) adds no communication.

The link is the emulator's: one transfer at a time per rank, in issue order (start = max(issue,
end of the previous transfer)), each taking `net.cost.exchange_seconds` of the cost model on the
links as they are at its start (a topology's link schedules: the run's time is the simulation's). Jitter is
left out (the presets have none); so is the real backend's own time, which the emulator takes
when it is slower than the model (on a loaded CPU, for the fast presets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..net.cost import exchange_seconds, in_worker_seconds
from ..net.topology import Topology
from .schedule import Action, Trace, Transfer

DDP_OVERLAP = 2 / 3
#: Per worker, per step: (compute seconds, other seconds); see `simulate`.
StepTimes = tuple[tuple[tuple[float, float], ...], ...]


def transfer_seconds(
    topology: Topology, workers: int, ranks_per_worker: int = 1, host_bytes_per_s: float | None = None
) -> Callable[..., float]:
    """Modelled seconds of a transfer: `net.cost.exchange_seconds` with the ranks of a worker (R > 1)
    on the topology's link inside a worker (`Topology.inside_worker`, as the emulator). DDP's gradient all-reduce (over every rank) is the hierarchical one; the DDP
    inside a worker (the other strategies) is an all-reduce over its R ranks.

    `host_bytes_per_s`: the emulator completes a collective at max(real, modelled); given the rate at
    which the real backend moves a buffer on the machine at hand, the real part is modelled as
    B / rate (for validating against emulated runs on a loaded CPU; None: the link model alone)."""

    known: dict[tuple[str, str, int, bool], float] = {}  # links that never change: one cost per kind of transfer

    def seconds(x: Transfer, at_s: float = 0.0) -> float:
        if topology.varies:
            modelled = link_seconds(x, at_s)
        else:
            key = (x.purpose, x.op, x.nbytes, x.between_workers)
            modelled = known[key] if key in known else known.setdefault(key, link_seconds(x, 0.0))
        return modelled if host_bytes_per_s is None else max(modelled, x.nbytes / host_bytes_per_s)

    def link_seconds(x: Transfer, at_s: float) -> float:
        if x.purpose == "grads_in_worker":
            return in_worker_seconds(x.op, x.nbytes, ranks_per_worker, topology)
        return exchange_seconds(
            x.op, x.nbytes, topology, workers, ranks_per_worker, reduce_inside=not x.between_workers, at_s=at_s
        )

    return seconds


@dataclass
class Timeline:
    """What a trace costs: wall clock, exposed communication, bytes, and the fragment syncs held in
    flight between steps (the end of the step with the most bytes in flight: their buffers are
    what a rank holds for them, `planner.memory`)."""

    wall_s: float
    exposed_s: float
    compute_s: float
    steps: int
    payload_bytes: int
    held_in_flight: tuple[Transfer, ...]
    events: int
    marks: list[tuple[float, float, int]]  # after each step: (time, exposed so far, payload so far)
    sent_marks: list[int]  # after each step: bytes a worker sent so far (`Transfer.sent`)
    sent_bytes: int = 0  # what a worker sent over the whole trace, `finish()` included

    def window(self, first: int) -> tuple[float, float, int]:
        """(seconds, exposed seconds, payload bytes) of steps first+1 .. the last."""
        t0, e0, b0 = self.marks[first - 1] if first > 0 else (0.0, 0.0, 0)
        t1, e1, b1 = self.marks[-1]
        return t1 - t0, e1 - e0, b1 - b0

    @property
    def exposed_pct(self) -> float:
        return 100.0 * self.exposed_s / self.wall_s if self.wall_s > 0 else 0.0


class Simulation:
    """The workers' shared link and what they have waited for: transfers are issued and waited for
    through it, step by step (`run_step`)."""

    def __init__(self, seconds: Callable[..., float], workers: int, overlap: float = DDP_OVERLAP):
        self.seconds, self.workers, self.overlap = seconds, workers, overlap
        self.link_free = [0.0] * workers  # when each worker's link is free again
        self.exposed = [0.0] * workers  # seconds each worker has waited on the link
        self.ends: dict[int, float] = {}  # id(transfer) -> when it is done
        self.in_flight: dict[int, Transfer] = {}  # id(fragment sync) -> it, until waited for
        self.held: tuple[Transfer, ...] = ()  # in flight at the end of the step with the most bytes so
        self.payload = self.events = self.sent = 0

    def issue(self, x: Transfer, at: list[float]) -> None:
        """Worker w issues `x` at `at[w]`: it starts once the last has issued it and the link is free."""
        start = max(max(a, f) for a, f in zip(at, self.link_free))
        end = start + self.seconds(x, start)  # the links as they are when it starts (their schedules)
        self.link_free[:] = [end] * self.workers
        self.ends[id(x)] = end
        self.payload += x.payload
        self.sent += x.sent
        self.events += 1
        if x.purpose == "pseudo_grads":
            self.in_flight[id(x)] = x

    def wait(self, x: Transfer, at: list[float]) -> list[float]:
        """Worker w waits for `x` from `at[w]`; returns when each is free again."""
        end = self.ends[id(x)]
        self.in_flight.pop(id(x), None)
        for w in range(self.workers):
            self.exposed[w] += max(0.0, end - at[w])
        return [max(a, end) for a in at]

    def end_step(self) -> None:
        """Note what is in flight between this step and the next."""
        now = tuple(self.in_flight.values())
        if sum(x.nbytes for x in now) > sum(x.nbytes for x in self.held):
            self.held = now

    def alike(self, actions: list[Action], start: list[float], busy: list[float]) -> tuple | None:
        """The key under which this step costs exactly what an earlier one with the same key cost: one
        time line (identical workers), an idle link at its start, the same compute and the same actions,
        every transfer issued and waited for within the step. None: the step depends on what came before."""
        if self.workers != 1 or self.link_free[0] > start[0]:
            return None
        issued: dict[int, int] = {}
        waited = 0
        key: list[Any] = [busy[0]]
        for a in actions:
            x = a.transfer
            if a.kind == "issue":
                issued[id(x)] = len(issued)
            elif a.kind == "wait":
                if id(x) not in issued:
                    return None
                waited += 1
            key.append((a.kind, a.in_backward, x.purpose, x.op, x.nbytes, x.payload, x.sent, issued.get(id(x))))
        return tuple(key) if waited == len(issued) else None

    def state(self, now: list[float]) -> tuple[float, float, int, int, int, float]:
        """What a step changes: the time, the exposed time, the bytes booked and sent, the events, the
        link's free time."""
        return now[0], self.exposed[0], self.payload, self.sent, self.events, self.link_free[0]

    def replay(self, change: tuple[float, ...], now: list[float]) -> list[float]:
        """Apply an alike step's `change` (the difference of `state` over it) from `now`."""
        dt, exposed, payload, sent, events, free = change
        self.exposed[0] += exposed
        self.payload, self.sent, self.events = (
            self.payload + int(payload),
            self.sent + int(sent),
            self.events + int(events),
        )
        self.link_free[0] = now[0] + free  # free: relative to the step's start
        return [now[0] + dt]

    def run_step(self, actions: list[Action], start: list[float], busy: list[float]) -> list[float]:
        """One step's actions from `start` with `busy` seconds of compute per worker: the backward's
        bucket all-reduces (issued as their gradients are ready), then `step()`'s in order."""
        backward = [a for a in actions if a.in_backward]
        issued = [a.transfer for a in backward if a.kind == "issue"]
        total = sum(x.nbytes for x in issued) or 1
        done = 0
        for x in issued:
            done += x.nbytes
            self.issue(x, [s0 + b * (1 - self.overlap) + b * self.overlap * done / total for s0, b in zip(start, busy)])
        t = [s0 + b for s0, b in zip(start, busy)]
        for a in backward:
            if a.kind == "wait":
                t = self.wait(a.transfer, t)
        for a in actions:
            if a.in_backward:
                continue
            if a.kind == "issue":
                self.issue(a.transfer, t)
            elif a.kind == "book":  # carried by another collective: bytes only
                self.payload += a.transfer.payload
                self.sent += a.transfer.sent
            else:
                t = self.wait(a.transfer, t)
        return t


def simulate(
    trace: Trace,
    seconds: Callable[..., float],
    compute_s: float,
    other_s: float = 0.0,
    overlap: float = DDP_OVERLAP,
    include_finish: bool = False,
    step_times: StepTimes | None = None,
    steady_links: bool = False,
) -> Timeline:
    """Worker 0's time line. Identical workers (every step `compute_s`, then `other_s`) arrive at
    every exchange together; with `step_times` (per worker, per step: (compute, other), e.g. a
    measured run's, replayed cyclically), each worker runs its own time line and a transfer starts
    on the link when the last worker has issued it and its link is free, as on the emulator: an
    early worker waits for the straggler and then for the transfer. `steady_links`: the links never
    change (no schedules), so a step alike to an earlier one (`Simulation.alike`: DDP's thousand
    buckets step after step) is not walked again but costs what that one cost."""
    times = step_times if step_times else (((compute_s, other_s),),)
    sim = Simulation(seconds, len(times), overlap)
    now = [0.0] * sim.workers
    marks, sent_marks, computed = [], [], 0.0
    seen: dict[tuple, tuple[float, ...]] = {}
    for i, acts in enumerate(trace.steps):
        step = [w[i % len(w)] for w in times]
        busy = [c for c, _ in step]
        key = sim.alike(acts, now, busy) if steady_links else None
        if key is not None and key in seen:
            t = sim.replay(seen[key], now)
        else:
            before = sim.state(now)
            t = sim.run_step(acts, now, busy)
            if key is not None:
                after = sim.state(t)
                seen[key] = (*(a - b for a, b in zip(after[:5], before[:5])), after[5] - before[0])
        now = [t0 + o for t0, (_, o) in zip(t, step)]
        sim.end_step()
        computed += step[0][0]
        marks.append((now[0], sim.exposed[0], sim.payload))
        sent_marks.append(sim.sent)
    if include_finish:
        now = sim.run_step(trace.finish, now, [0.0] * sim.workers)
    return Timeline(
        now[0],
        sim.exposed[0],
        computed,
        len(trace.steps),
        sim.payload,
        sim.held,
        sim.events,
        marks,
        sent_marks,
        sim.sent,
    )
