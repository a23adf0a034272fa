"""Run the `wansync` CLI as a user would and get what the user sees: exit status, stdout, stderr.

By default the CLI runs in a process forked from the forkserver the local ranks start from
(`wansync.localgroup.rank_context`: torch and torch._dynamo imported, no thread running), with its
file descriptors 1 and 2 on files, the given environment and working directory. What comes out is
what `python -m wansync` gives (SystemExit is the exit status, as in the interpreter; the launcher
forks its workers as it would in its own process), but a call costs no interpreter start-up and no
torch import, seconds each. The test process's own threads (pytest-xdist's receiver) do not reach
the CLI. `fresh=True` runs `python -m wansync` in a subprocess instead.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from wansync.workerproc import live_workers

TINY = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2", "--threads", "1"]


def wansync(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
            cwd: str | Path | None = None, fresh: bool = False,
            setup: Callable[[], None] | None = None) -> subprocess.CompletedProcess:
    """`setup`: a module-level function the CLI's process calls first (to record what it does)."""
    full_env = dict(os.environ, **(env or {}))
    if fresh:
        return subprocess.run([sys.executable, "-m", "wansync", *args], capture_output=True, text=True,
                              timeout=timeout, env=full_env, cwd=cwd)
    from wansync.localgroup import rank_context
    with tempfile.TemporaryDirectory() as d:
        out, err = Path(d, "stdout"), Path(d, "stderr")
        proc = rank_context().Process(target=_cli, args=(list(args), full_env, str(cwd or os.getcwd()),
                                                         str(out), str(err), setup))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["wansync", *args], timeout, _text(out), _text(err))
        return subprocess.CompletedProcess(["wansync", *args], proc.exitcode, _text(out), _text(err))


def _text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace") if path.is_file() else ""


def _cli(args: list[str], env: dict[str, str], cwd: str, out: str, err: str,
         setup: Callable[[], None] | None) -> None:
    """The CLI's process: its SystemExit becomes the exit status (multiprocessing does as the
    interpreter does: an int is the status, a message goes to stderr with status 1)."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", write_through=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if setup is not None:
        setup()
    from wansync.cli import main
    main(args)


def worker_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of the run's live worker processes, forked or fresh."""
    return live_workers(run_dir)


def no_process_left(run_dir: Path) -> bool:
    """No worker process of this run is still alive."""
    return not worker_pids(run_dir)
