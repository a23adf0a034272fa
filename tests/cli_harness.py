"""Run the `wansync` CLI in a subprocess, as a user would, with a hard timeout."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TINY = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2", "--threads", "1"]


def wansync(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "wansync", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd)


def worker_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of the run's live worker processes: those its launcher recorded in
    logs/rank{R}.pid (forked workers show the launcher's environment in /proc), and any process
    with the run directory in its environment (workers started as fresh interpreters)."""
    found = {}
    for f in Path(run_dir, "logs").glob("rank*.pid"):
        pid = int(f.read_text() or 0)
        if pid and _alive(pid):
            found[int(f.stem[4:])] = pid
    marker = f"WANSYNC_RUN_DIR={run_dir}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in env and _alive(int(pid)):
            rank = next((v[5:] for v in env if v.startswith(b"RANK=")), b"")
            found[int(rank or -1)] = int(pid)
    return found


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child its parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def no_process_left(run_dir: Path) -> bool:
    """No worker process of this run is still alive."""
    return not worker_pids(run_dir)
