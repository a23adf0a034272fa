"""How the launcher starts a worker process: forked from itself, or a fresh interpreter.

A fresh interpreter spends seconds importing torch (and torch._dynamo, which the first optimizer
imports) before it does anything. The launcher has imported torch already, so a single-threaded
launcher imports torch._dynamo once and forks its workers: each starts in milliseconds with every
module imported, and with what each would do first for itself done once (`warm`: the trainer's
modules, the checkpoint module, torchft, the bundled corpus). A launcher with other threads (a
parallel sweep's, the rendezvous store's once it serves, OpenMP's after a torch op on several
threads: `can_fork`) starts a fresh `python -m wansync.runner.worker` instead, as does one on a
platform without fork: forking while another thread holds a lock can deadlock the child. The run's
lighthouse serves from a process of its own (`lighthouse`) so that its first workers need not start
fresh. A worker restarted in a
fault-tolerant run, once the launcher's threads run, comes from a `Zygote`: a child the launcher
forked while it could, which forks it in milliseconds (a fresh interpreter takes seconds, during
which the others train on without it) and hands it over to the launcher as its child.

Nothing else changes for the worker. It gets the same environment, starts with the launcher's
signal mask (SIGINT blocked) and the default SIGTERM, and its parent is the launcher, which its
death signal is armed against. One difference is visible from outside: /proc/PID/environ of a
forked worker shows the launcher's initial environment, so the launcher records every worker's
pid in logs/rank{R}.pid (`record_pid`), whichever way it started.

How a worker ended, as the launcher tells it (`describe_exit`): its one line in logs/rank{R}.err,
else the signal that killed it or its exit status; `is_stopped`: a worker that hangs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Sequence, Union

from ..rundir import files
from ..rundir.layout import LOGS_DIR


class ForkedWorker:
    """A forked worker, with the part of subprocess.Popen's interface the launcher uses."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N: killed by signal N
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a reaped pid: it may be reused
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
    except OSError:  # no /proc: the native threads cannot be counted
        return False


def start(env: dict[str, str], *, fork: bool, close: Sequence[int] = (), zygote: "Zygote | None" = None) -> Worker:
    """Start one worker with environment `env`: forked (closing the fds `close` in the child), from
    `zygote` when one is given and the launcher may not fork itself, or as a fresh interpreter."""
    if not fork:
        if zygote is not None:
            try:
                return zygote.start(env)
            except OSError:  # it died (killed from outside): start fresh
                pass
        return subprocess.Popen([sys.executable, "-m", "wansync.runner.worker"], env=env)
    _before_fork()
    pid = os.fork()
    if pid:
        return ForkedWorker(pid)
    _become_worker(env, close)


def warm(cfg: Any) -> None:
    """Before the launcher forks its workers, what each of them would otherwise do for itself in its
    first second, done once here and inherited: the worker's modules (the trainer, the workloads, the
    strategies), the checkpoint module a sharded worker saves with, torchft for a fault-tolerant one,
    and the bundled corpus stripped of its Markdown (5 MB, ~0.15 s a process). Nothing here starts a
    thread (`can_fork` holds after it)."""
    from . import worker  # noqa: F401 - and through it trainer.loop, the workloads and strategies
    from ..workloads.lm.corpus import BUNDLED, shakespeare_documents

    if cfg.inside == "fsdp":
        import torch.distributed.checkpoint  # noqa: F401
    if cfg.fault_tolerant:
        from ..ft.quorum import require_torchft

        require_torchft()
    if cfg.data == BUNDLED:
        shakespeare_documents()


def _before_fork() -> None:
    import torch._dynamo  # noqa: F401 - every worker's first optimizer imports it (~2 s): once, here

    sys.stdout.flush()  # or the child would write the launcher's buffer again
    sys.stderr.flush()


def _become_worker(env: dict[str, str], close: Sequence[int] = ()) -> None:
    """In a forked child: run the worker with environment `env`; never returns."""
    try:
        for fd in close:
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's handler is not the worker's
        os.environ.clear()
        os.environ.update(env)
        from .worker import main

        main()  # ends the process with the worker's status
    except BaseException:  # noqa: BLE001 - the child must end here whatever happens
        traceback.print_exc()
    finally:
        os._exit(1)


PR_SET_CHILD_SUBREAPER = 36  # from <linux/prctl.h>
HANDOVER_S = 10.0  # how long a zygote's worker waits to become the launcher's child


