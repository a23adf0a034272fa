"""How much of each rank's exposed communication was waiting for a peer that arrived later.

A blocking exchange ends for everyone when the last rank has arrived and the transfer is done, so
the time a rank is blocked in it is its wait for the later peers plus the transfer. The last rank
to arrive waits for no one: per step, the smallest exposed time over the ranks is the exchange's
own, and what a rank was blocked beyond it is its *peer wait*, a straggler's cost rather than the
link's. Only durations on each rank's own clock are compared, so it needs no synchronized clocks.

On identical workers the peer wait is zero. Ranks that share cores, or hosts of unequal speed, take
turns arriving late; a run then measures the link's time plus these waits, while `wansync plan`
(identical workers, arriving together) predicts the link's time alone.

The launcher adds the figures to profile.json when every rank's profile is in logs/ (`record`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..rundir import files, jsonout

PROFILE = "profile_rank{}.json"  # every rank's profile.json, in the run's logs/


def peer_waits(profiles: dict[int, dict[str, Any]]) -> dict[int, float] | None:
    """Per rank, the seconds blocked on exchanges beyond the last-arriving rank's time, summed over
    the steps every rank has an event for, and over the evaluations every rank waited in (their
    mean's all-reduce, `eval_waits`: a slower worker makes the others wait there too); None with
    fewer than two ranks or nothing in common."""
    if len(profiles) < 2:
        return None
    exposed = {
        r: {
            **{e["step"]: e.get("exposed_s") or 0.0 for e in p.get("events", [])},
            **{f"eval {k}": v for k, v in (p.get("eval_waits") or {}).items()},
        }
        for r, p in profiles.items()
    }
    common = set.intersection(*(set(steps) for steps in exposed.values()))
    if not common:
        return None
    waits = dict.fromkeys(profiles, 0.0)
    for step in common:
        floor = min(by_step[step] for by_step in exposed.values())
        for r, by_step in exposed.items():
            waits[r] += by_step[step] - floor
    return waits


def record(run_dir: Path, logs: Path, world: int) -> None:
    """Add every rank's time split and peer wait to profile.json (rank 0's): `ranks`, and
    `derived.peer_wait_s` / `peer_wait_pct` for rank 0. Nothing when a rank's profile is missing."""
    path = run_dir / "profile.json"
    profile_files = [logs / PROFILE.format(r) for r in range(world)]
    if world < 2 or not path.is_file() or not all(f.is_file() for f in profile_files):
        return
    try:  # telemetry: a file it cannot read leaves profile.json as rank 0 wrote it, never fails the run
        profiles = {r: json.loads(f.read_text()) for r, f in enumerate(profile_files)}
        waits = peer_waits(profiles)
        if waits is None:
            return
        # no rank waits for a peer longer than it was blocked at all (an overlapped exchange's events
        # are estimates, `commtime`: their sum can exceed the category)
        waits = {r: min(w, profiles[r]["categories_s"]["exposed_comm"]) for r, w in waits.items()}
        profile = json.loads(path.read_text())
        wall = profile["wall_clock_s"]
        profile["derived"].update(peer_wait_s=waits[0], peer_wait_pct=100.0 * waits[0] / wall if wall > 0 else 0.0)
        profile["ranks"] = [
            {
                "rank": r,
                "wall_clock_s": p["wall_clock_s"],
                "compute_s": p["categories_s"]["compute"],
                "exposed_comm_s": p["categories_s"]["exposed_comm"],
                "peer_wait_s": waits[r],
            }
            for r, p in profiles.items()
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return
    files.write_text(path, jsonout.dumps(profile, indent=2))
