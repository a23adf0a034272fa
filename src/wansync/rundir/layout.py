"""What a run directory and an experiment directory hold, and the one place their files are named,
written and read back.

    OUT/experiment.json              EXPERIMENT_FILE: the grid of runs (labels, settings, seeds, report targets)
    OUT/<label>/seed<k>/             one run (RUN_FILES):
        config.toml                  the fully resolved configuration (`runner.run`)
        metrics.jsonl                one record per step, evaluation and sync event (`telemetry.metrics`)
        profile.json                 the time categories and sync events (`telemetry.profiler`)
        summary.json                 SUMMARY_FILE, written once and then added to (below)
        checkpoints/                 one file per rank per step (`rundir.checkpoint`)
        logs/                        per rank: its one-line error, traceback, profile, quorum log
        failed.json                  FAILED_FILE: a run that failed, with its one-line message

summary.json has three writers, each with its own keys, and all of them go through this module:

- the trainer (rank 0, at the end of the run, `write_summary`): what the run was and what it
  reached: strategy, workers, ranks_per_worker, steps, model, data, seed, options, lr, wall_clock_s,
  bytes (sent, between and inside workers), comm, sync_events, skipped_steps, dropped_exchanges,
  wan, time_s (the profiler's categories), exposed communication, the final and best quality,
  first_eval, chance_level, diverged, and `target` when one was given;
- the launcher of a fault-tolerant run (`add_to_summary`): worker_failures, rejoins, heals,
  steps_lost, short_exchanges;
- the report (`add_to_summary`): `target` and when the run reached it, for the target it used.

A reader (`read_summary`) gets {} for a file that is missing, unreadable or not an object.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .jsonout import dumps

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
PROFILE_FILE = "profile.json"
SUMMARY_FILE = "summary.json"
CHECKPOINTS_DIR = "checkpoints"
LOGS_DIR = "logs"
FAILED_FILE = "failed.json"
EXPERIMENT_FILE = "experiment.json"
# What a run writes into its directory: `train --force` replaces these and touches nothing else.
RUN_FILES = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, PROFILE_FILE, CHECKPOINTS_DIR, LOGS_DIR, FAILED_FILE)


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> None:
    """The trainer's summary of a finished run (replacing any earlier one)."""
    (Path(run_dir) / SUMMARY_FILE).write_text(dumps(summary, indent=2))


def add_to_summary(run_dir: str | Path, fields: dict[str, Any]) -> bool:
    """Add (or replace) `fields` in a run's summary; False, writing nothing, when the run has none."""
    path = Path(run_dir) / SUMMARY_FILE
    summary = read_summary(run_dir)
    if not summary:
        return False
    summary.update(fields)
    path.write_text(dumps(summary, indent=2))
    return True


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """A run's summary; {} when it has none (or one that is damaged)."""
    try:
        summary = json.loads((Path(run_dir) / SUMMARY_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return summary if isinstance(summary, dict) else {}


def has_summary(run_dir: str | Path) -> bool:
    """Did the run finish (its trainer wrote the summary)?"""
    return (Path(run_dir) / SUMMARY_FILE).is_file()
