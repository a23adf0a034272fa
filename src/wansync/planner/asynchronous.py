"""An asynchronous run (`async_diloco`) for `wansync plan`: learners on their own clocks and a syncer
that merges whoever arrived, simulated event by event on the emulator's cost model (what a plan prints
of it: `prediction.AsyncPrediction`).

Why not `simulate.py`: it walks one timetable every worker shares, and every exchange there meets all
of them; an asynchronous learner meets nobody (`AsyncTimetable.exchanges_at` is False). What is
simulated instead is what `strategies/async_diloco.py` (the learner), `strategies/syncer_service.py`
(the syncer's protocol) and `strategies/syncer.py` (when it merges) do, with each message timed as
`comm/p2p.py` times it under the emulator:

- learner m computes rounds of H steps at its own step times (`prediction.workers_times`: the
  topology's worker speeds, or a run's replayed step times; else every learner at the step time);
- at a round's end it sends its contribution in a sealed message: the codec's wire bytes of the model's
  sync tensors, or with `sparse` the sparse payload of its trainable tensors plus its float buffers in
  fp32 (the strategy's own `wire_codec`, as the other strategies' payloads are sized; `contribution_bytes`), to the syncer in global rank 0's process: `net.cost`'s send over the pair (its rank,
  0), reserved on its own link after whatever it sent before (the emulator's `reserve`); learner 0's
  messages to the syncer, and the syncer's to it, take no time;
- the syncer drops a contribution more than `max_staleness` versions old and keeps it for the next
  merge otherwise (`Syncer.add`: a learner answered at once may send its next round before that
  merge, and both are merged), and answers at once when it has a version newer than the
  contribution's base (or dropped it), else at the merge that publishes one;
- a merge is due when every learner not yet final has a contribution pending, or once
  min(q, those learners) have and the grace window since that quorum came in has passed
  (`Syncer.due`); it takes no time here (an outer step over the model, not modelled) and answers
  every waiting learner, in learner order, each reply the whole model in fp32 reserved on rank 0's
  link after the replies before it;
- a learner waits from sending until its reply is delivered (its exposed communication), then starts
  its next round from the version it took; once the syncer has merged learners × steps learner steps
  every reply says stop, the learner sends its final (the steps since its round, none: it stops at a
  round's end), and once every learner has, the syncer merges what is pending and sends the last
  version to each of them. The wall clock ends when the last one has it.

Left out, as for the other strategies: start-up (the initial broadcast, connecting), evaluation and
jitter; also the real transfer's own time (the emulator delivers a message at the later of TCP's
arrival and the modelled one: on a loopback the modelled one).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from ..comm.p2p import ENVELOPE
from ..comm.sparse import is_sparse
from ..errors import ConfigError
from ..net.cost import collective_duration

#: Bytes a message adds around its tensor, as `comm.p2p` models them (the sealed preamble, JSON header and
#: HMAC tag, about): a contribution's, a version's, a final's or a last reply's without values.
ENVELOPE_BYTES = ENVELOPE
#: Rounds the simulation walks at most (each a handful of events): beyond, refused in one line.
MAX_ROUNDS = 2_000_000
EPS = 1e-12  # a grace window's end, met by the timer set for it (float rounding aside)


def contribution_bytes(s: Any) -> int:
    """A round's payload as the learner books it (`AsyncDiLoCo._exchange`) for setting `s`: θ_m in fp32,
    its change through a lossy codec, or the sparse payload of the trainable tensors (SparseLoCo's, sized
    by the strategy's `wire_codec` as every strategy's payload is) plus the float buffers in fp32."""
    from ..strategies import make_options, strategy_class

    numel = s.size.sync_numel
    shapes = s.size.shapes or [(n,) for n in s.size.grad_numels]
    codec = strategy_class(s.strategy).wire_codec(make_options(s.strategy, **s.options), shapes)
    if is_sparse(codec):
        return codec.wire_bytes() + 4 * (numel - codec.layout.numel)
    return 4 * numel if codec.name == "fp32" else codec.wire_bytes(numel)


def is_asynchronous(strategy: str) -> bool:
    """Does the strategy run learners on their own clocks (`Strategy.lock_step` False)?"""
    from ..strategies import strategy_class

    return not getattr(strategy_class(strategy), "lock_step", True)


class Clock:
    """A learner's step times (compute plus the rest of a step), replayed cyclically."""

    def __init__(self, steps: tuple[float, ...]):
        self.cycle = steps
        self.sums = (0.0, *accumulate(steps))

    def seconds(self, first: int, n: int) -> float:
        """Seconds of steps first+1 .. first+n."""
        k, total = len(self.cycle), self.sums[-1]
        whole, a = divmod(first, k)
        end_whole, b = divmod(first + n, k)
        return (end_whole - whole) * total + self.sums[b] - self.sums[a]


