"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""


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
