"""The Work objects an emulated process group hands its callers (`net.backend`): completed when the
modelled link says so, never earlier than the real collective, each with its `CollectiveRecord`."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch.distributed as dist
from torch.futures import Future

from wansync.net.emulator import Emulator, complete_short
from wansync.net.records import CollectiveRecord

__all__ = ["CallerWork", "EmulatedWork", "WAITS_ATTR", "blocked_on"]

# A helper thread's waits (`comm.site_mean`'s phases of an overlapped mean) are not the training
# thread's blocking: a thread that carries a list as `WAITS_ATTR` has the records it waited on
# appended there instead of counted as `waited`, and the training thread's own wait for that thread
# is spread over them (`blocked_on`).
WAITS_ATTR = "wansync_waits"


def _note_wait(rec: CollectiveRecord, seconds: float) -> None:
    background = getattr(threading.current_thread(), WAITS_ATTR, None)
    if background is None:
        rec.waited = (rec.waited or 0.0) + seconds
    else:
        background.append(rec)


def blocked_on(records: list[CollectiveRecord], t0: float, t1: float) -> None:
    """The training thread was blocked from t0 to t1 waiting for the collectives `records` (run one
    after the other by a helper thread): each is booked the part of it that fell in its own span."""
    for rec in records:
        end = rec.end if rec.end is not None else t1
        part = max(0.0, min(t1, end) - max(t0, rec.issue))
        rec.waited = (rec.waited or 0.0) + part


class EmulatedWork(dist.Work):
    """The Work handed to callers; ``wait()`` blocks until the modelled completion and is timed.

    ``wait(timeout)`` ignores its timeout: the wrapped backend's own timeout turns a dead peer into an
    error on the Future, which ``wait()`` raises.
    """

    def __init__(self, fut: Future, rec: CollectiveRecord, value: Any):
        super().__init__()
        self._fut, self._rec, self._value = fut, rec, value

    def wait(self, timeout: Any = None) -> bool:
        t0 = time.perf_counter()
        try:
            self._fut.wait()
        finally:
            _note_wait(self._rec, time.perf_counter() - t0)
        return True

    def get_future(self) -> Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done() and self._rec.error is None

    def exception(self) -> Any:
        return RuntimeError(self._rec.error) if self._rec.error else None

    def result(self) -> Any:
        return self._value

    def synchronize(self) -> None:
        pass

    @property
    def record(self) -> CollectiveRecord:
        return self._rec


class CallerWork(EmulatedWork):
    """A short transfer on an idle link (`Emulator.short`), completed by the thread that waits for it:
    the real work's wait, then the rest of the modelled time, with no thread hand-off (two of them,
    a fraction of a millisecond each on a busy machine, are most of what an emulated small collective
    costs beyond the real one). A caller that asks for its Future (DDP's comm hooks) gets one completed
    from the real work's callback instead, as every other short transfer is."""

    def __init__(self, work: Any, rec: CollectiveRecord, value: Any, emulator: Emulator):
        dist.Work.__init__(self)
        self._work, self._rec, self._value, self._emulator = work, rec, value, emulator
        self._fut: Future | None = None
        self._lock = threading.Lock()

    def wait(self, timeout: Any = None) -> bool:
        t0 = time.perf_counter()
        try:
            with self._lock:
                fut = self._fut
            fut.wait() if fut is not None else self._complete()
        finally:
            _note_wait(self._rec, time.perf_counter() - t0)
        return True

    def _complete(self) -> None:
        if self._rec.end is None:
            complete_short(self._rec, self._work.wait)
        elif self._rec.error:
            raise RuntimeError(self._rec.error)

    def get_future(self) -> Future:
        with self._lock:
            if self._fut is None:
                self._fut = Future()
                if self._rec.end is None:
                    self._emulator.complete_from_callback(self._work, self._rec, self._fut, self._value)
                elif self._rec.error:
                    self._fut.set_exception(RuntimeError(self._rec.error))
                else:
                    self._fut.set_result(self._value)
            return self._fut

    def is_completed(self) -> bool:
        return self._rec.end is not None or (self._fut is not None and self._fut.done())

    def is_success(self) -> bool:
        return self.is_completed() and self._rec.error is None