@dataclass
class Learner:
    """What one learner did: its intervals of compute and of waiting for a version, its messages."""

    computing: list[tuple[float, float]] = field(default_factory=list)
    waiting: list[tuple[float, float]] = field(default_factory=list)
    sent: list[tuple[float, int]] = field(default_factory=list)  # (when, its payload: what its ledger books)
    received: list[tuple[float, int]] = field(default_factory=list)  # (when, the version's bytes)
    steps: int = 0  # computed
    end: float = 0.0  # when it holds the last version


@dataclass(frozen=True)
class Merge:
    at: float
    version: int
    staleness: tuple[int, ...]  # of each contribution in it
    merged_steps: int  # learner steps merged so far, this one's included


@dataclass(frozen=True)
class Figures:
    """What a prediction reports of a stretch of the run: a learner is always computing or waiting."""

    seconds: float  # the stretch's wall clock
    steps: float  # run steps merged in it (learner steps / learners)
    utilization_pct: list[float]  # each learner's compute share of its own wall clock
    learners_utilization_pct: float  # every learner's compute over every learner's wall clock
    exposed_pct: float  # every learner's wait for a version over every learner's wall clock
    bytes: list[tuple[int, int]]  # each learner's (sent, received): its contributions' payloads, what its
    # ledger books (`pseudo_grads`), and the versions it took (its sync events' `received_bytes`)


@dataclass
class AsyncRun:
    """A simulated asynchronous run of `run_steps` steps (learners × run_steps learner steps merged)."""

    learners: list[Learner]
    merges: list[Merge]
    run_steps: int
    dropped_steps: int = 0  # too stale to merge (`Syncer.add`)
    syncer_busy: list[tuple[float, float]] = field(default_factory=list)  # a merge, to its last reply's end

    @property
    def wall_s(self) -> float:
        return max(x.end for x in self.learners)

    @property
    def computed_steps(self) -> int:
        return sum(x.steps for x in self.learners)

    @property
    def merged_steps(self) -> int:
        return self.merges[-1].merged_steps if self.merges else 0

    @property
    def goodput(self) -> float:
        """Tokens merged / tokens computed (every learner's batch is the same: steps stand for tokens)."""
        return self.merged_steps / self.computed_steps if self.computed_steps else 1.0

    def staleness_shares(self) -> dict[int, float]:
        """Share of the merged contributions at each staleness."""
        all_ = [t for m in self.merges for t in m.staleness]
        return {t: all_.count(t) / len(all_) for t in sorted(set(all_))}

    def syncer_idle(self) -> float:
        """Share of the wall clock the syncer neither merged nor sent versions from its merges (the
        service's `busy_s`: a reply sent at once, by the learner's connection, is not its time)."""
        busy, until = 0.0, 0.0
        for a, b in sorted(self.syncer_busy):
            busy += max(0.0, b - max(a, until))
            until = max(until, b)
        return max(0.0, 1.0 - busy / self.wall_s) if self.wall_s > 0 else 1.0

    def figures(self, whole: bool) -> Figures:
        """The figures of the whole run, or of its steady state (`window`)."""
        a, b, steps = (0.0, self.wall_s, float(self.run_steps)) if whole else self.window()
        spans = [(0.0, x.end) if whole else (a, b) for x in self.learners]
        total = sum(y - x for x, y in spans)
        busy = [overlap(x.computing, *span) for x, span in zip(self.learners, spans)]
        waited = sum(overlap(x.waiting, *span) for x, span in zip(self.learners, spans))

        def inside(t: float) -> bool:
            return whole or a < t <= b

        return Figures(
            b - a,
            steps,
            [100.0 * c / (y - x) if y > x else 100.0 for c, (x, y) in zip(busy, spans)],
            100.0 * sum(busy) / total if total > 0 else 100.0,
            100.0 * waited / total if total > 0 else 0.0,
            [
                (sum(n for t, n in x.sent if inside(t)), sum(n for t, n in x.received if inside(t)))
                for x in self.learners
            ],
        )

    def window(self) -> tuple[float, float, float]:
        """The steady state's (start, end, run steps merged in it): from the first merge at a quarter
        of the budget to the first at three quarters, neither the start nor the end (the run is
        `prediction.STEADY_ROUNDS` rounds long); the whole run when they are one."""
        budget = len(self.learners) * self.run_steps
        first = next(m for m in self.merges if m.merged_steps >= budget / 4)
        last = next((m for m in self.merges if m.merged_steps >= 3 * budget / 4), self.merges[-1])
        if last.at > first.at:
            return first.at, last.at, (last.merged_steps - first.merged_steps) / len(self.learners)
        return 0.0, self.wall_s, self.merged_steps / len(self.learners)


