"""What a run directory and an experiment directory hold, and the one place their files are named,
written and read back.

    OUT/experiment.json              EXPERIMENT_FILE: the grid of runs (labels, settings, seeds, report targets)
    OUT/report.md, *.csv, *.png      REPORT_FILES: the report (`analysis.report`), replaced only where
                                     wansync wrote them (`rundir.owned`)
    OUT/<label>/seed<k>/             one run (RUN_FILES):
        config.toml                  the fully resolved configuration (`runner.run`)
        topology.toml                a copy of the --wan topology file, when one was given (or .yaml)
        metrics.jsonl                one record per step, evaluation and sync event (`telemetry.metrics`)
        profile.json                 the time categories and sync events (`telemetry.profiler`)
        summary.json                 SUMMARY_FILE, written once and then added to (below)
        checkpoints/                 one file per rank per step (`rundir.checkpoint`)
        logs/                        per rank: its one-line error, traceback, profile, quorum log; an
                                     asynchronous run's syncer.address (SYNCER_ADDRESS_FILE)
        tensorboard/                 TENSORBOARD_DIR: TensorBoard's event files (`telemetry.tensorboard`), when asked
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

A reader (`read_summary`) gets {} for a file that is missing, unreadable or not an object; what
wansync wrote, and may read back or replace, it recognises by its content (`is_run_dir`,
`is_summary`, `is_failure`, `is_experiment_dir`): a file of the same name written by anyone else is not
taken for a run.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from types import MappingProxyType
from typing import Any

from . import files
from .jsonout import dumps

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
PROFILE_FILE = "profile.json"
SUMMARY_FILE = "summary.json"
CHECKPOINTS_DIR = "checkpoints"
LOGS_DIR = "logs"
FAILED_FILE = "failed.json"
SYNCER_ADDRESS_FILE = "syncer.address"  # logs/: an asynchronous run's syncer, HOST:PORT (`runner.launch`)
TENSORBOARD_DIR = "tensorboard"
EXPERIMENT_FILE = "experiment.json"
# What a run writes into its directory: `train --force` replaces these and touches nothing else.
#: A copy of the topology file `--wan FILE` named, with its suffix (`runner.run.keep_topology`).
TOPOLOGY_FILES = ("topology.toml", "topology.yaml", "topology.yml")
RUN_FILES = (
    CONFIG_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    PROFILE_FILE,
    CHECKPOINTS_DIR,
    LOGS_DIR,
    FAILED_FILE,
    TENSORBOARD_DIR,
    *TOPOLOGY_FILES,
)
# Inside its directories, the names a run writes there (fnmatch patterns): `train --force` removes these
# and leaves anything else (a user's notes in logs/), and the directory with it.
RUN_DIR_CONTENTS = MappingProxyType(
    {
        LOGS_DIR: ("rank*.err", "rank*.log", "rank*.pid", "profile_rank*.json", "quorum_rank*.jsonl", "heals.jsonl"),
        CHECKPOINTS_DIR: ("step[0-9]*",),
        TENSORBOARD_DIR: ("events.out.tfevents.*",),
    }
)
REPORT_FILE = "report.md"
SUMMARY_CSV = "summary.csv"
RUNS_CSV = "runs.csv"
QUALITY_PLOTS = ("{quality}_vs_step.png", "{quality}_vs_wallclock.png")  # quality: loss or accuracy
PLOTS = ("pareto.png", "time_breakdown.png", "bytes.png", "exposed_over_time.png", "adapt.png", "staleness.png")
# What a report writes beside the runs, in a directory that may hold files of others.
REPORT_FILES = (
    REPORT_FILE,
    SUMMARY_CSV,
    RUNS_CSV,
    *(p.format(quality=q) for q in ("loss", "accuracy") for p in QUALITY_PLOTS),
    *PLOTS,
)


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> None:
    """The trainer's summary of a finished run (replacing any earlier one)."""
    files.write_text(Path(run_dir) / SUMMARY_FILE, dumps(summary, indent=2))


def add_to_summary(run_dir: str | Path, fields: dict[str, Any]) -> bool:
    """Add (or replace) `fields` in a run's summary; False, writing nothing, when the run has none."""
    path = Path(run_dir) / SUMMARY_FILE
    summary = read_summary(run_dir)
    if not summary:
        return False
    summary.update(fields)
    files.write_text(path, dumps(summary, indent=2))
    return True


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """A run's summary; {} when it has none (or one that is damaged)."""
    return json_object(Path(run_dir) / SUMMARY_FILE)


def topology_copy_name(source: Path) -> str:
    """The run directory's name for its copy of the topology file `source`: topology.toml (or .yaml, .yml)."""
    return "topology" + source.suffix.lower()


def regular_text(path: Path) -> str:
    """A run directory's file, read only if it is a regular file: a FIFO of that name would block
    the reader for ever (OSError otherwise)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a regular file")
    return path.read_text()


def json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; {} for a file that is missing, unreadable or holds no object."""
    try:
        data = json.loads(regular_text(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def has_summary(run_dir: str | Path) -> bool:
    """Did the run finish (its trainer wrote the summary)?"""
    return (Path(run_dir) / SUMMARY_FILE).is_file()


def is_run_dir(d: str | Path) -> bool:
    """`d` holds a wansync run: a config.toml with a [run] table naming a strategy."""
    try:
        data = tomllib.loads(regular_text(Path(d) / CONFIG_FILE))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return isinstance(data.get("run"), dict) and "strategy" in data["run"]


def is_summary(summary: dict[str, Any]) -> bool:
    """A summary the trainer wrote: it names the strategy and the number of steps (a summary.json of
    {}, or of another program, is not one)."""
    steps = summary.get("steps")
    return isinstance(summary.get("strategy"), str) and isinstance(steps, int) and not isinstance(steps, bool)


def is_failure(run_dir: str | Path) -> bool:
    """Did an experiment record this run as failed (a failed.json of its own)?"""
    return isinstance(json_object(Path(run_dir) / FAILED_FILE).get("message"), str)


def is_experiment_dir(d: str | Path) -> bool:
    """`d` holds a wansync experiment: an experiment.json with its list of runs."""
    return isinstance(json_object(Path(d) / EXPERIMENT_FILE).get("runs"), list)
