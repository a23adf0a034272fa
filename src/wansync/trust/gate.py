"""Admission in front of a listener whose protocol is not ours, and the local end of its clients.

c10d's store (the rendezvous, the workers' store) and torchft's lighthouse are servers of C++ and
Rust whose clients cannot run the admission handshake. So with a run secret such a server listens on
loopback only, and a `Gate` listens for it on the run's address: it admits each connection
(`admission`) and then splices its bytes to the server. On every other host its clients connect to a
`Connector` on that host's loopback, which opens the connection to the gate, is admitted, and splices
in turn. A stranger on the network meets the gate and is refused before one byte reaches the server.
The splicing is two threads per connection: these are control channels (keys, heartbeats, quorums),
not bulk data.
"""

from __future__ import annotations

import socket
import threading
import time

from .admission import AdmissionRefused, RefusalLog, close_listener, enter, serve
from .secret import Secret

CHUNK = 1 << 16
CONNECT_S = 10.0
RETRY_S = 0.2


def splice(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways between `a` and `b` until both directions end; then close both."""
    done = threading.Semaphore(0)

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(CHUNK):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            done.release()

    threading.Thread(target=pump, args=(b, a), daemon=True).start()
    pump(a, b)
    done.acquire()
    done.acquire()
    for s in (a, b):
        s.close()


class Gate:
    """Admits every connection to `listener` (bound to the run's address) and splices it to `backend`
    (a server on this host's loopback)."""

    def __init__(self, listener: socket.socket, backend: tuple[str, int], secret: Secret, use: str):
        self.listener, self.backend, self.use = listener, backend, use
        self.log = RefusalLog(use)
        serve(listener, secret, use, self._forward, self.log)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.listener.getsockname()[:2]
        return host, port

    def _forward(self, conn: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.backend, timeout=CONNECT_S)
        except OSError:
            conn.close()
            return
        upstream.settimeout(None)
        splice(conn, upstream)

    def close(self) -> None:
        close_listener(self.listener)


class Connector:
    """A listener on this host's loopback whose every connection is admitted at the gate `remote` and
    spliced to it: a local client (c10d's store, torchft's manager) is pointed at `address`."""

    def __init__(self, remote: tuple[str, int], secret: Secret, use: str):
        self.remote, self.secret, self.use = remote, secret, use
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        serve(self.listener, None, f"{use} (local end)", self._forward)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.listener.getsockname()[:2]
        return host, port

    def check(self, wait_s: float = 60.0) -> None:
        """Be admitted once now: a wrong secret or a stranger at `remote` is one line here, before a
        client of ours would wait out its own timeout against a closed connection. A gate not up yet
        (its host starts later) is asked again for up to `wait_s`, as c10d's own clients do."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                sock = self.open()
            except AdmissionRefused:
                raise
            except OSError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(RETRY_S)
                continue
            sock.close()
            return

    def open(self) -> socket.socket:
        """A connection to the gate, admitted (AdmissionRefused, PeerError in one line otherwise)."""
        where = f"{self.remote[0]}:{self.remote[1]}"
        sock = socket.create_connection(self.remote, timeout=CONNECT_S)
        try:
            enter(sock, self.secret, self.use, where)
        except BaseException:
            sock.close()
            raise
        return sock

    def _forward(self, conn: socket.socket) -> None:
        try:
            upstream = self.open()
        except Exception:  # noqa: BLE001 - the local client sees its connection closed; check() said why
            conn.close()
            return
        splice(conn, upstream)

    def close(self) -> None:
        close_listener(self.listener)
