"""The emulated network of one process: a topology, a jitter seed, one FIFO link and its records.

An :class:`Emulator` is what an emulated process group runs under. It is handed to torch as the
group's options, ``dist.init_process_group(net.install(), pg_options=Emulator(topology, seed))``,
and every group created with it (or with ``net.shared_uplink(copies)``, which carries it) shares
its link, so a rank has one network path whatever the group. The link carries one transfer at a time: a collective issued while another is in flight
starts when that one's modelled transfer ends, and one completer thread finishes the Futures in
issue order. A collective also starts no earlier than its last member issued it: no data can cross
before every rank has put its share on the wire, so a rank that arrives early waits for the
straggler *and* the transfer, and every member completes at the same modelled time, as on a real link.
"""

from __future__ import annotations

import atexit
import math
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from torch.futures import Future

from wansync.net.topology import Topology
from wansync.net.records import CollectiveRecord, RecordLog, summary

__all__ = ["Emulator", "SHORT_S", "complete_short"]

# A transfer modelled shorter than this is short. It starts at its rank's own issue: the MAX
# all-reduce that finds its latest member would cost more than the transfer (after the real
# collective on the same backend it added 0.45 ms; a 4-byte all-reduce took 0.75 ms emulated against
# 0.11 ms on a real link), and a straggler's wait overlapping a transfer this short errs by less than
# it. And on an idle link it completes from the real collective's own callback, not through the
# completer thread: two thread hand-offs less (0.1 to 0.3 ms on a loaded machine). Every member
# models the same duration, so all of them treat a collective alike.
SHORT_S = 1e-3


class _Link:
    """One transfer at a time, in issue order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0

    def reserve(self, issue: float, duration: float) -> float:
        with self._lock:
            start = max(issue, self._free_at)
            self._free_at = start + duration
            return start

    def hold_until(self, end: float) -> None:
        """A transfer ends later than reserved (it waited for its last member): later ones queue behind."""
        with self._lock:
            self._free_at = max(self._free_at, end)


class Arrival:
    """When the last member of a collective was ready to send: a MAX all-reduce of each member's
    start on its link (on a clock all ranks share), issued beside the collective on the real
    backend, so it costs one small message and no extra wait."""

    def __init__(self, work: Any, clock: Any, offset: float):
        self.work, self.clock, self.offset = work, clock, offset

    def start(self) -> float:
        """The latest member's start, on this process's perf_counter clock (the Work ends here)."""
        work, self.work = self.work, None
        work.wait()
        return float(self.clock[0]) - self.offset


def describe(exc: BaseException) -> str:
    """A failed collective's error, in one line, as its record keeps it."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


# A thread's sleep ends late: the kernel's timer slack (50 µs by default) and its wake-up, measured
# at 0.27 to 0.42 ms past the modelled end on this project's VM, on every collective. The emulator
# sleeps until this much before the end, then yields until it (never completing a transfer early).
WAKE_EARLY_S = 3e-4


def sleep_until(end: float) -> None:
    """Return at `end` (perf_counter seconds) or just after: a sleep to WAKE_EARLY_S before it,
    then short yields of the interpreter."""
    delay = end - time.perf_counter() - WAKE_EARLY_S
    if delay > 0:
        time.sleep(delay)
    while time.perf_counter() < end:
        time.sleep(0)


def complete_short(rec: CollectiveRecord, wait_real: Any) -> None:
    """A short transfer (SHORT_S) on an idle link, once its real collective is done (`wait_real`
    returns then, or raises what it raised: recorded, then raised): held until its modelled end."""
    try:
        wait_real()
    except Exception as exc:
        rec.error, rec.end = describe(exc), time.perf_counter()
        raise
    rec.real_end = time.perf_counter()
    sleep_until(rec.modelled_end)
    rec.end = time.perf_counter()


# A thread that completes a caller's Future is still on its way out of Python afterwards, while the caller
# may already be at the interpreter's exit. A thread that takes the GIL once the interpreter finalizes is
# ended by a forced unwind, and a C++ destructor on its way turns that into std::terminate (SIGABRT,
# "terminate called without an active exception", seen at a rank's exit on a loaded machine): a c10d Work's
# (it lets the GIL go while it ends, then takes it back) and torch's guard of a Python callback (it takes
# the GIL from gloo's thread once the callback returned). So a job lets go of its Works before it completes
# the caller's Future, and the exit waits for gloo's threads that ran one of our callbacks to be out of it,
# and EXIT_GRACE_S more for the guard's destructor (`_Callbacks`).
EXIT_GRACE_S = 0.2


