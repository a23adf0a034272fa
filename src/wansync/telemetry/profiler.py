"""Time accounting whose categories add up to the wall clock by construction.

The training thread's time line is cut at every `lap(category)`: the interval since the
previous lap is charged to exactly one category, so the categories always sum to the
measured wall clock (the residual is only float rounding). Time measured *inside* an interval
is re-charged with `move`, which keeps the sum unchanged:

- `compute`: forward, backward, gradient clipping and the inner optimizer step (moved out of
  `sync.step()` with the strategy's `last_inner_s`);
- `exposed_comm`: the training thread blocked on a collective. For our strategies, the waits the
  comm ledger times (`Pending.wait()` → `CommLedger.on_wait`), moved out of `sync_math`. For DDP and
  DDP-wrapped strategies (ddp, cpdp, post_local_sgd), whose communication happens inside
  `forward()`/`backward()`, the part :class:`wansync.telemetry.commtime.CommTimer` measures with a
  timestamping comm hook around torch's default all-reduce hook (blocked from the moment the last
  bucket was issued, i.e. backward compute was done, until the last bucket completed) plus DDP's
  blocking buffer broadcast before forward, moved out of `compute`;
- `sync_math`: the rest of `sync.step()`: averaging, outer steps, compensation, flattening;
- `data`, `eval` (its collectives included), `checkpoint`, `other` (logging, start-up, the rest).

The report also measures the wall clock independently (`time.monotonic()` from the profiler's
start) and gives the residual against it; per-sync-event records and the derived figures come
from :mod:`wansync.telemetry.commtime` (see :func:`build_profile`).
"""

from __future__ import annotations

import time
from typing import Any

CATEGORIES = ("compute", "exposed_comm", "sync_math", "data", "eval", "checkpoint", "other")


class Profiler:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self._mono_start = time.monotonic()
        self._mark = self.start
        self.totals = dict.fromkeys(CATEGORIES, 0.0)

    def lap(self, category: str) -> float:
        """Charge the time since the last lap to `category`; returns that interval."""
        now = time.perf_counter()
        dt = now - self._mark
        self.totals[category] += dt
        self._mark = now
        return dt

    def move(self, src: str, dst: str, seconds: float) -> None:
        """Re-charge `seconds` (clamped to what `src` holds) from `src` to `dst`."""
        seconds = min(max(0.0, seconds), max(0.0, self.totals[src]))
        self.totals[src] -= seconds
        self.totals[dst] += seconds

    def restore(self, totals: dict[str, float]) -> None:
        """Continue a resumed run's accounts: earlier time is added, and so is the wall clock."""
        earlier = sum(totals.values())
        for k, v in totals.items():
            self.totals[k] += v
        self.start -= earlier

    def wall(self) -> float:
        return time.perf_counter() - self.start

    def report(self) -> dict[str, Any]:
        self.lap("other")
        measured = time.monotonic() - self._mono_start  # an independent clock for the residual
        total = sum(self.totals.values())
        return {
            "wall_clock_s": measured,
            "categories_s": dict(self.totals),
            "categories_pct": {k: 100.0 * v / measured if measured > 0 else 0.0 for k, v in self.totals.items()},
            "sum_s": total,
            "residual_s": measured - total,
            "residual_pct": 100.0 * (measured - total) / measured if measured > 0 else 0.0,
        }


def build_profile(
    prof: Profiler, comm: Any = None, *, steps: int = 0, epochs: float | None = None, wan: dict[str, Any] | None = None
) -> dict[str, Any]:
    """profile.json: categories (summing to the wall clock), derived figures, per-sync-event records.

    Derived: `compute_floor_s` (the wall clock minus exposed communication: this run with a free
    network), `exposed_comm_pct` of the wall clock, `hidden_comm_pct` (share of the measured
    communication time hidden behind compute), `bytes_per_step`, `sync_events`,
    `sync_events_per_epoch`.
    """
    out = prof.report()
    wall, cats = out["wall_clock_s"], out["categories_s"]
    out["wan"] = wan
    c = comm.summary(steps, epochs) if comm is not None else {}
    out["derived"] = {
        "steps": steps,
        "compute_floor_s": wall - cats["exposed_comm"],
        "exposed_comm_pct": 100.0 * cats["exposed_comm"] / wall if wall > 0 else 0.0,
        "hidden_comm_pct": c.get("hidden_pct"),
        "comm_measured_s": c.get("measured_s"),
        "comm_hidden_s": c.get("hidden_s"),
        "comm_modelled_s": c.get("modelled_s"),
        "comm_exposed_in_events_s": c.get("exposed_s"),
        "bytes_per_step": c.get("bytes_per_step"),
        "sync_events": c.get("events"),
        "sync_events_per_epoch": c.get("events_per_epoch"),
        "events_complete": c.get("complete"),
        "ddp_instrumented": c.get("ddp_instrumented"),
    }
    if c.get("ddp_uninstrumented"):
        out["derived"]["ddp_uninstrumented"] = c["ddp_uninstrumented"]
    out["events"] = comm.events() if comm is not None else []
    return out
