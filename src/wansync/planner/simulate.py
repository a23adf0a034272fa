"""The training thread's time line over a trace, on the emulator's cost model and FIFO link.

Each step: the backward takes `compute_s` (forward, backward, inner step); DDP's gradient buckets
are issued during it, bucket k when the gradients it holds are ready, assumed spread evenly over
the last `overlap` fraction of the compute (default 2/3: the backward's share); the thread then
waits for the last bucket. Then `step()`'s actions run in order: a blocking exchange is issued and
waited for at once, an overlapped fragment sync is issued at t_p and waited for τ steps later
(exposed by whatever of it is left then). The rest of the step (`other_s`: data, averaging, outer
steps) adds no communication.

The link is the emulator's: one transfer at a time per rank, in issue order (start = max(issue,
end of the previous transfer)), each taking `collective_duration` of the cost model. Jitter is
left out (the presets have none); so is the real backend's own time, which the emulator takes
when it is slower than the model (on a loaded CPU, for the fast presets).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..net.cost import collective_duration
from ..net.link import Link, Topology
from .schedule import Action, Trace, Transfer

DDP_OVERLAP = 2 / 3
#: Per worker, per step: (compute seconds, other seconds); see `simulate`.
StepTimes = tuple[tuple[tuple[float, float], ...], ...]
#: The link between the ranks of one worker (R > 1): an NVLink-class interconnect inside a node
#: (10 µs round trip, 400 GB/s per rank), not the emulator's in-site LAN.
WORKER_LINK = Link(rtt_s=10e-6, bandwidth_bps=3.2e12)


def transfer_seconds(topology: Topology, workers: int, ranks_per_worker: int = 1,
                     host_bytes_per_s: float | None = None) -> Callable[[Transfer], float]:
    """Modelled seconds of a transfer. With R ranks per worker (R > 1), the ranks of a worker talk
    over `WORKER_LINK`: an exchange between workers is local rank r of every worker carrying its
    shard B/R across (whole workers on their sites, the R groups at once sharing each site's uplink:
    the cost model's `parallel=R`), then an all-gather of B inside the worker; DDP's gradient
    all-reduce is the hierarchical one (reduce-scatter inside the worker, all-reduce of the shards
    between workers, all-gather inside); the DDP inside a worker (the other strategies) is an
    all-reduce over its R ranks. With R = 1 every transfer is the emulator's collective over the M
    workers.

    `host_bytes_per_s`: the emulator completes a collective at max(real, modelled); given the rate at
    which the real backend moves a buffer on the machine at hand, the real part is modelled as
    B / rate (for validating against emulated runs on a loaded CPU; None: the link model alone)."""
    in_site = Topology(sites=1, intra_link=WORKER_LINK, inter_link=WORKER_LINK)
    placed = replace(topology, ranks_per_worker=ranks_per_worker)
    world = workers * ranks_per_worker
    local_rank_0 = range(0, world, ranks_per_worker)  # one of the R groups between workers

    def seconds(x: Transfer) -> float:
        modelled = link_seconds(x)
        return modelled if host_bytes_per_s is None else max(modelled, x.nbytes / host_bytes_per_s)

    def link_seconds(x: Transfer) -> float:
        if x.purpose == "grads_in_worker":
            return collective_duration(x.op, x.nbytes, ranks_per_worker, in_site)
        if ranks_per_worker == 1:
            return collective_duration(x.op, x.nbytes, workers, placed)
        across = collective_duration(x.op, x.nbytes / ranks_per_worker, world, placed, local_rank_0,
                                     parallel=ranks_per_worker)
        gather = collective_duration("allgather", x.nbytes, ranks_per_worker, in_site)
        if x.between_workers:
            return across + gather
        return collective_duration("reduce_scatter", x.nbytes, ranks_per_worker, in_site) + across + gather
    return seconds


@dataclass
class Timeline:
    """What a trace costs: wall clock, exposed communication, bytes, and the most bytes in flight."""
    wall_s: float
    exposed_s: float
    compute_s: float
    steps: int
    payload_bytes: int
    peak_in_flight_bytes: int
    events: int
    marks: list[tuple[float, float, int]]     # after each step: (time, exposed so far, payload so far)

    def window(self, first: int) -> tuple[float, float, int]:
        """(seconds, exposed seconds, payload bytes) of steps first+1 .. the last."""
        t0, e0, b0 = self.marks[first - 1] if first > 0 else (0.0, 0.0, 0)
        t1, e1, b1 = self.marks[-1]
        return t1 - t0, e1 - e0, b1 - b0

    @property
    def exposed_pct(self) -> float:
        return 100.0 * self.exposed_s / self.wall_s if self.wall_s > 0 else 0.0


def simulate(trace: Trace, seconds: Callable[[Transfer], float], compute_s: float, other_s: float = 0.0,
             overlap: float = DDP_OVERLAP, include_finish: bool = False,
             step_times: StepTimes | None = None) -> Timeline:
    """Worker 0's time line. Identical workers (every step `compute_s`, then `other_s`) arrive at
    every exchange together; with `step_times` (per worker, per step: (compute, other), e.g. a
    measured run's, replayed cyclically), each worker runs its own time line and a transfer starts
    on the link when the last worker has issued it and its link is free, as on the emulator: an
    early worker waits for the straggler and then for the transfer."""
    times = step_times if step_times else (((compute_s, other_s),),)
    workers = len(times)
    now, link_free, exposed = [0.0] * workers, [0.0] * workers, [0.0] * workers
    ends: dict[int, float] = {}
    in_flight: dict[int, int] = {}
    peak, payload, events = 0, 0, 0

    def issue(x: Transfer, at: list[float]) -> None:
        nonlocal payload, events, peak
        start = max(max(a, f) for a, f in zip(at, link_free))
        end = start + seconds(x)
        link_free[:] = [end] * workers
        ends[id(x)] = end
        payload += x.payload
        events += 1
        if x.purpose == "pseudo_grads":
            in_flight[id(x)] = x.nbytes
            peak = max(peak, sum(in_flight.values()))

    def wait(x: Transfer, at: list[float]) -> list[float]:
        end = ends[id(x)]
        in_flight.pop(id(x), None)
        for w in range(workers):
            exposed[w] += max(0.0, end - at[w])
        return [max(a, end) for a in at]

    def run(actions: list[Action], start: list[float], busy: list[float]) -> list[float]:
        nonlocal payload
        backward = [a for a in actions if a.in_backward]
        issued = [a.transfer for a in backward if a.kind == "issue"]
        total = sum(x.nbytes for x in issued) or 1
        done = 0
        for x in issued:
            done += x.nbytes
            issue(x, [s0 + b * (1 - overlap) + b * overlap * done / total for s0, b in zip(start, busy)])
        t = [s0 + b for s0, b in zip(start, busy)]
        for a in backward:
            if a.kind == "wait":
                t = wait(a.transfer, t)
        for a in actions:
            if a.in_backward:
                continue
            if a.kind == "issue":
                issue(a.transfer, t)
            elif a.kind == "book":                 # carried by another collective: bytes only
                payload += a.transfer.payload
            else:
                t = wait(a.transfer, t)
        return t

    marks, computed = [], 0.0
    for i, acts in enumerate(trace.steps):
        step = [w[i % len(w)] for w in times]
        now = [t + o for t, (_, o) in zip(run(acts, now, [c for c, _ in step]), step)]
        computed += step[0][0]
        marks.append((now[0], exposed[0], payload))
    if include_finish:
        now = run(trace.finish, now, [0.0] * workers)
    return Timeline(now[0], exposed[0], computed, len(trace.steps), payload, peak, events, marks)
