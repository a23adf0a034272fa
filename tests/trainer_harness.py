"""Rank functions that run the real training loop in-process, many runs in one process group.

A command-line run spends most of its time starting processes; the training loop itself is
what the resume and non-finite tests are about. `run_legs` runs a list of legs, one after the
other, in the group `wansync.runner.localgroup.run_ranks` spawned: each leg is one `train_worker` call
(the same call a worker process makes) on a run directory that `wansync.runner.run.prepare` laid out,
the way the command line lays it out.

A leg may stop its run the way a crash would: every rank raises the injected `exit` fault of
`wansync.trainer.faults` right after the backward pass of a given step (before that step's
synchronization, so the group stays consistent and the next leg can use it). Whatever the
stopped run left on disk is all a later resume leg sees; run resume legs in a fresh group so
that nothing of the stopped run survives in memory either.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from wansync.runner.run import prepare, resume_config
from wansync.trainer.loop import train_worker


def lay_out(overrides: dict[str, Any]) -> str:
    """Validate the config and write the run directory (config.toml) as `wansync train` does."""
    from wansync.config import build_config

    run_dir, _ = prepare(build_config(overrides=overrides))
    return str(run_dir)


def run_legs(rank: int, world: int, legs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run every leg in order. A leg: {"run_dir", optional "resume": bool, "stop_at": step,
    "fault": WANSYNC_FAULT text}; returns per leg {"summary"} or {"stopped": message}."""
    from wansync.config import from_sections
    import tomllib

    out = []
    for leg in legs:
        run_dir = Path(leg["run_dir"])
        if leg.get("resume"):
            cfg = resume_config(run_dir, {})
        else:
            cfg = from_sections(tomllib.loads((run_dir / "config.toml").read_text()))  # as a worker reads it
        fault = leg.get("fault")
        if leg.get("stop_at") is not None:
            fault = f"rank={rank},step={leg['stop_at']},action=exit"
        if fault:
            os.environ["WANSYNC_FAULT"] = fault
        try:
            out.append({"summary": train_worker(cfg, run_dir, rank, world, resume=bool(leg.get("resume")))})
        except Exception as e:
            if leg.get("stop_at") is None or str(e) != f"injected failure at step {leg['stop_at']}":
                raise RuntimeError(f"{'resuming ' if leg.get('resume') else ''}{run_dir} failed") from e
            out.append({"stopped": str(e)})
        finally:
            os.environ.pop("WANSYNC_FAULT", None)
    return out
