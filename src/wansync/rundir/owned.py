"""Files wansync writes into a directory that may hold files of others (a report's directory): it
replaces such a file only when it wrote it, and it can check that.

Every file written there is recorded, with its SHA-256, in the directory's `WRITTEN_FILE`. A file of
one of those names that the record lacks, or whose content changed since (a report.md of your own,
a CSV edited by hand, a link to somewhere else), is not wansync's: it is refused in one line,
before any work, unless `force`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

from ..errors import ConfigError
from . import files
from .jsonout import dumps
from .layout import json_object

WRITTEN_FILE = ".wansync-written.json"


def check_replaceable(directory: Path, names: Iterable[str], force: bool) -> None:
    """A one-line ConfigError naming the first of `names` in `directory` that wansync did not write
    (or that changed since it did), or that no one may replace, `force` or not (a hard link, another
    user's file: `files.check`); nothing is written. A link `force` replaces, never writes through."""
    record = {} if force else _record(directory)
    for name in names:
        path = directory / name
        if (
            not force
            and os.path.lexists(path)
            and (path.is_symlink() or not path.is_file() or record.get(name) != _sha256(path))
        ):
            raise ConfigError(
                f"refusing to replace {path}: wansync did not write it (or it changed since); move it "
                f"away, choose another directory, or pass --force to replace it"
            )
        files.check(path)


def record_written(directory: Path, paths: Iterable[Path]) -> None:
    """Record `paths`, files just written into `directory`, as wansync's."""
    record = _record(directory)
    record.update({p.name: _sha256(p) for p in paths if p.is_file()})
    files.write_text(directory / WRITTEN_FILE, dumps(record, indent=1, sort_keys=True))


def _record(directory: Path) -> dict[str, str]:
    return {k: v for k, v in json_object(directory / WRITTEN_FILE).items() if isinstance(v, str)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return ""
    return h.hexdigest()
