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
from typing import Callable

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

    def seconds(x: Transfer, at_s: float = 0.0) -> float:
        modelled = link_seconds(x, at_s)
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
) -> Timeline:
    """Worker 0's time line. Identical workers (every step `compute_s`, then `other_s`) arrive at
    every exchange together; with `step_times` (per worker, per step: (compute, other), e.g. a
    measured run's, replayed cyclically), each worker runs its own time line and a transfer starts
    on the link when the last worker has issued it and its link is free, as on the emulator: an
    early worker waits for the straggler and then for the transfer."""
    times = step_times if step_times else (((compute_s, other_s),),)
    sim = Simulation(seconds, len(times), overlap)
    now = [0.0] * sim.workers
    marks, sent_marks, computed = [], [], 0.0
    for i, acts in enumerate(trace.steps):
        step = [w[i % len(w)] for w in times]
        now = [t + o for t, (_, o) in zip(sim.run_step(acts, now, [c for c, _ in step]), step)]
        sim.end_step()
        computed += step[0][0]
        marks.append((now[0], sim.exposed[0], sim.payload))
        sent_marks.append(sim.sent)
    if include_finish:
        now = sim.run_step(trace.finish, now, [0.0] * sim.workers)
    return Timeline(
        now[0], sim.exposed[0], computed, len(trace.steps), sim.payload, sim.held, sim.events, marks, sent_marks
    )
