"""Admission: the HMAC challenge-response every wansync listener runs before anything else.

    server -> client   MAGIC, a fresh 32-byte nonce Ns
    client -> server   MAGIC, its own nonce Nc, HMAC(k, "client" | Ns | Nc)
    server -> client   "A", HMAC(k, "server" | Nc | Ns)          or "R", one line of refusal

k is the secret's key for the listener's use (`Secret.key("admission/<use>")`): an answer made for
the rendezvous is worth nothing at a heal port. A stranger without the secret cannot answer Ns; a
recorded answer is worth nothing at the next connection, whose Ns is new (no replay); the server's
own answer to Nc tells the client that the listener holds the secret too, so that a host posing as a
peer (a heal source, the rendezvous) is refused by the client in turn. Nothing the peer sends is
parsed before the check: the client's message has a fixed size, read with a deadline, so a stranger
that connects and says nothing holds one thread for HANDSHAKE_S at most. A refused peer is told one
line naming its address; the listener logs one line (at most one a second per address) and goes on.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import sys
import threading
import time
from typing import Callable

from ..errors import PeerError
from .secret import Secret

MAGIC = b"WSADM1\n"
NONCE = 32
TAG = 32
HANDSHAKE_S = 10.0
LOG_EVERY_S = 1.0


class AdmissionRefused(PeerError):
    """This process was refused by a listener, or a listener failed to prove it holds the secret."""


def _tag(key: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, role + a + b, hashlib.sha256).digest()


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _name(addr: object) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = str(addr[0])
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    return str(addr)


def admit(sock: socket.socket, secret: Secret, use: str) -> str | None:
    """The server's side on an accepted `sock`: None when the peer proved it holds the secret, else the
    reason it was refused (the peer was told it in one line)."""
    key = secret.key(f"admission/{use}")
    peer = _name(sock.getpeername())
    sock.settimeout(HANDSHAKE_S)
    try:
        ns = os.urandom(NONCE)
        sock.sendall(MAGIC + ns)
        answer = _read(sock, len(MAGIC) + NONCE + TAG)
    except OSError as e:
        return f"no answer within {HANDSHAKE_S:g} s ({e.strerror or type(e).__name__})"
    if len(answer) < len(MAGIC) + NONCE + TAG or not answer.startswith(MAGIC):
        reason = "not a wansync peer (no admission answer)"
    else:
        nc, tag = answer[len(MAGIC) : len(MAGIC) + NONCE], answer[len(MAGIC) + NONCE :]
        if hmac.compare_digest(tag, _tag(key, b"client", ns, nc)):
            sock.sendall(b"A" + _tag(key, b"server", nc, ns))
            sock.settimeout(None)
            return None
        reason = "it does not hold this run's secret (or replayed an old answer)"
    try:
        sock.sendall(f"Rwansync: {use} refused {peer}: {reason}\n".encode())
    except OSError:
        pass
    return reason


def enter(sock: socket.socket, secret: Secret, use: str, where: str) -> None:
    """The client's side on a connected `sock`; AdmissionRefused in one line naming `where` when the
    listener refuses this process or cannot prove that it holds the secret."""
    key = secret.key(f"admission/{use}")
    sock.settimeout(HANDSHAKE_S)
    try:
        hello = _read(sock, len(MAGIC) + NONCE)
        if len(hello) < len(MAGIC) + NONCE or not hello.startswith(MAGIC):
            raise AdmissionRefused(f"{use} at {where} is not a wansync listener with admission (no challenge)")
        ns, nc = hello[len(MAGIC) :], os.urandom(NONCE)
        sock.sendall(MAGIC + nc + _tag(key, b"client", ns, nc))
        verdict = _read(sock, 1)
        if verdict == b"R":
            line = b""
            while not line.endswith(b"\n") and len(line) < 1000:
                c = _read(sock, 1)
                if not c:
                    break
                line += c
            raise AdmissionRefused(line.decode(errors="replace").strip() or f"{use} at {where} refused this host")
        proof = _read(sock, TAG)
    except OSError as e:
        raise AdmissionRefused(f"{use} at {where}: admission failed ({e.strerror or type(e).__name__})") from None
    if verdict != b"A" or not hmac.compare_digest(proof, _tag(key, b"server", nc, ns)):
        raise AdmissionRefused(f"{use} at {where} does not hold this run's secret: refused it")
    sock.settimeout(None)


class RefusalLog:
    """One line per refused peer on stderr, at most one a second per address (a stranger that
    hammers a port does not flood the run's log)."""

    def __init__(self, use: str, out: Callable[[str], None] | None = None):
        self.use, self.lock = use, threading.Lock()
        self.last: dict[str, float] = {}
        self.out = out or (lambda line: print(line, file=sys.stderr, flush=True))
        self.count = 0

    def refused(self, peer: object, reason: str) -> None:
        host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        now = time.monotonic()
        with self.lock:
            self.count += 1
            if now - self.last.get(host, -LOG_EVERY_S) < LOG_EVERY_S:
                return
            self.last[host] = now
        self.out(f"wansync: {self.use} refused a connection from {_name(peer)}: {reason}")


def serve(
    listener: socket.socket,
    secret: Secret | None,
    use: str,
    handle: Callable[[socket.socket], None],
    log: RefusalLog | None = None,
) -> threading.Thread:
    """Accept on `listener` until it is closed; each connection in a thread of its own is admitted
    (with a secret) and then handed to `handle`, which owns it. Returns the accepting thread."""
    log = log or RefusalLog(use)

    def one(conn: socket.socket) -> None:
        try:
            if secret is not None:
                peer = conn.getpeername()
                reason = admit(conn, secret, use)
                if reason is not None:
                    log.refused(peer, reason)
                    conn.close()
                    return
            handle(conn)
        except OSError:
            conn.close()

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the listener is done
                return
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True, name=f"wansync-{use}")
    thread.start()
    return thread


def close_listener(listener: socket.socket) -> None:
    """Stop `serve`'s accepting thread: shut the listening socket down (its accept returns), close it."""
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    listener.close()
