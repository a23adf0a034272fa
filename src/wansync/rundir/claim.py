"""Which directories a run may be written into: one rule for `train --out`, `compare`/`sweep`'s runs,
`ws.Run(out=...)` and the Trainer integration's `run_dir`.

A directory is one of three things:

- **fresh**: missing, or holding only what a run that never started leaves (a lock, a failure note,
  logs): taken;
- **foreign**: anything else that is not a wansync run (a user's files): refused in one line,
  whoever asks, whatever flag is given;
- **a run** (wansync's config.toml, a summary.json the trainer or `ws.Run` wrote, or a metrics.jsonl of
  wansync's records): refused, unless the caller says what to do with it — replace it (`train --force`,
  `compare`) or continue it (`train --resume`, `ws.Run(append=True)`, the Trainer's
  `resume_from_checkpoint`). It is continued only when it is the same run: the strategy, its options
  and the world it recorded are this run's (`same_run`; the Trainer integration's checkpoint files,
  which record the same, are compared by the same `differs`); a run that recorded none (a loop of the
  user's killed before it closed) is taken as it is.
"""

from __future__ import annotations

import json
import tomllib
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError, StorageError, path_kind
from .layout import (
    CONFIG_FILE,
    FAILED_FILE,
    LOGS_DIR,
    METRICS_FILE,
    is_run_dir,
    is_summary,
    read_summary,
    regular_text,
)
from .lock import LOCK_FILE

# Entries that do not make a directory "non-empty" (a lock, a failure note, logs of a run that never wrote its config).
NOT_CONTENT = (LOCK_FILE, FAILED_FILE, LOGS_DIR)
IDENTITY = ("strategy", "workers", "ranks_per_worker", "options")  # what makes two runs the same run


class Claim(Enum):
    FRESH = "fresh"  # nothing of a run there: write a new one
    REPLACE = "replace"  # an earlier run's files are to be replaced (`train --force`)
    CONTINUE = "continue"  # the same run, continued


def claim(
    run_dir: str | Path,
    *,
    action: str,
    where: str,
    replace: bool = False,
    resume: bool = False,
    identity: Mapping[str, Any] | None = None,
    hints: str = "",
) -> Claim:
    """May a run be written into `run_dir`, and how (module docstring)? `action` and `where` word the
    caller's line (`train into`, `--out`); `hints` says how it continues or replaces a run there;
    `identity` is this run's (IDENTITY's keys), checked against the run there when continuing."""
    who = f"{where} {run_dir}"
    run_dir = Path(run_dir)
    if not run_dir.exists() and not run_dir.is_symlink():
        return Claim.FRESH
    if not run_dir.is_dir():
        raise ConfigError(f"{who} exists and is not a directory (it is {path_kind(run_dir)})")
    try:
        entries = sorted(p.name for p in run_dir.iterdir() if p.name not in NOT_CONTENT)
    except OSError as e:
        raise StorageError(f"cannot read {who}: {e.strerror or e}") from None
    if not entries:
        return Claim.FRESH
    if not is_a_run(run_dir):
        raise ConfigError(
            f"refusing to {action} {run_dir}: it is not empty and not a wansync run "
            f"(it holds {entries[0]!r}); choose another {where}"
        )
    if resume:
        if identity is not None and (differs := same_run(run_dir, identity)) is not None:
            raise ConfigError(f"cannot continue the run in {run_dir}: {differs}; give another {where}")
        return Claim.CONTINUE
    if replace:
        return Claim.REPLACE
    finished = " (finished: its summary.json)" if is_summary(read_summary(run_dir)) else ""
    raise ConfigError(f"{run_dir} already holds a wansync run{finished}: {hints}or choose another {where}")


def is_a_run(d: Path) -> bool:
    """A wansync run of the command line (config.toml), of a loop's `ws.Run` (summary.json), or one
    that stopped before it wrote either (a metrics.jsonl whose first line is a wansync record)."""
    return is_run_dir(d) or is_summary(read_summary(d)) or _first_record(d / METRICS_FILE)


def _first_record(path: Path) -> bool:
    if not path.is_file():  # missing, or a FIFO that would block the reader
        return False
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            rec = json.loads(f.readline() or "null")
    except (OSError, ValueError):
        return False
    return isinstance(rec, dict) and isinstance(rec.get("type"), str) and "step" in rec


def recorded_identity(run_dir: Path) -> dict[str, Any] | None:
    """The run's strategy, options and world as it recorded them: its summary.json, else its
    config.toml; None when it recorded neither."""
    summary = read_summary(run_dir)
    if is_summary(summary):
        return {k: summary.get(k) for k in IDENTITY}
    try:
        data = tomllib.loads(regular_text(run_dir / CONFIG_FILE))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    run = data["run"] if isinstance(data.get("run"), dict) else {}
    return {
        "strategy": run.get("strategy"),
        "workers": run.get("workers"),
        "ranks_per_worker": run.get("ranks_per_worker", 1),
        "options": data.get("strategy") if isinstance(data.get("strategy"), dict) else {},
    }


def same_run(run_dir: Path, identity: Mapping[str, Any]) -> str | None:
    """What differs between the run in `run_dir` and `identity` (this run's), in words; None when
    nothing does (or the run recorded nothing to compare)."""
    return differs(recorded_identity(run_dir), identity)


def differs(theirs: Mapping[str, Any] | None, identity: Mapping[str, Any]) -> str | None:
    """What differs between a recorded identity (a run directory's, a checkpoint's) and `identity`
    (this run's), in words; None when nothing does, or nothing was recorded."""
    if theirs is None:
        return None
    for key in IDENTITY:
        mine, recorded = identity.get(key), theirs.get(key)
        if key == "options" and isinstance(mine, Mapping) and isinstance(recorded, Mapping):
            changed = sorted(k for k in set(mine) | set(recorded) if mine.get(k) != recorded.get(k))
            if changed:
                k = changed[0]
                return f"its option {k} is {recorded.get(k)!r}, this run's {mine.get(k)!r}"
        elif mine != recorded:
            return f"its {key.replace('_', ' ')} is {recorded!r}, this run's {mine!r}"
    return None
