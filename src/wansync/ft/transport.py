"""The heal transport: a healing worker fetches a live peer's state, sealed (`trust.sealed`), from a
server on the run's address, behind admission.

torchft's own transport (HTTP) unpickles what it receives, so any host that reaches its port runs
code in the healing worker, and it listens on every interface. This one keeps torchft's protocol
(`CheckpointTransport`: the source stages its state with `send_checkpoint`, the healing worker
fetches it from the address in the source's `metadata()`) over a plain TCP exchange, one connection
per fetch:

    client -> server   admission (with a run secret: `trust.admission`), then one line {"step": N}
    server -> client   "ok\\n" and the sealed {"step": N, "state": ...}   or "no <reason>\\n"

The server binds the worker's advertised address (or --bind's) on a port of --ports
(`trust.listen`), never every interface; the payload is sealed with the secret's "sealed/heal" key
(the public key without a secret: corruption is still caught) and checked before anything of it is
parsed; the healing worker accepts only the step it asked for.

The race this keeps handling: in a quorum where a worker heals, torchft (0.2.0) starts the transfer
from both ends at once: the source reconfigures its process group and only then stages its state,
while the healing worker asks as soon as its own reconfiguration ends. On a loaded machine the
request can come first (the source still serves an older step, or none), or meet a stream cut
short; a payload can fail its tag. Each is asked again, a fresh request each time, until the
transport's timeout, and then one line says why the heal failed.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
from torchft.checkpointing.transport import CheckpointTransport
from torchft.utils import get_stream_context

from ..errors import PeerError, one_line
from ..rundir.checkpoint import map_tensors
from ..trust import admission, listen, secret
from ..trust.sealed import Sealed, SealError, key_for, read_sealed
from ..trust.settings import Trust, current

USE = "heal"  # the admission's and the sealed key's use
RETRY_EVERY_S = 0.05
REQUEST_BYTES = 256  # the request line's most
REPLY_LINE = 1000  # the reply line's most
REQUEST_S = 10.0  # the server waits this long for a request line


class HealTransport(CheckpointTransport[dict[str, Any]]):
    """This worker's heal server (what a healing peer fetches) and its client (what it fetches when it
    heals). `host`: the address peers reach this worker at (a name is resolved: the server binds the
    address, never a wildcard, unless --bind names another); `trust`: the run secret, --bind and
    --ports (None: this process's, `trust.settings.current()`)."""

    def __init__(self, timeout: timedelta, host: str, trust: Trust | None = None):
        trust = trust or current()
        self._timeout = timeout
        self._secret = trust.secret
        self._key = key_for(self._secret, USE)
        self._lock = threading.Condition()
        self._staged: tuple[int, Sealed] | None = None  # the step served and its payload
        self._sending = 0
        self.corrupt_next = 0  # fault injection (`trainer.faults` flip_heal): payloads sent with a byte flipped
        self._stream = (
            torch.Stream(torch.accelerator.current_accelerator()) if torch.accelerator.is_available() else None
        )
        self._listener = trust.listen.socket(
            "heal server", default_host=trust.listen.address or listen.address_of(host, "heal server")
        )
        self._accepting = admission.serve(self._listener, self._secret, USE, self._serve_one)

    def metadata(self) -> str:
        """HOST:PORT of the server ([HOST]:PORT for IPv6), the address it is bound to."""
        host, port = self._listener.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta) -> None:
        """Serve `state_dict` as `step` from now on, its tensors on the CPU (copied from an accelerator
        on a stream of their own, as torchft's transport did)."""
        with get_stream_context(self._stream):
            state = map_tensors(state_dict, lambda t: t.cpu() if t.device.type in ("cuda", "xpu") else t)
            if self._stream is not None:
                self._stream.synchronize()
        sealed = Sealed({"step": step, "state": state}, self._key)
        with self._lock:
            self._staged = (step, sealed)

    def disallow_checkpoint(self) -> None:
        """Serve nothing more; return once the payloads being sent are out (or the timeout passed)."""
        with self._lock:
            self._staged = None
            self._lock.wait_for(lambda: self._sending == 0, timeout=self._timeout.total_seconds())

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict[str, Any]:
        """The state the source at `metadata` serves as `step`, asked again while it is not served
        yet, cut short or refused by its tag; PeerError in one line at the timeout."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                return fetch(metadata, step, self._secret, self._key, deadline)
            except (Again, SealError) as exc:
                last = exc
                if isinstance(exc, SealError):  # corrupted or forged on the way: said, then asked again
                    print(f"wansync: {one_line(str(exc))}; asking again", file=sys.stderr, flush=True)
            if time.monotonic() + RETRY_EVERY_S >= deadline:
                raise PeerError(f"heal from {metadata} failed within {timeout.total_seconds():g} s: {last}") from None
            time.sleep(RETRY_EVERY_S)

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            self._staged = None
        admission.close_listener(self._listener)
        if wait:
            self._accepting.join(timeout=self._timeout.total_seconds())

    def _serve_one(self, conn: socket.socket) -> None:
        """One fetch on an admitted connection: the staged payload if it is the step asked for."""
        with conn:
            conn.settimeout(REQUEST_S)
            step = read_request(conn)
            with self._lock:
                staged = self._staged
                if step is None:
                    reason = "a malformed request"
                elif staged is None:
                    reason = f"not serving step {step}: no state staged"
                elif staged[0] != step:
                    reason = f"not serving step {step}: serving {staged[0]}"
                else:
                    reason = ""
                    self._sending += 1
            if reason:
                conn.sendall(f"no {reason}\n".encode())
                return
            assert staged is not None
            try:
                conn.settimeout(self._timeout.total_seconds())
                conn.sendall(b"ok\n")
                with self._lock:
                    flip, self.corrupt_next = self.corrupt_next > 0, max(0, self.corrupt_next - 1)
                if flip:
                    send_flipped(conn, staged[1])
                else:
                    staged[1].write(conn)
            finally:
                with self._lock:
                    self._sending -= 1
                    self._lock.notify_all()


def send_flipped(conn: socket.socket, payload: Sealed) -> None:
    """`payload` with its middle byte flipped on the way (fault injection): what a corrupted transfer
    delivers, which the healing peer must refuse by its tag."""
    sent, middle = 0, payload.size // 2
    for part in payload.chunks():
        if sent <= middle < sent + len(part):
            corrupted = bytearray(part)
            corrupted[middle - sent] ^= 0xFF
            part = corrupted
        conn.sendall(part)
        sent += len(part)


class Again(PeerError):
    """A fetch to ask again: the source does not serve the step yet, or the stream was cut."""


def fetch(address: str, step: int, run_secret: secret.Secret | None, key: bytes, deadline: float) -> dict[str, Any]:
    """One request for `step` to the heal server at `address` (HOST:PORT); its state. Again or
    SealError when asking again may succeed; PeerError (admission refused, no server) when not."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=left(deadline))
    except OSError as exc:
        raise PeerError(f"heal source {address}: cannot connect ({exc.strerror or type(exc).__name__})") from None
    with sock:
        if run_secret is not None:
            admission.enter(sock, run_secret, USE, address)
        try:
            sock.settimeout(left(deadline))
            sock.sendall(json.dumps({"step": step}).encode() + b"\n")
            with sock.makefile("rb") as reply:
                got = receive(reply, address, key)
        except OSError as exc:  # a timeout, a reset: the source may be switching steps
            raise Again(f"the stream was cut ({exc.strerror or type(exc).__name__})") from None
    if (
        type(got) is not dict
        or type(got.get("step")) is not int
        or got["step"] != step
        or type(got.get("state")) is not dict
    ):
        raise SealError(f"the heal state from {address}: refused: not the state of step {step}")
    return got["state"]


