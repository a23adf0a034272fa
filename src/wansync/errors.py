"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""

from __future__ import annotations

import os
import stat


class WansyncError(Exception):
    """Base of every error whose message is meant for the user, verbatim, on one line."""


class ConfigError(WansyncError):
    """An invalid option value, config key or config file."""


class DataError(WansyncError):
    """Missing, malformed or unsupported data."""


class PeerError(WansyncError):
    """A peer worker died, hung or disagreed (e.g. chose another fragment)."""


class NonFiniteError(WansyncError):
    """A NaN or Inf reached a loss, gradient or pseudo-gradient under --on-nonfinite abort."""


class StorageError(WansyncError):
    """The run directory cannot be written (a full disk, a missing permission)."""


def check(ok: bool, message: str) -> None:
    """Validation of a value a user gave: a one-line ConfigError when `ok` is false."""
    if not ok:
        raise ConfigError(message)


# How a worker words a failure that is the consequence of another rank's, never its cause: the
# launcher reports the cause instead when it has one.
PEER_LOST = "lost contact with a peer"


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (its type's name when it has none), for a one-line error."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


MAX_LINE = 1000  # characters of an error line: it may echo a value a user gave, of any size


def one_line(message: str) -> str:
    """`message` as the one line a user sees: line breaks escaped (a value may hold them), and at
    most MAX_LINE characters (a value may be 50 MB)."""
    text = message.replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= MAX_LINE else f"{text[:MAX_LINE]}... ({len(text)} characters)"


def path_kind(path: object) -> str:
    """What is at `path`, for a message that says why it cannot be used: "a directory", "a FIFO"..."""
    try:
        mode = os.stat(path).st_mode  # type: ignore[arg-type]
    except OSError:
        return "missing or unreadable"
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def user_text(path: "os.PathLike[str] | str", what: str, max_bytes: int = 1 << 20) -> str:
    """The text of a file a user named (`what`: "config file", "topology file"), or one line that
    says why it cannot be one: not there, not a regular file (a directory, /dev/null, a FIFO, which
    would block the reader), unreadable, larger than `max_bytes`, not UTF-8. A UTF-8 byte-order mark,
    which some editors write, is dropped. A symbolic link is followed: the file is only read."""
    p = os.fspath(path)
    try:
        if not os.path.exists(p):
            raise ConfigError(f"{what} not found: {p}")
        if not os.path.isfile(p):
            raise ConfigError(f"{what} {p} is {path_kind(p)}, not a regular file")
        size = os.stat(p).st_size
        if size > max_bytes:
            raise ConfigError(f"{what} {p} is too large for a {what} ({size} bytes; at most {max_bytes})")
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ConfigError(f"cannot read {what} {p}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {p} is not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None
