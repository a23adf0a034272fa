"""Run directories read into `Run`s (`analysis.runs`): every run wansync wrote under a root, in the
experiment's order, with its status: ok, failed (failed.json, or no summary: interrupted), or damaged
(a summary.json that is not the trainer's, a metrics.jsonl cut short). `report` and `results` read
runs through it."""

from __future__ import annotations

import errno
import json
import re
import tomllib
from pathlib import Path
from typing import Any

from ..errors import WansyncError
from ..rundir.layout import (
    CONFIG_FILE,
    EXPERIMENT_FILE,
    FAILED_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    is_failure,
    is_run_dir,
    is_summary,
    read_summary,
    regular_text,
)
from ..rundir.target import read_evals
from .runs import Run, number


class ReportError(WansyncError):
    """Nothing to report on, or a directory that holds no runs."""


# ---------------------------------------------------------------- reading runs


def read_json(path: Path) -> Any:
    """A JSON file of a run directory (a regular file only: `rundir.layout.regular_text`)."""
    return json.loads(regular_text(path))


def _config_value(run_dir: Path, section: str, key: str) -> Any:
    try:
        return tomllib.loads(regular_text(run_dir / CONFIG_FILE)).get(section, {}).get(key)
    except (OSError, ValueError, AttributeError):  # unreadable, not UTF-8, not TOML, not a table
        return None


_SEED_DIR = re.compile(r"^seed(\d+)$")


def _is_run_dir(d: Path) -> bool:
    """A run wansync wrote, finished or not (a config.toml beside a metrics.jsonl counts too: a run
    whose config was damaged); a directory that merely holds a summary.json of another program does not."""
    return (
        is_run_dir(d)
        or is_summary(read_summary(d))
        or is_failure(d)
        or ((d / CONFIG_FILE).is_file() and (d / METRICS_FILE).is_file())
    )


def find_runs(root: str | Path) -> list[Run]:
    """Every run directory under root (root itself may be one), in the experiment's order, then path order."""
    root = Path(root)
    if not root.exists():
        raise ReportError(f"report: directory not found: {root}")
    if not root.is_dir():
        raise ReportError(f"report: {root} is not a directory")
    try:
        dirs = sorted(
            {
                p.parent
                for pat in (SUMMARY_FILE, FAILED_FILE, METRICS_FILE, CONFIG_FILE)
                for p in root.rglob(pat)
                if _is_run_dir(p.parent) and "logs" not in p.parent.relative_to(root).parts
            }
        )
    except OSError as e:  # pseudo file systems, unreadable folders
        raise ReportError(f"report: cannot read {root}: {e.strerror or e} ({e.filename})") from None
    if not dirs:
        raise ReportError(
            f"report: no runs found under {root} (expected run directories holding summary.json, "
            f"as written by wansync train/compare/sweep)"
        )
    listed = {}
    try:
        for r in read_json(root / EXPERIMENT_FILE).get("runs", []):
            listed[(root / r["dir"]).resolve()] = r
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        listed = {}
    order = {d: i for i, d in enumerate(listed)}
    on_disk = {d.resolve() for d in dirs}
    listed = {d: r for d, r in listed.items() if d in on_disk}
    runs = [_load_run(d, listed.get(d.resolve())) for d in dirs]
    runs.sort(key=lambda r: (order.get(r.dir.resolve(), len(order)), str(r.dir)))
    return runs


def _load_run(d: Path, entry: dict[str, Any] | None) -> Run:
    m = _SEED_DIR.match(d.name)
    if entry:
        label = entry["label"]
    elif m:
        label = d.parent.name if d.parent != d else d.name
    else:
        label = d.name
    summary, status = _status(d)
    profile: dict[str, Any] = {}
    if status == "ok":
        try:
            profile = read_json(d / "profile.json")
        except (OSError, ValueError):
            profile = {}
        if not isinstance(profile, dict):
            profile = {}
    strategy = (
        summary.get("strategy")
        or (entry or {}).get("strategy")
        or _config_value(d, "run", "strategy")
        or label.split("__")[0]
    )
    seed = summary.get("seed", (entry or {}).get("seed"))
    if seed is None:
        seed = _config_value(d, "run", "seed")
    if seed is None and m:
        seed = int(m.group(1))
    return Run(
        d,
        label,
        str(strategy),
        seed,
        dict((entry or {}).get("setting", {})),
        status,
        summary,
        profile,
        read_evals(d / "metrics.jsonl") if status == "ok" else [],
    )


def _status(d: Path) -> tuple[dict[str, Any], str]:
    """(the run's summary, "ok" or why not): failed (failed.json), incomplete (no summary), or
    damaged (a summary.json that is not the trainer's, a metrics.jsonl that does not reach its end)."""
    if is_failure(d):
        return {}, "failed: " + str(read_json(d / FAILED_FILE)["message"])
    if not (d / SUMMARY_FILE).is_file():
        return {}, "failed: incomplete (no summary.json: interrupted or still running)"
    summary = read_summary(d)
    if not is_summary(summary):
        return {}, "damaged: summary.json is not a wansync summary (unreadable, or without strategy and steps)"
    why = metrics_damage(d / METRICS_FILE, summary["steps"])
    return (summary, "ok") if why is None else ({}, f"damaged: {why}")


def metrics_damage(path: Path, steps: int) -> str | None:
    """Why a finished run's metrics.jsonl cannot be trusted, or None: missing, a line that is not a
    JSON record (torn when the file was cut), or records that stop before the last step's evaluation
    (a run evaluates at its end)."""
    last = None
    try:
        if not path.is_file():
            raise FileNotFoundError(errno.ENOENT, "missing, or not a regular file")
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                try:
                    rec = json.loads(line) if line.strip() else {}
                except json.JSONDecodeError:
                    rec = None
                if not isinstance(rec, dict):
                    return f"{METRICS_FILE} line {n} is not a JSON record (a torn or truncated file)"
                if rec.get("type") == "eval":
                    last = number(rec.get("step"))
    except OSError as e:
        return f"{METRICS_FILE} cannot be read ({e.strerror or e})"
    if last != steps:
        seen = "none" if last is None else f"at step {last:g}"
        return f"{METRICS_FILE} stops short: the run has {steps} steps, its last evaluation is {seen} (cut short?)"
    return None
