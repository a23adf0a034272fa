"""One record per emulated collective, so profilers and reports can account time.

All times are ``time.perf_counter()`` seconds of the recording process (comparable within a
process only). ``waited`` is the time the caller spent blocked in ``Work.wait()``; it stays
``None`` when nobody called ``wait()`` on the Work (e.g. DDP's reducer waits on the Future in C++,
which the emulator cannot observe: measure that exposure around ``backward()`` instead).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["CollectiveRecord", "RecordLog", "summary"]


@dataclass
class CollectiveRecord:
    op: str
    nbytes: int
    group: str  # the process group's name ("0" is the default group)
    seq: int  # the collective's sequence number within its group (same on every rank)
    issue: float  # when the caller issued it
    start: float  # when it started on the link: after the previous transfer, once every member issued it
    modelled_s: float  # modelled duration, jitter included
    modelled_end: float  # start + modelled_s
    real_end: float | None = None  # when the wrapped backend finished
    end: float | None = None  # when the returned Work completed: max(real_end, modelled_end)
    waited: float | None = None  # seconds the caller blocked in Work.wait(); None if never called
    error: str | None = None
    ready: float | None = None  # when the last member had issued it and its link was free (None: not known)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RecordLog:
    """An emulator's records, oldest first. Collectives may be issued from any thread, so every
    access holds a lock; the records themselves are live objects the completer thread fills in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[CollectiveRecord] = []

    def add(self, record: CollectiveRecord) -> None:
        with self._lock:
            self._items.append(record)

    def all(self) -> list[CollectiveRecord]:
        """Every record (a copy of the list)."""
        with self._lock:
            return list(self._items)

    def since(self, cursor: int) -> list[CollectiveRecord]:
        """The records from index ``cursor`` on (a slice, not a copy of the whole growing list)."""
        with self._lock:
            return self._items[cursor:]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


def summary(recs: Sequence[CollectiveRecord]) -> dict[str, Any]:
    """Totals: count, bytes, modelled and waited seconds, and count/bytes per op."""
    per_op: dict[str, dict[str, float]] = {}
    for r in recs:
        d = per_op.setdefault(r.op, {"count": 0, "bytes": 0})
        d["count"] += 1
        d["bytes"] += r.nbytes
    return {
        "count": len(recs),
        "total_bytes": sum(r.nbytes for r in recs),
        "modelled_s": sum(r.modelled_s for r in recs),
        "waited_s": sum(r.waited or 0.0 for r in recs),
        "per_op": per_op,
    }
