"""Run the `wansync` CLI as a user would and get what the user sees: exit status, stdout, stderr.

By default the CLI runs in a process forked from the forkserver the local ranks start from
(`wansync.runner.localgroup.rank_context`: torch and torch._dynamo imported, no thread running), with its
file descriptors 1 and 2 on files, the given environment and working directory. What comes out is
what `python -m wansync` gives (SystemExit is the exit status, as in the interpreter; the launcher
forks its workers as it would in its own process), but a call costs no interpreter start-up and no
torch import, seconds each. The test process's own threads (pytest-xdist's receiver) do not reach
the CLI. `fresh=True` runs `python -m wansync` in a subprocess instead. `start()` returns while the
CLI runs (several runs side by side, or one to look at or signal while it trains).
"""

from __future__ import annotations

import io
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from wansync.runner.workerproc import live_workers

# the smallest run of the real pipeline: the micro LM (0.2M parameters), a few tokens per step
TINY = ["--model", "micro", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2", "--threads", "1"]


def wansync(
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    fresh: bool = False,
    setup: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    """`setup`: a module-level function the CLI's process calls first (to record what it does)."""
    if fresh:
        return subprocess.run(
            [sys.executable, "-m", "wansync", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(os.environ, **(env or {})),
            cwd=cwd,
        )
    return start(*args, env=env, cwd=cwd, setup=setup).result(timeout)


class Running:
    """A CLI started by `start` (or a script, `forked_script`), running beside the caller; `result()`
    waits for it (killing it past `timeout`) and returns what `wansync()` returns."""

    def __init__(self, command: list[str], target: Callable[..., None], *args: Any):
        """`target(stdout_path, stderr_path, *args)` in the forked process; `command` names it in what
        `result()` returns."""
        from wansync.runner.localgroup import rank_context

        self.command, self._dir = command, tempfile.TemporaryDirectory()
        self._out, self._err = Path(self._dir.name, "stdout"), Path(self._dir.name, "stderr")
        self.proc = rank_context().Process(target=target, args=(str(self._out), str(self._err), *args))
        self.proc.start()

    def result(self, timeout: float = 120) -> subprocess.CompletedProcess:
        try:
            self.proc.join(timeout)
            if self.proc.exitcode is None:
                self.kill()
                raise subprocess.TimeoutExpired(self.command, timeout, _text(self._out), _text(self._err))
            return subprocess.CompletedProcess(self.command, self.proc.exitcode, _text(self._out), _text(self._err))
        finally:
            self._dir.cleanup()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.exitcode is None

    def stderr(self) -> str:
        """What the CLI wrote to stderr so far."""
        return _text(self._err)

    def terminate(self) -> None:
        """SIGTERM, as a user's `kill PID` (`result()` then waits for the run to wind down)."""
        if self.proc.exitcode is None:
            self.proc.terminate()

    def kill(self) -> None:
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()


def start(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    setup: Callable[[], None] | None = None,
) -> Running:
    """Start the CLI in a process forked from the ranks' forkserver (see the module docstring) and return
    at once: several runs side by side without an interpreter start-up each."""
    return Running(
        ["wansync", *args], _cli, list(args), dict(os.environ, **(env or {})), str(cwd or os.getcwd()), setup
    )


def _text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace") if path.is_file() else ""


def into_files(out: str, err: str, env: dict[str, str], mode: int) -> None:
    """A child process's stdout and stderr into files (`mode`: os.O_TRUNC or os.O_APPEND), its
    environment replaced by `env`."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | mode, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", write_through=True)
    os.environ.clear()
    os.environ.update(env)


def _cli(out: str, err: str, args: list[str], env: dict[str, str], cwd: str, setup: Callable[[], None] | None) -> None:
    """The CLI's process: its SystemExit becomes the exit status (multiprocessing does as the
    interpreter does: an int is the status, a message goes to stderr with status 1)."""
    into_files(out, err, env, os.O_TRUNC)
    os.chdir(cwd)
    if setup is not None:
        setup()
    from wansync.cli import main

    main(args)


def _script_main(out: str, err: str, path: str, args: list[str], env: dict[str, str], cwd: str) -> None:
    """`python PATH ARGS` in CWD: its stdout and stderr into files; its SystemExit is the exit status,
    as the interpreter's."""
    into_files(out, err, env, os.O_TRUNC)
    os.chdir(cwd)
    sys.argv = [path, *args]
    runpy.run_path(path, run_name="__main__")


def forked_script(
    path: Path, args: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    """What `subprocess.run([sys.executable, PATH, *args], capture_output=True, text=True)` gives, in a
    process forked from the ranks' forkserver: without an interpreter's start-up and torch's import (the
    seconds of each call). Killed past `timeout` (exit status -9)."""
    command = [str(path), *args]
    running = Running(command, _script_main, str(path), args, dict(env or os.environ), str(cwd or os.getcwd()))
    try:
        return running.result(timeout)
    except subprocess.TimeoutExpired as e:  # killed: what it wrote until then
        return subprocess.CompletedProcess(command, -signal.SIGKILL, e.output, e.stderr)


def worker_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of the run's live worker processes, forked or fresh."""
    return live_workers(run_dir)


def no_process_left(run_dir: Path) -> bool:
    """No worker process of this run is still alive."""
    return not worker_pids(run_dir)
