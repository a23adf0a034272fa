"""Run the `wansync` CLI as a user would and get what the user sees: exit status, stdout, stderr.

By default the CLI runs inside the test process (`wansync.cli.main(argv)`) with file descriptors 1
and 2, sys.stdout/sys.stderr, the environment and the working directory swapped for the call. What
comes out is the same (the launcher forks its workers from this process as it would from its own,
and they write to the same descriptors), but a call costs no interpreter start-up and no torch
import, seconds each. `fresh=True` runs `python -m wansync` in a subprocess with a hard timeout
instead, and so does every call this process cannot host: a torchrun environment (the worker would
run in this process), `--parallel` (its threads end the CLI with os._exit), or a test process that
already runs other threads (the launcher would not fork, and exit_now would os._exit).
"""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator

TINY = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2", "--threads", "1"]
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def wansync(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
            cwd: str | Path | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **(env or {}))
    hostable = (not any(full_env.get(v) for v in TORCHRUN_VARS) and "--parallel" not in args
                and threading.active_count() == 1)
    if fresh or not hostable:
        return subprocess.run([sys.executable, "-m", "wansync", *args], capture_output=True, text=True,
                               timeout=timeout, env=full_env, cwd=cwd)
    return _in_process(list(args), full_env, cwd)


def _in_process(args: list[str], env: dict[str, str], cwd: str | Path | None) -> subprocess.CompletedProcess:
    from wansync.cli import main
    code: int | str | None = 0
    with _captured() as (out, err), _environment(env), contextlib.chdir(cwd or os.getcwd()):
        try:
            main(args)
        except SystemExit as e:
            code = e.code
        if isinstance(code, str):                           # sys.exit("message"), as the interpreter does
            print(code, file=sys.stderr)
            code = 1
    return subprocess.CompletedProcess(["wansync", *args], code or 0, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _captured() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """fds 1 and 2 (and sys.stdout/err on them) go to files for the block; their text is yielded
    as StringIOs filled at the end."""
    texts = (io.StringIO(), io.StringIO())
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    streams = (sys.stdout, sys.stderr)
    with tempfile.TemporaryFile() as f1, tempfile.TemporaryFile() as f2:
        try:
            for fd, f in ((1, f1), (2, f2)):
                os.dup2(f.fileno(), fd)
            sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                                       write_through=True) for fd in (1, 2))
            yield texts
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = streams
            for fd, s in zip((1, 2), saved):
                os.dup2(s, fd)
                os.close(s)
            for f, text in zip((f1, f2), texts):
                f.seek(0)
                text.write(f.read().decode("utf-8", errors="replace"))


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


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
