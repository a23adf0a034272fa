"""Signals and process lifetimes: a launcher ends its workers, and workers never outlive it.

The launcher turns SIGTERM into an exception (`Terminated`), as Python does SIGINT into
KeyboardInterrupt, so the same `finally` that reaps the workers after a failure also reaps
them after a signal; the CLI then prints one line and exits 128 + the signal number. A worker
leaves interrupts to its launcher (SIGINT is ignored from the moment it exists: the launcher
blocks it around the spawn and the mask survives exec), dies at once on the SIGTERM the
launcher forwards, and asks the kernel to SIGKILL it when the launcher dies (Linux
PR_SET_PDEATHSIG), checking afterwards that the launcher had not died already.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from typing import Callable, Iterator

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
LAUNCHER_PID_ENV = "WANSYNC_LAUNCHER_PID"


class Terminated(BaseException):
    """SIGTERM arrived: like KeyboardInterrupt, not an error of the run (`except Exception` lets it through)."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_status(exc: BaseException) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (130, 143)."""
    signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
    return 128 + int(signum)


def _raise_terminated(signum: int, frame: object) -> None:
    signal.signal(signum, signal.SIG_IGN)  # a second SIGTERM must not cut the reaping short
    raise Terminated(signum)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises Terminated in the main thread (elsewhere: no change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_deferred() -> Iterator[Callable[[], None]]:
    """Within the block, a SIGINT or SIGTERM that would raise (KeyboardInterrupt, Terminated) is
    recorded instead; the yielded `check()` raises it where the caller calls it. A second signal
    while the caller ends its work cannot cut that short. Elsewhere than the main thread, and for a
    signal whose handler would not raise (ignored, default, the caller's own): no change."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    raising = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: _raise_terminated}
    received: list[int] = []
    previous = {s: signal.getsignal(s) for s in raising}
    for s, handler in raising.items():
        if previous[s] is handler:
            signal.signal(s, lambda signum, frame: received.append(signum))

    def check() -> None:
        if received:
            raise KeyboardInterrupt if received[0] == signal.SIGINT else Terminated(received[0])

    try:
        yield check
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """Block SIGINT in this thread: a process started within inherits the mask through exec."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def exit_now(code: int) -> None:
    """Exit with `code`. Threads still watching runs (a parallel sweep) are not waited for:
    their workers die with this process through their death signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if threading.active_count() > 1:
        os._exit(code)
    sys.exit(code)


def become_launched_worker() -> None:
    """First thing in a worker the launcher started: leave SIGINT to the launcher, and die with it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    die_with(int(os.environ.get(LAUNCHER_PID_ENV, "0")))


def die_with(launcher: int) -> None:
    """Arm SIGKILL for when the parent dies (Linux), and exit now if it is not `launcher` any more
    (it died before the death signal was armed). `launcher` 0: no check."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if launcher and os.getppid() != launcher:
        os._exit(1)
