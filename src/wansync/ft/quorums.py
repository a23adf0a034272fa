"""What a fault-tolerant run's logs say: logs/quorum_rank<r>.jsonl (one line per quorum a worker
took part in) gives the steps each worker lost and the exchanges a worker was missing from;
logs/heals.jsonl (one line per heal) the heals. The workers write them (`ft.member`), the launcher
reads them into summary.json (`ft.supervisor`).

A worker *loses* the steps whose work never reached an exchange: from the last slot it took part
in before an absence to the slot it is back at (healed from a peer, its own steps discarded), or
to the end of the run when it never comes back. A worker that died inside an exchange it had
joined counts as present there (the quorum's view, not the wire's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

QUORUM_LOG = "quorum_rank{rank}.jsonl"
HEALS_LOG = "heals.jsonl"


def read_quorums(log_dir: Path, workers: int) -> dict[int, list[dict[str, Any]]]:
    """Each worker's quorum records, in the order it took part in them (all its lives)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for rank in range(workers):
        path = log_dir / QUORUM_LOG.format(rank=rank)
        lines = path.read_text().splitlines() if path.is_file() else []
        out[rank] = [json.loads(line) for line in lines if line.strip()]
    return out


def heals(log_dir: Path, rank: int | None = None) -> int:
    """How many times a worker (`rank`; default: any) healed from a peer."""
    path = log_dir / HEALS_LOG
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return len(lines) if rank is None else sum(1 for line in lines if json.loads(line).get("rank") == rank)


def steps_lost(
    present: dict[int, Iterable[int]], end: int, healed: dict[int, Iterable[int]] | None = None
) -> dict[int, int]:
    """Per worker, the steps lost (module docstring), given the slots (steps) each one took part in
    and those it healed at (a worker restarted in time for the next slot misses no exchange, yet
    its steps since the last one it took part in were discarded)."""
    seen = {w: set(steps) for w, steps in present.items()}
    heals = {w: set((healed or {}).get(w, ())) for w in seen}
    slots = sorted(set().union(*seen.values())) if seen else []
    lost = {}
    for w, mine in seen.items():
        total, last, absent = 0, 0, False
        for s in slots:
            if s not in mine:
                absent = True
            else:
                total += s - last if absent or s in heals[w] else 0
                last, absent = s, False
        lost[w] = total + (end - last if absent else 0)
    return lost


def short_exchanges(records: Iterable[dict[str, Any]], workers: int) -> list[int]:
    """The slots (steps) whose final quorum had fewer than `workers` participants, ascending."""
    last: dict[int, int] = {}
    for r in records:
        last[int(r["step"])] = int(r["participants"])
    return sorted(s for s, n in last.items() if n < workers)