class _Callbacks:
    """An emulator's callbacks running in gloo's threads: how many, and when the last one ended; at the
    interpreter's exit (atexit: before it finalizes) `out` waits for them (EXIT_GRACE_S)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._ended = -math.inf
        atexit.register(_out_at_exit, weakref.ref(self))

    def enter(self) -> None:
        with self._lock:
            self._running += 1

    def leave(self) -> None:
        with self._lock:
            self._running -= 1
            self._ended = time.perf_counter()

    def out(self, bound_s: float = 2.0) -> None:
        """Return once none runs and none ended in the last EXIT_GRACE_S, or after `bound_s`."""
        deadline = time.perf_counter() + bound_s
        while time.perf_counter() < deadline:
            with self._lock:
                if self._running == 0 and time.perf_counter() - self._ended >= EXIT_GRACE_S:
                    return
            time.sleep(0.005)


def _out_at_exit(callbacks: weakref.ref) -> None:
    alive = callbacks()
    if alive is not None:
        alive.out()


def _wait_real(works: list[Any], cuda: bool) -> None:
    """Wait for each real work, emptying `works`: the Works end in this frame (see EXIT_GRACE_S)."""
    while works:
        w = works.pop(0)
        if cuda:  # NCCL's wait() only orders streams; poll for the host-side truth
            while not w.is_completed():
                time.sleep(2e-4)
            if w.exception() is not None:
                raise w.exception()
        else:
            w.wait()


def _released(exc: BaseException) -> BaseException:
    """`exc` with its traceback's frames cleared of their locals (a Work among them), before it reaches
    the caller's thread."""
    traceback.clear_frames(exc.__traceback__)
    return exc


class _Job:
    """Wait for the real collective, then until the modelled end; complete the caller's Future."""

    def __init__(
        self,
        works: list[Any],
        rec: CollectiveRecord,
        fut: Future,
        value: Any,
        cuda: bool,
        timeout: float | None,
        link: _Link,
        arrival: Arrival | None,
        varies: Callable[[float], float] | None = None,
    ):
        self.works, self.rec, self.fut, self.value, self.cuda = works, rec, fut, value, cuda
        self.timeout, self.link, self.arrival, self.varies = timeout, link, arrival, varies

    def run_on_completion(self, work: Any, callbacks: _Callbacks) -> None:
        """A short transfer on an idle link: complete the Future from the real work's own callback,
        at max(real end, modelled end), without the completer thread (counted in `callbacks`)."""

        def done(real: Future) -> None:
            callbacks.enter()
            try:
                try:
                    complete_short(self.rec, real.value)
                except Exception as exc:  # a dead peer: the caller must see it, not hang
                    self.fut.set_exception(_released(exc))
                    return
                self.fut.set_result(self.value)
            finally:
                callbacks.leave()

        work.get_future().then(done)
        self.works = []  # the issuing thread lets go of the Work (see EXIT_GRACE_S)

    def run(self, link_end: float) -> float:
        """Complete the Future; `link_end` is when the transfer before it really ended on this
        rank's link (later than reserved if that one waited for a member). Returns this one's end."""
        rec = self.rec
        arrival, self.arrival = self.arrival, None
        try:
            _wait_real(self.works, self.cuda)
            rec.real_end = time.perf_counter()
            start = max(rec.start, link_end)
            if arrival is not None:
                rec.ready = arrival.start()
                start = max(start, rec.ready)
            modelled = self.varies(start) if self.varies is not None else rec.modelled_s  # links that change:
            if start > rec.start or modelled != rec.modelled_s:  # at the agreed start
                rec.start, rec.modelled_s, rec.modelled_end = start, modelled, start + modelled
                self.link.hold_until(rec.modelled_end)
            delay = rec.modelled_end - rec.real_end
            if self.timeout is not None and delay > self.timeout:
                raise TimeoutError(
                    f"the emulated link would hold this {rec.op} for {delay:.3g} s more, beyond "
                    f"the peer timeout of {self.timeout:g} s"
                )
            sleep_until(rec.modelled_end)
        except Exception as exc:  # a dead peer, a timeout: the caller must see it, not hang
            rec.error = describe(exc)
            rec.end = time.perf_counter()
            self.works.clear()
            self.fut.set_exception(_released(exc))
            return rec.modelled_end
        rec.end = time.perf_counter()
        self.fut.set_result(self.value)
        return rec.modelled_end