def overlap(spans: list[tuple[float, float]], a: float, b: float) -> float:
    """Seconds of `spans` inside [a, b]."""
    return sum(max(0.0, min(y, b) - max(x, a)) for x, y in spans)


class Simulation:
    """The learners, the syncer and the links between them; `run()` walks the events in time order."""

    def __init__(self, s: Any, run_steps: int, times: Any):
        o, self.s, self.m = s.options, s, s.workers
        self.h, self.quorum, self.grace = int(o["sync_every"]), int(o["merge_quorum"]), float(o["grace"])
        self.bound, self.budget = int(o["max_staleness"]), s.workers * run_steps
        self.payload = contribution_bytes(s)  # θ_m, its change encoded, or the sparse payload
        self.version_bytes = 4 * s.size.sync_numel  # θ̃ in fp32, the sync event's `received_bytes`
        per_step = s.step_s + s.other_s
        self.clocks = [
            Clock(tuple(c + r for c, r in times[w]) if times is not None else (per_step,)) for w in range(self.m)
        ]
        self.out = AsyncRun([Learner() for _ in range(self.m)], [], run_steps)
        self.events: list[tuple[float, int, str, int, tuple]] = []
        self.seq = 0
        self.link_free = [0.0] * self.m  # each rank's emulated link: FIFO
        self.known: dict[tuple[int, int, int], float] = {}
        # the learners' state
        self.base = [0] * self.m
        self.round_h = [self.h] * self.m  # each learner's round (`dynamic_h`: H × its speed / the fastest's)
        self.own_s = [0.0] * self.m  # its last round's seconds per step
        self.dynamic = bool(o.get("dynamic_h", False))
        self.speeds: dict[int, float] = {}  # the syncer's: each learner's seconds per step, as it was told
        self.sent_at = [0.0] * self.m
        # the syncer's
        self.version = 0
        self.pending: list[tuple[int, int, int]] = []  # (learner, base, steps)
        self.waiting: dict[int, int] = {}  # learner -> the base it waits for a newer version than
        self.finals: set[int] = set()
        self.quorum_since: float | None = None
        self.wake_at: float | None = None
        self.merged = 0

    # ---- the links ---------------------------------------------------------------------------
    def seconds(self, src: int, dst: int, nbytes: int, at: float) -> float:
        """`comm.p2p.LinkModel`: a send between the two ranks (none within rank 0's process)."""
        if src == dst:
            return 0.0
        topology = self.s.topology
        if topology.varies:
            return collective_duration("send", nbytes, self.m, topology, [src, dst], 1, at)
        key = (src, dst, nbytes)
        if key not in self.known:
            self.known[key] = collective_duration("send", nbytes, self.m, topology, [src, dst], 1)
        return self.known[key]

    def transfer(self, src: int, dst: int, nbytes: int, at: float) -> float:
        """When a message from `src` issued at `at` is delivered: reserved on src's link after the last."""
        d = self.seconds(src, dst, nbytes, at)
        if d == 0.0:
            return at
        start = max(at, self.link_free[src])
        self.link_free[src] = start + d
        return start + d

    def push(self, at: float, kind: str, who: int, data: tuple = ()) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, who, data))

    # ---- a learner -----------------------------------------------------------------------------
    def start_round(self, m: int, at: float) -> None:
        x, n = self.out.learners[m], self.round_h[m]
        end = at + self.clocks[m].seconds(x.steps, n)
        x.computing.append((at, end))
        x.steps += n
        self.own_s[m] = (end - at) / n  # what its contribution tells the syncer of its speed
        self.send(m, end, n, final=False)

    def send(self, m: int, at: float, steps: int, final: bool) -> None:
        payload = self.payload if steps else 0
        self.out.learners[m].sent.append((at, payload))
        self.sent_at[m] = at
        arrives = self.transfer(m, 0, ENVELOPE_BYTES + payload, at)
        self.push(arrives, "contribution", m, (self.base[m], steps, final, self.own_s[m]))

    def take(self, m: int, now: float, version: int, stop: bool, final: bool, nbytes: int, fastest: float) -> None:
        """Learner m receives a version: its wait ends; then its next round, its final, or its end."""
        x = self.out.learners[m]
        x.waiting.append((self.sent_at[m], now))
        x.received.append((now, nbytes))
        self.base[m] = version
        if self.dynamic and fastest and self.own_s[m]:  # `AsyncDiLoCo._retime`
            self.round_h[m] = max(1, round(self.h * fastest / self.own_s[m]))
        if final:
            x.end = now
        elif stop:
            self.send(m, now, 0, final=True)  # it stops at a round's end: no steps since
        else:
            self.start_round(m, now)

    # ---- the syncer ----------------------------------------------------------------------------
    def reply(self, m: int, now: float, final: bool = False) -> float:
        """The newest version to learner m (`SyncerService._version_message`), on rank 0's link; the
        run's last reply carries no values to a learner that holds that version already."""
        stop = self.merged >= self.budget
        nbytes = 0 if final and self.base[m] == self.version else self.version_bytes
        delivered = self.transfer(0, m, ENVELOPE_BYTES + nbytes, now)
        fastest = min(self.speeds.values(), default=0.0)
        self.push(delivered, "version", m, (self.version, stop, final, nbytes, fastest))
        return delivered

    def contribution(self, m: int, now: float, base: int, steps: int, final: bool, step_s: float) -> None:
        """`SyncerService._contribution`."""
        kept = True
        if steps and step_s > 0:
            self.speeds[m] = step_s
        if steps:
            if self.version - base > self.bound:
                self.out.dropped_steps += steps
                kept = False
            else:
                self.pending.append((m, base, steps))
        if final:
            self.finals.add(m)
            self.waiting.pop(m, None)
        elif not kept or self.version > base:
            self.reply(m, now)
        else:
            self.waiting[m] = base
        self.merge_loop(now)

    def due(self, now: float, alive: int) -> bool:
        """`Syncer.due`: the quorum counts learners, not contributions."""
        n = len({m for m, _, _ in self.pending})
        if n == 0:
            return False
        if n >= alive:
            return True
        if n < min(self.quorum, alive):
            self.quorum_since = None
            return False
        if self.quorum_since is None:
            self.quorum_since = now
        return now - self.quorum_since >= self.grace - EPS

    def merge_loop(self, now: float) -> None:
        """`SyncerService._merge_loop`, woken at `now`."""
        ending = len(self.finals) == self.m
        if not (ending or self.due(now, self.m - len(self.finals))):
            if self.quorum_since is not None and not math.isinf(self.grace):
                at = self.quorum_since + self.grace
                if self.wake_at != at:
                    self.wake_at = at
                    self.push(at, "wake", -1)
            return
        if self.pending:
            staleness = tuple(self.version - b for _, b, _ in sorted(self.pending))
            self.merged += sum(n for _, _, n in self.pending)
            self.version += 1
            self.pending, self.quorum_since = [], None
            self.out.merges.append(Merge(now, self.version, staleness, self.merged))
        sent = [now]
        if ending:
            sent += [self.reply(m, now, final=True) for m in range(self.m)]
            self.finals = set()
        else:
            for m, base in sorted(self.waiting.items()):
                if base < self.version:
                    sent.append(self.reply(m, now))
                    del self.waiting[m]
        self.out.syncer_busy.append((now, max(sent)))

    def run(self) -> AsyncRun:
        for m in range(self.m):
            self.start_round(m, 0.0)
        limit = 64 * (self.budget // self.h + self.m) + 1024  # events: a few per round; more is a bug
        while self.events:
            limit -= 1
            if limit < 0:
                raise RuntimeError("the asynchronous run's simulation did not end (a bug in planner/asynchronous.py)")
            now, _, kind, who, data = heapq.heappop(self.events)
            if kind == "contribution":
                self.contribution(who, now, *data)
            elif kind == "version":
                self.take(who, now, *data)
            elif now == self.wake_at:  # a timer not overtaken by a merge or a later quorum
                self.wake_at = None
                self.merge_loop(now)
        return self.out


def simulate_async(s: Any, run_steps: int, times: Any = None) -> AsyncRun:
    """The run of `run_steps` steps of setting `s` (`prediction.Setting`; the module docstring), one line
    when it cannot be predicted. `times`: each learner's (compute, other) per step, cycled
    (`prediction.workers_times`); None: every learner at `s.step_s + s.other_s`."""
    o = s.options
    if s.ranks_per_worker != 1:
        raise ConfigError(
            f"async_diloco runs one rank per learner: --ranks-per-worker {s.ranks_per_worker} is not supported"
        )
    if o["merge_quorum"] > s.workers:
        raise ConfigError(
            f"async_diloco: merge_quorum {o['merge_quorum']} is more than the {s.workers} learners of the run"
        )
    rounds = math.ceil(s.workers * run_steps / o["sync_every"])
    if rounds > MAX_ROUNDS:
        raise ConfigError(
            f"the planner simulates each learner's rounds: about {rounds:,.0f} here ({s.workers} learners x "
            f"{run_steps:,} steps / sync_every {o['sync_every']}), at most {MAX_ROUNDS:,}; plan a shorter run or a longer period"
        )
    return Simulation(s, run_steps, times).run()
