"""Point-to-point messages between a learner and the syncer (asynchronous DiLoCo): sealed, admitted,
and delivered when the emulated link says.

Why not the run's process group: a gloo group is fixed at its start. A learner that dies breaks its
pair in every group it belongs to, and a restarted process cannot join it again; torchft's
reconfigurable groups re-form only when every member calls `configure` together, which is the
lock-step this strategy removes. So learners and the syncer talk over one TCP connection each, the way
wansync's other channels between hosts do (`trust`): the listener binds --bind's address on a port of
--ports, admits only holders of the run secret, and every message is one sealed payload (tensors plus
JSON under an HMAC checked before parsing; nothing unpickled). A learner that dies closes its
connection, and the syncer stops counting it; one that comes back connects again.

Under the emulator (`--wan`) every message is still modelled on the link of the pair it crosses: the
sender reserves its own emulated link for the message's modelled time on that pair (`net.cost`'s
send between the two ranks, the topology's link at the time it starts, after the transfers already
on the link), and the receiver holds the message until that time has passed. The same link carries
the rank's collectives, so the two queue behind each other as on a real uplink.

    message = sealed {"kind": ..., ..., "link_s": seconds after sending at which it is delivered}
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable

import torch

from ..errors import PeerError
from ..net.cost import collective_duration
from ..net.records import CollectiveRecord
from ..trust import admission
from ..trust.sealed import Sealed, key_for, read_sealed
from ..trust.settings import Trust

USE = "syncer"  # the admission's and the sealed key's use
LIMIT = 1 << 40  # the largest message a peer may announce (checked before anything is allocated)
CONNECT_S = 30.0
ENVELOPE = 512  # a message's bytes besides its tensors, about: the preamble, the JSON header, the tag


class LinkModel:
    """The emulated link from rank `me` to rank `peer` (None: no emulator; messages arrive when TCP
    delivers them)."""

    def __init__(self, emulator: Any, me: int, peer: int, world: int):
        self.emulator, self.me, self.peer, self.world = emulator, me, peer, world
        self.sent = 0
        self.last: CollectiveRecord | None = None  # the last message's record: its sender may add its wait

    def seconds_from_now(self, nbytes: int) -> float:
        """Reserve the link for `nbytes` to the peer; seconds from now until the message is delivered.
        The message is recorded on the emulator as a collective of the sender's is (`record_message`)."""
        if self.emulator is None or self.me == self.peer:
            return 0.0
        now = time.perf_counter()
        topology = self.emulator.topology
        at = self.emulator.run_time(now) if topology.varies else 0.0
        d = collective_duration("send", nbytes, self.world, topology, [self.me, self.peer], 1, at)
        start = self.emulator.reserve(now, d)
        self.last = CollectiveRecord(
            "send", nbytes, "p2p", self.sent, now, start, d, start + d, real_end=now, end=start + d, ready=now
        )
        self.sent += 1
        self.emulator.record_message(self.last)
        return start + d - now


class Channel:
    """One admitted connection: `send` a message, `recv` the next one (held until its modelled arrival)."""

    def __init__(self, sock: socket.socket, key: bytes, link: LinkModel, what: str):
        self.sock, self.key, self.link, self.what = sock, key, link, what
        self.stream = sock.makefile("rb")
        self.lock = threading.Lock()
        self.closed = False

    def send(self, obj: dict[str, Any]) -> int:
        """Seal and write `obj` (its tensors on the CPU); the bytes written. PeerError in one line when
        the peer is gone. Modelled as its tensors' bytes plus an envelope (the header and the tag)."""
        nbytes = ENVELOPE + sum(v.numel() * v.element_size() for v in obj.values() if isinstance(v, torch.Tensor))
        link_s = self.link.seconds_from_now(nbytes)
        sealed = Sealed({**obj, "link_s": link_s, "sent": time.time()}, self.key)
        try:
            with self.lock:
                sealed.write(self.sock)
        except OSError as e:
            raise PeerError(f"{self.what}: the connection is gone ({e.strerror or type(e).__name__})") from None
        return sealed.size

    def recv(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The next message, once its modelled arrival has passed. PeerError in one line when the peer
        closed, sent nothing within `timeout_s` (None: no bound), or this end was closed meanwhile
        (`close` from another thread: the syncer ending while a learner's thread waits here)."""
        try:
            self.sock.settimeout(timeout_s)
            if not self.stream.peek(1):
                raise PeerError(f"{self.what} closed the connection")
            got = read_sealed(self.stream, self.key, self.what, LIMIT)
        except TimeoutError:
            raise PeerError(f"{self.what} sent nothing within {timeout_s:g} s") from None
        except (OSError, ValueError) as e:  # ValueError: "peek of closed file", the stream closed here
            if self.closed:
                raise PeerError(f"{self.what}: the connection was closed here") from None
            if isinstance(e, ValueError):
                raise
            raise PeerError(f"{self.what}: the connection is gone ({e.strerror or type(e).__name__})") from None
        if type(got) is not dict or not isinstance(got.get("kind"), str):
            raise PeerError(f"{self.what}: refused a message that is not one of ours")
        due = float(got.get("sent", 0.0)) + float(got.get("link_s", 0.0))
        wait = due - time.time()
        if wait > 0:
            time.sleep(wait)
        return got

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.stream.close()
        self.sock.close()


def key(trust: Trust) -> bytes:
    return key_for(trust.secret, USE)


def listen(trust: Trust, host: str, handle: Callable[[socket.socket], None]) -> tuple[socket.socket, str]:
    """The syncer's listener on `host` (or --bind's) and a port of --ports, admitting holders of the
    run secret; each connection is handed to `handle` in a thread of its own. (socket, "HOST:PORT")."""
    sock = trust.listen.socket("the syncer", default_host=trust.listen.address or host)
    admission.serve(sock, trust.secret, USE, handle)
    h, p = sock.getsockname()[:2]
    return sock, (f"[{h}]:{p}" if ":" in h else f"{h}:{p}")


def connect(address: str, trust: Trust, wait_s: float = CONNECT_S) -> socket.socket:
    """A connection to the syncer at `address`, admitted; asked again until `wait_s` (the syncer may
    be starting); PeerError in one line when it cannot be reached."""
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise PeerError(
                    f"the syncer at {address} cannot be reached ({e.strerror or type(e).__name__}) within {wait_s:g} s"
                ) from None
            time.sleep(0.05)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if trust.secret is not None:
        admission.enter(sock, trust.secret, USE, address)
    sock.settimeout(None)
    return sock


__all__ = ["Channel", "LinkModel", "USE", "connect", "key", "listen"]
