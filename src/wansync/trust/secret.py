"""The run secret: a file only its owner can read, shared by every host of a run.

A run with a secret admits only peers that prove they hold it (`admission`) and accepts only payloads
it authenticates (`sealed`). It is given as a file (`--secret-file PATH`, or `WANSYNC_SECRET_FILE` for
a user's own loop and for the processes a command starts), never as a value on the command line,
where every user of the host would read it in `ps`. Each use gets a key of its own, derived from the
secret by HMAC with the use's name, so that an answer made for one listener is worth nothing at
another.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

ENV = "WANSYNC_SECRET_FILE"
MIN_BYTES = 32  # 256 bits: an HMAC-SHA256 key of full strength
FLAG = "--secret-file"
MAKE_ONE = "make one with: (umask 077; head -c 32 /dev/urandom | base64 > run.secret)"


@dataclass(frozen=True)
class Secret:
    """The secret's bytes and where they came from (said in messages, never the bytes)."""

    path: str
    value: bytes = field(repr=False)

    def key(self, use: str) -> bytes:
        """The key of one use (`admission/rendezvous`, `sealed/heal`, ...)."""
        return hmac.new(self.value, b"wansync/" + use.encode(), hashlib.sha256).digest()

    def fingerprint(self) -> str:
        """Names the secret in a log without revealing it: nodes that disagree show different ones."""
        return self.key("fingerprint").hex()[:12]


def load(path: str | os.PathLike[str], source: str = FLAG) -> Secret:
    """The secret in `path`; one line naming `source` (the flag or the variable) when the file is
    missing, not a regular file, empty, shorter than MIN_BYTES, or readable by anyone but its owner."""
    where = Path(path).expanduser()
    try:
        st = os.stat(where)
    except OSError as e:
        raise ConfigError(f"{source} {path}: cannot read the run secret ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{source} {path}: the run secret must be a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(
            f"{source} {path}: the run secret is readable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"chmod 600 it"
        )
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{source} {path}: the run secret belongs to another user (uid {st.st_uid})")
    try:
        value = where.read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"{source} {path}: cannot read the run secret ({e.strerror or e})") from None
    if not value:
        raise ConfigError(f"{source} {path}: the run secret is empty; {MAKE_ONE}")
    if len(value) < MIN_BYTES:
        raise ConfigError(f"{source} {path}: the run secret has {len(value)} bytes, fewer than {MIN_BYTES}; {MAKE_ONE}")
    return Secret(str(where), value)


def from_env(environ: os._Environ[str] | dict[str, str] | None = None) -> Secret | None:
    """The secret named by WANSYNC_SECRET_FILE (None when it is unset or empty)."""
    name = (os.environ if environ is None else environ).get(ENV, "")
    return load(name, ENV) if name else None


def refuse_on_command_line(argv: list[str]) -> None:
    """A secret given as a value (`--secret VALUE`, `--secret=VALUE`, `--run-secret ...`) is refused
    before anything else reads the command line: `ps` shows it to every user of the host."""
    for arg in argv:
        name = arg.split("=", 1)[0]
        if name in ("--secret", "--run-secret", "--secret-key"):
            raise ConfigError(
                f"{name}: a secret on the command line is visible to every user of this host (ps); "
                f"put it in a file only you can read and pass {FLAG} PATH (or set {ENV})"
            )
