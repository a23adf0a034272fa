"""Checkpoints that resume bit-exactly: one file per rank per step, written atomically.

Layout: RUN_DIR/checkpoints/step00000040/rank{R}.pt plus RUN_DIR/checkpoints/latest, a
pointer rank 0 rewrites (temporary file + rename) only after every rank has renamed its own
file into place, so `latest` never names a half-written checkpoint. The two newest steps are
kept. Files hold only tensors, numbers, strings, lists and dicts and load with
`torch.load(weights_only=True)`: nothing is unpickled.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError, DataError

KEEP = 2


def ckpt_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_rank(run_dir: Path, step: int, rank: int, state: dict[str, Any]) -> Path:
    """Write this rank's state for `step` (atomic rename)."""
    d = ckpt_root(run_dir) / f"step{step:08d}"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"rank{rank}.pt"
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def publish(run_dir: Path, step: int) -> None:
    """Rank 0, after every rank saved: point `latest` at `step` and prune old steps."""
    root = ckpt_root(run_dir)
    atomic_write_bytes(root / "latest", f"step{step:08d}\n".encode())
    steps = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step"))
    for old in steps[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def latest_step_dir(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"cannot resume: {run_dir} is not a directory")
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"cannot resume: {run_dir} is not a wansync run directory (no config.toml)")
    pointer = ckpt_root(run_dir) / "latest"
    if not pointer.is_file():
        raise ConfigError(f"cannot resume: no checkpoint in {run_dir} (train with --checkpoint-every N)")
    name = pointer.read_text().strip()
    d = ckpt_root(run_dir) / name
    if not name.startswith("step") or not d.is_dir():
        raise DataError(f"cannot resume: {pointer} names a missing checkpoint '{name}'")
    return d


def load_rank(run_dir: Path, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's state from the latest checkpoint, checked for consistency."""
    d = latest_step_dir(run_dir)
    path = d / f"rank{rank}.pt"
    if not path.is_file():
        raise DataError(f"cannot resume: checkpoint {path} is missing")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user-facing problem
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"cannot resume: checkpoint {path} is corrupted or truncated ({first[:200]})") from None
    if not isinstance(state, dict) or "step" not in state:
        raise DataError(f"cannot resume: {path} is not a wansync checkpoint")
    if state.get("world_size") != world_size:
        raise ConfigError(f"cannot resume: checkpoint was written by {state.get('world_size')} workers, "
                          f"this run has {world_size}")
    return state


def checkpoint_step(run_dir: Path) -> int:
    return int(latest_step_dir(run_dir).name[4:])
