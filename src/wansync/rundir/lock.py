"""One writer per run directory: an exclusive `flock` on RUN_DIR/.lock for the lifetime of a run.

The lock belongs to the launching process (or rank 0 under torchrun) and dies with it, so a
crashed run never leaves a stale lock behind. The file holds the holder's PID, which a second
command names in its one-line refusal.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from ..errors import ConfigError
from . import files

LOCK_FILE = ".lock"


class RunBusy(ConfigError):
    """Another live process holds the directory: nothing in it may be touched."""


def _holder_pid(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    except OSError:
        return "unknown"


class RunLock:
    """`with RunLock(run_dir):` holds the run directory, or raises a one-line ConfigError naming
    the PID that holds it. The directory must exist."""

    def __init__(self, run_dir: Path, what: str = "train into"):
        self.path = Path(run_dir) / LOCK_FILE
        self.what = what
        self.fd: int | None = None

    def __enter__(self) -> "RunLock":
        fd = files.open_in_place(self.path)  # one line: a link there, a read-only file system, a missing permission
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder_pid(fd)
            os.close(fd)
            raise RunBusy(
                f"cannot {self.what} {self.path.parent}: another wansync process (PID {pid}) " f"is running in it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock; the file stays (harmless)
            self.fd = None


def check_unlocked(run_dir: Path, what: str) -> None:
    """A one-line ConfigError when a live process holds `run_dir` (nothing is created)."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunBusy(
            f"cannot {what} {path.parent}: another wansync process (PID {_holder_pid(fd)}) " f"is running in it"
        ) from None
    finally:
        os.close(fd)
