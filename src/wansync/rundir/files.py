"""The one way wansync writes a file (docs/reliability.md, rule 1): what is at the final name is
never written through.

A whole file (`write_bytes`, `write_text`, `save_torch`, `save_figure`, `copy_file`, `copy_tree`) is
written to a temporary name of its own in the same directory (O_EXCL; removed on failure), then
`os.replace` puts it in place: a symbolic link there is replaced, never followed, and a reader never
sees half a file. A line added to a log (`append`) and a file kept in place (`open_in_place`: a lock,
a mark) open with O_NOFOLLOW: a link there is refused. Either way a hard link (another name of the
same file: one wansync renamed into place has one name) or another user's file is refused in one
line (ConfigError) before anything is written, and what the system refuses (a full disk, a
read-only directory) is one line too (StorageError).
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import IO, Any, Callable, Collection, TextIO

from ..errors import ConfigError, StorageError, path_kind

TMP = ".tmp"  # in every temporary name: a writer that died leaves `.NAME.PID.RANDOM.tmp` (`checkpoint.prune`)


def check(path: str | os.PathLike[str]) -> None:
    """A one-line ConfigError when the file at `path` may not be replaced: a hard link, another
    user's file, or no regular file (a directory, a FIFO). Nothing there, or a link: it may."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise _failed(path, e) from None
    if not stat.S_ISLNK(st.st_mode):
        _refuse_foreign(path, st)


def _refuse_foreign(path: str | os.PathLike[str], st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"refusing to write {path}: it is {path_kind(path)}, not a regular file; move it away")
    if st.st_nlink > 1:
        raise ConfigError(
            f"refusing to write {path}: it is a hard link (one of {st.st_nlink} names of the same file), which "
            f"writing would change under its other names; remove it, or copy it to a file of its own"
        )
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"refusing to write {path}: it belongs to another user (uid {st.st_uid}); move it away or run as its owner"
        )


def _failed(path: str | os.PathLike[str], e: OSError, what: str = "") -> StorageError:
    return StorageError(f"cannot write {what + ' ' if what else ''}{path}: {e.strerror or e}")


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP}")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of directory `path` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(path: str | os.PathLike[str], fill: Callable[[IO[bytes]], Any], durable: bool, what: str) -> None:
    """Write `path` whole: `fill` writes a new file, which then takes the name's place."""
    path = Path(path)
    check(path)
    tmp = _tmp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise _failed(path, e, what) from None
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _failed(path, e, what) from None
        raise


def write_bytes(path: str | os.PathLike[str], data: bytes, durable: bool = False, what: str = "") -> None:
    """`data` as the file `path` (module docstring). `durable`: fsynced, and its directory, before
    it returns (a checkpoint); `what` names the file in the error line ("checkpoint")."""
    _replace(path, lambda f: f.write(data), durable, what)


def write_text(path: str | os.PathLike[str], text: str, durable: bool = False, what: str = "") -> None:
    """`text`, UTF-8, as the file `path` (`write_bytes`)."""
    write_bytes(path, text.encode("utf-8"), durable, what)


def save_torch(path: str | os.PathLike[str], obj: Any, durable: bool = False) -> None:
    """`torch.save(obj)` as the file `path`, streamed (a model is not held twice in memory)."""
    import torch

    _replace(path, lambda f: torch.save(obj, f), durable, "")


def save_figure(path: str | os.PathLike[str], fig: Any, **kwargs: Any) -> None:
    """A matplotlib figure as the file `path`, in the format its suffix names (`savefig`'s `kwargs`)."""
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    _replace(path, lambda f: fig.savefig(f, format=fmt, **kwargs), False, "")


def copy_file(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """A copy of the file `src` as the file `dst`."""
    with open(src, "rb") as f:
        _replace(dst, lambda out: shutil.copyfileobj(f, out), False, "")


def copy_tree(src: str | os.PathLike[str], dst: str | os.PathLike[str], skip: Collection[str] = ()) -> None:
    """A copy of directory `src` (its directories and regular files; links, FIFOs and names in `skip`
    left out) as directory `dst`, built under a temporary name beside it, then put in the place of
    whatever `dst` was: a link is replaced, never followed; another user's directory is refused."""
    dst = Path(dst)
    try:
        st = os.lstat(dst)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise _failed(dst, e) from None
    if st is not None and not stat.S_ISLNK(st.st_mode):
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"refusing to replace {dst}: it is {path_kind(dst)}, not a directory; move it away")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"refusing to replace {dst}: it belongs to another user (uid {st.st_uid}); move it away")
    tmp = _tmp_name(dst)
    try:
        os.mkdir(tmp)
        _copy_into(Path(src), tmp, frozenset(skip))
        if st is not None and stat.S_ISLNK(st.st_mode):
            dst.unlink()
        elif st is not None:
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise _failed(dst, e) from None
        raise


def _copy_into(src: Path, out: Path, skip: frozenset[str]) -> None:
    for entry in os.scandir(src):
        if entry.name in skip:
            continue
        if entry.is_dir(follow_symlinks=False):
            os.mkdir(out / entry.name)
            _copy_into(Path(entry.path), out / entry.name, skip)
        elif entry.is_file(follow_symlinks=False):
            copy_file(entry.path, out / entry.name)


def open_in_place(path: str | os.PathLike[str], flags: int = os.O_RDWR, what: str = "") -> int:
    """A descriptor of the file `path`, created if missing, for a file written where it is, not
    replaced (a lock, whose file its holders share; a log): a link there, a hard link, another user's
    file or no regular file (a FIFO: never waited on) is refused in one line."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise ConfigError(
                f"refusing to write {path}: it is a symbolic link (to {os.readlink(path)}), which wansync never "
                f"writes through; remove it"
            ) from None
        if os.path.lexists(path):
            check(path)  # a FIFO without a reader (ENXIO), a directory (EISDIR): said as what they are
        raise _failed(path, e, what) from None
    try:
        _refuse_foreign(path, os.fstat(fd))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def append(path: str | os.PathLike[str]) -> TextIO:
    """The file `path` open for adding lines at its end (UTF-8, each line written as it ends): a
    log, metrics.jsonl. Refused as `open_in_place` says."""
    return os.fdopen(open_in_place(path, os.O_WRONLY | os.O_APPEND), "a", buffering=1, encoding="utf-8")


def fresh(path: str | os.PathLike[str]) -> TextIO:
    """A new empty file in the place of whatever `path` was (`write_bytes`), open as `append` opens it."""
    write_bytes(path, b"")
    return append(path)


def touch(path: str | os.PathLike[str], what: str = "") -> None:
    """The file `path`, empty if it was missing, as it was otherwise: a mark (`open_in_place`)."""
    os.close(open_in_place(path, os.O_WRONLY, what))


def directory(path: str | os.PathLike[str]) -> Path:
    """`path`, a directory wansync writes its own files into (logs/, a checkpoint's step), made if
    missing: a link there is refused, since what it points to is not wansync's."""
    path = Path(path)
    if path.is_symlink():
        raise ConfigError(
            f"refusing to write into {path}: it is a symbolic link (to {os.readlink(path)}), not a directory of "
            f"wansync's; remove it"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(
            f"refusing to write into {path}: it is {path_kind(path)}, not a directory; move it away"
        ) from None
    except OSError as e:
        raise _failed(path, e) from None
    return path