def receive(reply: Any, address: str, key: bytes) -> Any:
    """The sealed object that follows an "ok" line; Again for a "no" line or a cut stream."""
    line = reply.readline(REPLY_LINE)
    if line == b"ok\n":
        return read_sealed(reply, key, f"the heal state from {address}", limit=memory_bytes())
    if line.startswith(admission.MAGIC):
        raise PeerError(
            f"heal source {address} admits only holders of the run secret, and this worker has none "
            f"(set {secret.ENV}, or --secret-file)"
        )
    if line.startswith(b"no "):
        raise Again(f"the source answered: {one_line(line[3:].decode(errors='replace').strip())}")
    raise Again("the stream was cut" if not line else "not a heal server's answer")


def read_request(conn: socket.socket) -> int | None:
    """The step of a request line, {"step": N}; None for anything else (or nothing in REQUEST_S)."""
    line = b""
    try:
        while not line.endswith(b"\n") and len(line) < REQUEST_BYTES:
            chunk = conn.recv(REQUEST_BYTES - len(line))
            if not chunk:
                return None
            line += chunk
        request = json.loads(line)
    except (OSError, ValueError):
        return None
    step = request.get("step") if type(request) is dict else None
    return step if type(step) is int else None


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of HOST:PORT or [HOST]:PORT; PeerError in one line otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise PeerError(f"heal source {address!r}: not an address HOST:PORT")
    return host.removeprefix("[").removesuffix("]"), int(port)


def left(deadline: float) -> float:
    """Seconds to `deadline`, at least a moment (an attempt started is given a chance)."""
    return max(0.1, deadline - time.monotonic())


def memory_bytes() -> int:
    """This host's memory: a heal payload announced larger is refused before anything is allocated."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
