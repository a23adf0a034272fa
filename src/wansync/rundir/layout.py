"""The names of what a run directory and an experiment directory hold.

    OUT/experiment.json              PLAN_FILE: the grid of runs (labels, settings, seeds, report targets)
    OUT/<label>/seed<k>/             one run: config.toml, metrics.jsonl, profile.json, summary.json
    OUT/<label>/seed<k>/failed.json  FAILED_FILE: a run that failed, with its one-line message
"""
from __future__ import annotations

PLAN_FILE = "experiment.json"
FAILED_FILE = "failed.json"
