"""The stall watchdog: a step that makes no progress ends the run in one line, even on every rank at once.

A rank that hangs alone is caught by its peers: their next collective times out after --peer-timeout.
When every rank hangs at once (a data loader that never returns, or a forward that never does, on every
rank) no rank waits in a collective and nothing times out. So each rank watches its own loop: a thread
finds the data or compute part of a step (`loop.Phase`) under way past its bound, has `on_stall` write
the one line, and the process ends there (`os._exit` in `on_stall`: the stuck thread cannot be
interrupted).

The bound is BOUND_PEER_TIMEOUTS x --peer-timeout: the compute part holds DDP's gradient all-reduces,
each allowed --peer-timeout, and as much again is left for the work itself; a rank whose step really
takes longer is stopped by its peers' timeouts anyway wherever they meet it every step. The process's
first step gets FIRST_STEP_PEER_TIMEOUTS x: warm-up, the compilation of a torch.compile'd model. The
exchange (`sync.step()`) is left to its collectives' own timeouts, and evaluation and checkpoints,
which may take long, are not watched.
"""

from __future__ import annotations

import threading
import time
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .loop import Phase

BOUND_PEER_TIMEOUTS = 2
FIRST_STEP_PEER_TIMEOUTS = 10
DOING = MappingProxyType(
    {"data": "the workload's next_batch() has not returned", "compute": "the forward and backward have not returned"}
)


def bound_s(peer_timeout: float, first: bool) -> float:
    """How long a part of a step may last before the rank counts as hung."""
    return (FIRST_STEP_PEER_TIMEOUTS if first else BOUND_PEER_TIMEOUTS) * peer_timeout


def overdue(phase: "Phase", peer_timeout: float, rank: int, now: float) -> str | None:
    """The one line for a part of a step past its bound at `now` (time.monotonic()), else None."""
    part = phase.part
    if part is None:
        return None
    name, step, since, first = part
    bound, elapsed = bound_s(peer_timeout, first), now - since
    if elapsed <= bound:
        return None
    times = FIRST_STEP_PEER_TIMEOUTS if first else BOUND_PEER_TIMEOUTS
    return (
        f"rank {rank} stalled in step {step} ({name}): {DOING.get(name, 'it has not ended')} for "
        f"{elapsed:.0f} s, beyond {times} x --peer-timeout {peer_timeout:g} s (raise --peer-timeout if a "
        f"step's {name} can take that long)"
    )


class Watchdog:
    """A daemon thread that calls `on_stall(line)` once, when the phase is overdue (`overdue`);
    `stop()` makes sure it never will (a failure the worker reports itself is the only one)."""

    def __init__(self, phase: "Phase", peer_timeout: float, rank: int, on_stall: Callable[[str], None]):
        self.phase, self.peer_timeout, self.rank, self.on_stall = phase, peer_timeout, rank, on_stall
        self.poll_s = min(1.0, peer_timeout / 10)
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # a stall and a stop never both happen
        self._thread = threading.Thread(target=self._watch, name="wansync-stall-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            line = overdue(self.phase, self.peer_timeout, self.rank, time.monotonic())
            if line is None:
                continue
            with self._lock:
                if not self._stopped.is_set():
                    self.on_stall(line)
            return
