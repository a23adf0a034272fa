"""How the launcher starts a worker process: forked from itself, or a fresh interpreter.

A fresh interpreter spends seconds importing torch (and torch._dynamo, which the first optimizer
imports) before it does anything. The launcher has imported torch already, so a single-threaded
launcher imports torch._dynamo once and forks its workers: each starts in milliseconds with every
module imported. A launcher with other threads (a parallel sweep's, the rendezvous store's once it
serves, OpenMP's after a torch op on several threads: `can_fork`) starts a fresh
`python -m wansync.worker` instead, as does one on a platform without fork: forking while another
thread holds a lock can deadlock the child. So a worker restarted in a fault-tolerant run starts
fresh; the run's lighthouse serves from a process of its own (`lighthouse`) so that its first
workers need not.

Nothing else changes for the worker. It gets the same environment, starts with the launcher's
signal mask (SIGINT blocked) and the default SIGTERM, and its parent is the launcher, which its
death signal is armed against. One difference is visible from outside: /proc/PID/environ of a
forked worker shows the launcher's initial environment, so the launcher records every worker's
pid in logs/rank{R}.pid (`record_pid`), whichever way it started.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Sequence, Union


class ForkedWorker:
    """A forked worker, with the part of subprocess.Popen's interface the launcher uses."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)      # -N: killed by signal N
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:                  # never signal a reaped pid: it may be reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Worker = Union[ForkedWorker, subprocess.Popen]


# Threads a process has after `import torch` (the main one and one torch starts), read on Linux.
THREADS_AFTER_IMPORT = 2


def can_fork() -> bool:
    """Whether this process may fork a worker: no thread runs but the main one and the one `import
    torch` starts. Any other (a Python thread, a rendezvous store's, a hosted lighthouse's, or the OpenMP
    team torch starts at its first op on more than one thread) may hold a lock the child would wait
    for forever (GNU OpenMP's team, seen here: the child hangs in its first parallel op)."""
    if not hasattr(os, "fork") or threading.active_count() != 1:
        return False
    try:
        return len(os.listdir("/proc/self/task")) <= THREADS_AFTER_IMPORT
    except OSError:                              # no /proc: the native threads cannot be counted
        return False


def start(env: dict[str, str], *, fork: bool, close: Sequence[int] = ()) -> Worker:
    """Start one worker with environment `env`: forked (closing the fds `close` in the child) or
    as a fresh interpreter."""
    if not fork:
        return subprocess.Popen([sys.executable, "-m", "wansync.worker"], env=env)
    import torch._dynamo  # noqa: F401 - every worker's first optimizer imports it (~2 s): once, here
    sys.stdout.flush()                           # or the child would write the launcher's buffer again
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedWorker(pid)
    try:                                         # the child: never returns into the launcher's code
        for fd in close:
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)      # the launcher's handler is not the worker's
        os.environ.clear()
        os.environ.update(env)
        from .worker import main
        main()                                   # ends the process with the worker's status
    except BaseException:  # noqa: BLE001 - the child must end here whatever happens
        traceback.print_exc()
    finally:
        os._exit(1)


def record_pid(logs: Path, rank: int, worker: Worker) -> None:
    """logs/rank{R}.pid: the pid of rank R's current process (rewritten when it is restarted)."""
    (logs / f"rank{rank}.pid").write_text(f"{worker.pid}\n")


def live_workers(run_dir: Path) -> dict[int, int]:
    """rank -> pid of a run's live worker processes: those its launcher recorded in
    logs/rank{R}.pid (a forked worker's /proc/PID/environ is its launcher's), and any process with
    the run directory in its environment (a fresh interpreter; rank -1 if it has no RANK). Linux."""
    found = {}
    for f in Path(run_dir, "logs").glob("rank*.pid"):
        pid = int(f.read_text() or 0)
        if pid and _alive(pid):
            found[int(f.stem[4:])] = pid
    marker = f"WANSYNC_RUN_DIR={run_dir}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
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
