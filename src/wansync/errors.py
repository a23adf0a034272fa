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