class Zygote:
    """A single-threaded child of the launcher that forks workers on request, later, when the
    launcher itself may not fork any more (its rendezvous store's threads run): a fault-tolerant
    run's restarted workers start in milliseconds, every module imported, instead of a fresh
    interpreter's seconds of imports while the others train on without them.

    The worker must be the launcher's child (the launcher waits for it, signals it, and the worker
    dies with the launcher: `interrupts.die_with`), so the zygote forks it through a short-lived
    middle process: the launcher is a child subreaper (Linux), and when the middle process exits the
    orphaned worker is re-parented to it. The worker waits for that before it starts; the zygote
    reports its pid once the middle process is reaped. The zygote dies with the launcher and ends
    when the launcher closes its request pipe (`close`). Linux only (`available`)."""

    def __init__(self, close: Sequence[int] = ()):
        _before_fork()
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        launcher = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                for fd in (*close, requests_w, replies_r):
                    os.close(fd)
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # its workers start with it blocked
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                from .interrupts import die_with

                die_with(launcher)
                _serve(requests_r, replies_w, launcher)
            except BaseException:  # noqa: BLE001 - the child must end here whatever happens
                traceback.print_exc()
            finally:
                os._exit(0)
        os.close(requests_r)
        os.close(replies_w)
        self.pid, self._requests, self._replies = pid, requests_w, replies_r
        _set_child_subreaper(True)

    @staticmethod
    def available() -> bool:
        return sys.platform.startswith("linux") and hasattr(os, "fork")

    def start(self, env: dict[str, str]) -> ForkedWorker:
        _send(self._requests, json.dumps(env).encode())
        reply = _receive(self._replies)
        if not reply:
            raise OSError("the zygote that starts restarted workers has died")
        return ForkedWorker(int(reply))

    def close(self, timeout: float = 5.0) -> None:
        """End the zygote (EOF on its requests; SIGKILL if it has not ended within `timeout`)."""
        for fd in (self._requests, self._replies):
            try:
                os.close(fd)
            except OSError:
                pass
        worker = ForkedWorker(self.pid)
        try:
            worker.wait(timeout)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        _set_child_subreaper(False)


def _serve(requests: int, replies: int, launcher: int) -> None:
    """The zygote's loop: one worker per request (its environment), its pid as the reply."""
    while True:
        message = _receive(requests)
        if message is None:  # the launcher closed the pipe, or died
            return
        env = json.loads(message)
        pid_r, pid_w = os.pipe()
        middle = os.fork()
        if middle == 0:  # the middle process: fork the worker, tell its pid, exit
            worker = os.fork()
            if worker == 0:
                os.close(pid_r)
                os.close(pid_w)
                deadline = time.monotonic() + HANDOVER_S
                while os.getppid() != launcher:  # re-parented to the launcher once the middle one exits
                    if time.monotonic() > deadline:
                        os._exit(1)
                    time.sleep(0.001)
                _become_worker(env, (requests, replies))
            _send(pid_w, str(worker).encode())
            os._exit(0)
        os.close(pid_w)
        worker = _receive(pid_r) or b""  # not at EOF: the worker holds the pipe until it starts
        os.close(pid_r)
        os.waitpid(middle, 0)  # the worker is the launcher's child from here on
        _send(replies, worker)


def _send(fd: int, data: bytes) -> None:
    os.write(fd, len(data).to_bytes(8, "little") + data)


def _receive(fd: int) -> bytes | None:
    """One length-prefixed message from a pipe; None at EOF."""
    head = _read_exactly(fd, 8)
    return None if head is None else _read_exactly(fd, int.from_bytes(head, "little"))


def _read_exactly(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _set_child_subreaper(on: bool) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)


def error_file(run_dir: Path, rank: int) -> Path:
    """Where rank `rank` writes its failure, in one line (`runner.worker`)."""
    return run_dir / LOGS_DIR / f"rank{rank}.err"


def describe_exit(run_dir: Path, rank: int, code: int) -> str:
    """Rank `rank`'s end in one line: its own, the signal that killed it, or its exit status."""
    f = error_file(run_dir, rank)
    if f.is_file() and f.read_text().strip():
        return f.read_text().strip().splitlines()[0]
    if code < 0:
        try:
            return f"rank {rank} was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"rank {rank} was killed by signal {-code}"
    log = run_dir / LOGS_DIR / f"rank{rank}.log"
    if log.is_file() and log.stat().st_size > 0:
        return f"rank {rank} exited with status {code} (see {log})"
    return f"rank {rank} exited with status {code} and left no log (is {run_dir} writable, with space left?)"


def is_stopped(pid: int) -> bool:
    """A process stopped by a signal (state T in /proc): a hung peer."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("T", "t")


def record_pid(logs: Path, rank: int, worker: Worker) -> None:
    """logs/rank{R}.pid: the pid of rank R's current process (rewritten when it is restarted)."""
    files.write_text(logs / f"rank{rank}.pid", f"{worker.pid}\n")


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
