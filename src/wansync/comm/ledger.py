"""The counters of a strategy's communication: calls, bytes and blocked time by purpose.

The ledger is what tests count ("a CPDP boundary exchanges the gradients once and the
parameters once") and what the profiler reads for exposed communication. Purposes name *why*
bytes moved: `params`, `grads`, `pseudo_grads`, `optim_state`, `telemetry`, ... The exchanges
themselves (`exchange.Exchange`) and DDP's gradient phase book here. Traffic that stays inside a
worker of several ranks (its DDP gradients, the all-gather of a sharded exchange) is booked under
`inside/<purpose>`: it never crosses the wide-area link, so `bytes` leaves it out.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

INSIDE = "inside/"  # purpose prefix of the traffic inside a worker (it never crosses the wide-area link)


@dataclass
class CommTotals:
    calls: int = 0
    bytes: int = 0  # the payload: what one rank contributes (the buffer, encoded)
    waited_s: float = 0.0
    sent: int = 0  # what this rank put on the wire to move it: by the collective's algorithm
    parts: dict[str, int] = field(default_factory=dict)  # a sparse payload's bytes by kind (`comm.sparse`)
    algorithm: str = ""  # how its all-reduces between workers ran: flat | hierarchical (`comm.site_mean`)


@dataclass
class CommLedger:
    """Per-strategy counters by purpose, plus listeners notified of every wait."""

    totals: dict[str, CommTotals] = field(default_factory=lambda: defaultdict(CommTotals))
    on_wait: list[Callable[[str, float], None]] = field(default_factory=list)
    dropped: int = 0  # exchanges this worker sat out (non-finite, policy skip)

    def count(
        self, purpose: str, nbytes: int, calls: int = 1, sent: int | None = None, parts: dict[str, int] | None = None
    ) -> None:
        """Book one exchange's bytes: its payload `nbytes`, and what this rank transmitted to move it
        (`sent`: a ring all-reduce sends about 2(M−1)/M of its buffer, an all-gather (M−1) payloads;
        default the payload). `calls=0` for bytes riding on another purpose's exchange. `parts`: the
        payload's bytes by kind (a sparse payload's indices, values and tables), summing to `nbytes`."""
        t = self.totals[purpose]
        t.calls += calls
        t.bytes += nbytes
        t.sent += nbytes if sent is None else sent
        for kind, n in (parts or {}).items():
            t.parts[kind] = t.parts.get(kind, 0) + n

    def ran(self, purpose: str, algorithm: str) -> None:
        """Book how an all-reduce of `purpose` between workers ran (both, joined by "+", when it varied)."""
        t = self.totals[purpose]
        if algorithm not in t.algorithm.split("+"):
            t.algorithm = "+".join(filter(None, (t.algorithm, algorithm)))

    def waited(self, purpose: str, seconds: float) -> None:
        self.totals[purpose].waited_s += seconds
        for fn in self.on_wait:
            fn(purpose, seconds)

    @property
    def bytes(self) -> int:
        """Bytes this rank sent between workers for training (not the one-off initial broadcast,
        not the traffic inside its worker)."""
        return sum(t.bytes for k, t in self.totals.items() if k != "init" and not k.startswith(INSIDE))

    @property
    def sent_bytes(self) -> int:
        """What this rank transmitted between workers to move `bytes` (the collectives' own traffic)."""
        return sum(t.sent for k, t in self.totals.items() if k != "init" and not k.startswith(INSIDE))

    @property
    def inside_bytes(self) -> int:
        """Bytes this rank sent to the other ranks of its worker."""
        return sum(t.bytes for k, t in self.totals.items() if k.startswith(INSIDE))

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {
            k: {
                "calls": v.calls,
                "bytes": v.bytes,
                "waited_s": v.waited_s,
                "sent": v.sent,
                **({"parts": dict(v.parts)} if v.parts else {}),
                **({"algorithm": v.algorithm} if v.algorithm else {}),
            }
            for k, v in self.totals.items()
        }

    def restore(self, snapshot: dict[str, dict[str, Any]]) -> None:
        """Continue counting from a checkpoint's snapshot."""
        for k, v in snapshot.items():
            self.totals[k] = CommTotals(
                int(v["calls"]),
                int(v["bytes"]),
                float(v["waited_s"]),
                int(v.get("sent", v["bytes"])),
                {kind: int(n) for kind, n in v.get("parts", {}).items()},
                str(v.get("algorithm", "")),
            )
