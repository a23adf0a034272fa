"""torchft's lighthouse for a fault-tolerant run, in a process of its own.

The lighthouse is a Rust server with threads of its own. Hosted in the launcher, those threads
would keep the launcher from forking its workers (`workerproc.can_fork`), and every worker of a
fault-tolerant run would start as a fresh interpreter, seconds of importing torch each. So a
single-threaded launcher forks a child that does nothing but serve the lighthouse and report its
address through a pipe; the child dies with the launcher (death signal) and is ended by it. A
launcher that cannot fork (other threads, no fork) hosts the server itself, as before.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import traceback

from ..runner import workerproc
from ..runner.interrupts import die_with, sigint_blocked
from ..trust.gate import Gate
from ..trust.listen import Listen
from ..trust.settings import Trust

START_TIMEOUT_S = 60.0  # for the child's torchft import and the server's bind


class ServedLighthouse:
    """A lighthouse served by a forked child of this process."""

    def __init__(self, pid: int, address: str):
        self.process = workerproc.ForkedWorker(pid)
        self._address = address

    def address(self) -> str:
        return self._address

    def shutdown(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # it did not end on SIGTERM
            self.process.kill()
            self.process.wait()


def start(join_timeout_ms: int, heartbeat_timeout_ms: int, host: str = "127.0.0.1", trust: Trust | None = None):
    """A lighthouse on `host` (127.0.0.1; the address the other hosts reach, for workers on other
    hosts) at a port of the run's range, with these timeouts; `.address()` and `.shutdown()`. With a
    run secret the lighthouse itself listens on loopback and a gate on `host` admits (`trust.gate`)."""
    trust = trust or Trust(None, Listen())
    kwargs = dict(min_replicas=1, join_timeout_ms=join_timeout_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)
    if not workerproc.can_fork():
        return Guarded(host, trust, kwargs)
    read_end, write_end = os.pipe()
    parent = os.getpid()
    sys.stdout.flush()  # or the child would write this buffer again
    sys.stderr.flush()
    with sigint_blocked():  # ctrl-C is the launcher's: the child ignores it
        pid = os.fork()
        if not pid:
            _serve(read_end, write_end, parent, host, trust, kwargs)
    os.close(write_end)
    try:
        address = _read_line(read_end, START_TIMEOUT_S)
    finally:
        os.close(read_end)
    if not address:
        served = ServedLighthouse(pid, "")
        served.shutdown()
        raise RuntimeError(
            f"torchft's lighthouse did not start within {START_TIMEOUT_S:g} s "
            f"(exit status {served.process.returncode})"
        )
    return ServedLighthouse(pid, address)


class Guarded:
    """torchft's lighthouse on `host` at a port of the range; with a run secret, on loopback behind a
    gate on `host` that admits, whose address is the lighthouse's for the workers."""

    def __init__(self, host: str, trust: Trust, kwargs: dict):
        from torchft.coordination import LighthouseServer

        self.gate: Gate | None = None
        if trust.secret is None:
            self.server = LighthouseServer(bind=_hostport(host, trust.listen.port("lighthouse")), **kwargs)
            self._address = self.server.address()
            return
        self.server = LighthouseServer(bind="127.0.0.1:0", **kwargs)
        backend = int(self.server.address().rsplit(":", 1)[1])
        self.gate = Gate(
            trust.listen.socket("lighthouse", default_host=host), ("127.0.0.1", backend), trust.secret, "lighthouse"
        )
        gate_host, gate_port = self.gate.address
        self._address = f"http://{_hostport(gate_host, gate_port)}"

    def address(self) -> str:
        return self._address

    def shutdown(self) -> None:
        if self.gate is not None:
            self.gate.close()
        self.server.shutdown()


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _serve(read_end: int, write_end: int, parent: int, host: str, trust: Trust, kwargs: dict) -> None:
    """The child: serve until SIGTERM or the parent's death; never returns."""
    try:
        os.close(read_end)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        die_with(parent)
        server = Guarded(host, trust, kwargs)
        os.write(write_end, server.address().encode() + b"\n")
        os.close(write_end)
        while True:
            signal.pause()
    except BaseException:  # noqa: BLE001 - the child must end here whatever happens
        traceback.print_exc()
    finally:
        os._exit(1)


def _read_line(fd: int, timeout_s: float) -> str:
    """One line from the pipe `fd`; "" on EOF (the child died) or after `timeout_s`."""
    data, deadline = b"", time.monotonic() + timeout_s
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return ""
        chunk = os.read(fd, 4096)
        if not chunk:
            return ""
        data += chunk
    return data.decode().strip()
