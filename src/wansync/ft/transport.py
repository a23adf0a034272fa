"""torchft's HTTP checkpoint transport, with the fetch of a healing worker retried until its source serves.

In a quorum where a worker heals, torchft (0.2.0) starts the transfer from both ends at once: the
source reconfigures its process group and only then stages its state (`send_checkpoint`), while the
healing worker requests that state as soon as its own reconfiguration ends. On a loaded machine the
request can come first and be refused ("invalid checkpoint requested, serving 75 but got step=80"),
or meet the server while it switches steps and return a cut stream; the heal fails, the worker stays
in the quorum errored, and the survivors' exchanges time out around it. Here a refused or cut fetch
is asked again, a fresh request each time, until the transport's timeout.
"""

from __future__ import annotations

import time
import urllib.error
from datetime import timedelta
from typing import Any

from torchft.checkpointing.http_transport import HTTPTransport

RETRY_EVERY_S = 0.05


class HealTransport(HTTPTransport):
    """`HTTPTransport` whose `recv_checkpoint` waits for the source to serve the step asked for, and
    whose address names `host` (the address a peer reaches this worker at), not this host's name
    (which may resolve to loopback, on the peer's side too)."""

    def __init__(self, timeout: timedelta, num_chunks: int, host: str | None = None):
        self._host = host  # before the server starts: its start logs the address
        super().__init__(timeout=timeout, num_chunks=num_chunks)

    def address(self) -> str:
        if self._host is None:
            return super().address()
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                return super().recv_checkpoint(src_rank, metadata, step, timeout)
            except (urllib.error.HTTPError, ValueError, EOFError, RuntimeError) as exc:
                if not retriable(exc) or time.monotonic() + RETRY_EVERY_S >= deadline:
                    raise
            time.sleep(RETRY_EVERY_S)


def retriable(exc: BaseException) -> bool:
    """A source not serving the step yet (HTTP 400), or a stream cut short while it switched."""
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code == 400 and "invalid checkpoint requested" in str(exc.reason)
    return True
