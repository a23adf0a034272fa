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


def no_process_left(run_dir: Path) -> bool:
    """No process still has this run directory in its environment."""
    marker = f"WANSYNC_RUN_DIR={run_dir}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if marker in env.split(b"\0"):
            return False
    return True