class _Completer:
    """A daemon thread that completes Futures in issue order (the FIFO link), started on first use."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending = 0  # jobs submitted and not yet completed

    def submit(self, job: _Job) -> None:
        with self._lock:
            self._pending += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="wansync-link", daemon=True)
                self._thread.start()
        self._q.put(job)

    def idle(self) -> bool:
        """No job waits or runs: a new one cannot complete out of issue order."""
        with self._lock:
            return self._pending == 0

    def _run(self) -> None:
        link_end = 0.0
        while True:
            link_end = self._q.get().run(link_end)
            with self._lock:
                self._pending -= 1


class Emulator:
    """A modelled network for the groups created with it.

    Args:
        topology: the links (see :func:`wansync.net.parse_wan` for the ``--wan`` strings).
        seed: shared by all ranks; with a collective's sequence number it draws the jitter, so
            every rank models the same duration.
        timeout: the longest a collective may wait for the link (seconds; None: no bound). A
            longer modelled wait fails the collective at once instead of stalling the run.
    """

    def __init__(self, topology: Topology, seed: int = 0, timeout: float | None = None) -> None:
        if not isinstance(topology, Topology):
            raise TypeError(f"Emulator needs a Topology (parse a --wan string with parse_wan), got {topology!r}")
        self.topology = topology
        self.seed = int(seed)
        self.timeout = timeout
        self._link = _Link()
        self._completer = _Completer()
        self._callbacks = _Callbacks()
        self._log = RecordLog()
        # perf_counter + this is the wall clock: the clock ranks on different hosts share (to NTP's accuracy)
        self.clock_offset = time.time() - time.perf_counter()
        self._origin = time.perf_counter()  # run time 0 (perf_counter), until the ranks agree on one

    def agree_origin(self, origin: float) -> None:
        """The run's time 0 on this process's perf_counter, agreed by every rank when the default group
        is made (`backend`): the time link schedules count from."""
        self._origin = origin

    def run_time(self, at: float) -> float:
        """Seconds since the run's time 0 of the perf_counter time `at`: what link schedules read."""
        return at - self._origin

    def __repr__(self) -> str:
        return f"Emulator({self.topology.describe()}, seed={self.seed})"

    # ---- used by the emulated process group -------------------------------------------------
    def reserve(self, issue: float, duration: float) -> float:
        """When a transfer issued at ``issue`` starts on the link (after the one before it)."""
        return self._link.reserve(issue, duration)

    def schedule(
        self,
        works: list[Any],
        rec: CollectiveRecord,
        fut: Future,
        value: Any,
        cuda: bool,
        arrival: Arrival | None = None,
        varies: Callable[[float], float] | None = None,
    ) -> None:
        """Record a collective and complete ``fut`` with ``value`` at max(real end, modelled end),
        the modelled transfer starting once ``arrival`` (when given) says every member was ready;
        ``varies`` (links that change over the run) gives its duration for the start it gets. A
        short one on an idle link completes from the real work's callback (SHORT_S)."""
        self._log.add(rec)
        job = _Job(works, rec, fut, value, cuda, self.timeout, self._link, arrival, varies)
        if self.short(works, rec, cuda, arrival):
            job.run_on_completion(works[0], self._callbacks)
        else:
            self._completer.submit(job)

    def short(self, works: list[Any], rec: CollectiveRecord, cuda: bool, arrival: Arrival | None) -> bool:
        """A short transfer (SHORT_S) on an idle link, starting at its own issue: it may complete
        without the completer thread, from the real work (`schedule`, `complete_in_caller`)."""
        return arrival is None and rec.modelled_s < SHORT_S and len(works) == 1 and not cuda and self._completer.idle()

    def record_message(self, rec: CollectiveRecord) -> None:
        """A point-to-point message on this rank's link (`comm.p2p`: a learner's contribution, a syncer's
        version), recorded as a collective is, so that the profiler books its bytes and modelled time."""
        self._log.add(rec)

    def complete_in_caller(self, rec: CollectiveRecord) -> None:
        """Record a short transfer that the thread waiting for it completes itself (`backend.CallerWork`)."""
        self._log.add(rec)

    def complete_from_callback(self, work: Any, rec: CollectiveRecord, fut: Future, value: Any) -> None:
        """Complete `fut` with `value` from the real `work`'s callback, at max(real end, modelled end)."""
        job = _Job([work], rec, fut, value, False, self.timeout, self._link, None)
        job.run_on_completion(work, self._callbacks)

    # ---- records ----------------------------------------------------------------------------
    def records(self) -> list[CollectiveRecord]:
        """Every collective so far, oldest first (a copy of the list; the records are live)."""
        return self._log.all()

    def record_count(self) -> int:
        return len(self._log)

    def records_since(self, cursor: int) -> list[CollectiveRecord]:
        """The records from index ``cursor`` on: read incrementally with ``cursor += len(new)``."""
        return self._log.since(cursor)

    def reset_records(self) -> None:
        """Forget every record (e.g. between benchmark phases)."""
        self._log.clear()

    def summary(self) -> dict[str, Any]:
        """Totals: count, bytes, modelled and waited seconds, and count/bytes per op."""
        return summary(self._log.all())
