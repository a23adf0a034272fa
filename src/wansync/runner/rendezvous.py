"""`torchrun --rdzv-backend wansync`: torch's c10d rendezvous, with the two guesses it makes from
host names replaced by what the routes say.

torch's c10d backend hosts its store on the node whose host name or addresses match the endpoint
and advertises each node by `socket.getfqdn()`. On hosts whose names resolve to 127.0.0.1 neither
guess holds: no node hosts the store (every agent times out), and node 0 tells the others to meet
its workers at `localhost`. Here:

- the store is hosted by the node that owns the endpoint's address (a socket can be bound to it),
  unless `--rdzv-conf is_host=...` says otherwise; where several agents own it (two nodes on one
  machine), the first to bind the endpoint's port hosts and the others join it as clients;
- a node is advertised by the source address of its route to the endpoint (`runner.route`), unless
  `--local-addr` is given: an address the other nodes reach it at, whatever its name resolves to.

And one thing c10d does not do: **a node that comes back takes its own place again** (`LateJoin`).
A host that died whole (agent and workers) and whose torchrun command is started again finds the run
formed and training; under c10d it would wait for a next round, and the agents of the live nodes would
restart their own workers to hold one (every worker of the run from step 0). Here it takes the place of
the node that is gone (one of its own address whose agent has stopped heartbeating), with that node's
rank and world, in the round the others trained in: nobody else restarts, its workers rejoin the run
(a fault-tolerant run's heal from a live peer; any other run's refuse in one line,
`runner.agreement`), and its agent meets the others in torchrun's exit barrier. A node that finds no
such place goes through c10d as before.

Everything else is c10d's. Registered through the `torchrun.handlers` entry point (pyproject.toml).
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any, Callable

from ..errors import WansyncError, first_line, one_line
from ..trust.admission import AdmissionRefused
from ..trust.gate import Connector, Gate
from ..trust.listen import Listen, address_of
from ..trust.settings import AGENTS_ENV, Trust, current
from .route import owns, route_to

NAME = "wansync"
DEFAULT_PORT = 29400
REJOINED_ENV = "WANSYNC_REJOINED"  # set in a rejoining agent's environment: its workers inherit it
GONE_AFTER_S = 3.0  # an agent whose heartbeat did not move for this long is gone (it beats every 0.1 s)


def handler() -> Callable[[Any], Any]:
    """The entry point torchrun loads: it returns the handler's factory."""
    return create_handler


def create_handler(params: Any) -> Any:
    """A c10d rendezvous handler for torchrun's `RendezvousParameters`, host and address decided by
    the routes (module docstring)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as c10d_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    class Backend(C10dRendezvousBackend):
        """c10d's, under this backend's name (torchrun checks that the handler is the one asked for)."""

        @property
        def name(self) -> str:
            return NAME

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    trust = agents_trust(port)
    if not params.local_addr:
        params.local_addr = trust.listen.address or advertised_address(host)
    served = Served()
    if params.get("store_type", "tcp").strip().lower() != "tcp":  # a file store: c10d's own
        if trust.secret is not None:
            raise _connection_error("a run secret needs the TCP store (store_type=tcp): a file store admits anyone")
        _, store = create_backend(params)
    else:
        store, served = rendezvous_store(
            host,
            port,
            params.get_as_bool("is_host"),
            timedelta(seconds=params.get_as_int("read_timeout", 60) or 60),
            trust,
        )
    inner = c10d_handler(store, Backend(store, params.run_id), params)
    if trust.secret is not None or trust.listen.address:
        # c10d's rank 0 would serve its workers a store of its own, on every interface: they share the
        # agents' store instead, reached where this node reaches it (`Served.workers_store`)
        setattr(inner, "_create_tcp_store_server", lambda addr, port: store)  # noqa: B010 - torch's private hook
        served.endpoint = (host, port)
    return LateJoin(inner, store, params.run_id, params.local_addr, served)


def agents_trust(port: int) -> Trust:
    """The settings the agents were started with (`trust.settings`: WANSYNC_SECRET_FILE, WANSYNC_BIND,
    WANSYNC_PORTS in torchrun's environment), told to the workers (`AGENTS_ENV`) so that each can
    check them against its own; a bad one, or an endpoint port outside the range, is one line."""
    try:
        trust = current()
    except WansyncError as e:
        raise _connection_error(str(e)) from None
    ports = trust.listen.ports
    if ports is not None and not ports[0] <= port <= ports[1]:
        raise _connection_error(f"the rendezvous endpoint's port {port} is outside WANSYNC_PORTS {ports[0]}-{ports[1]}")
    os.environ[AGENTS_ENV] = json.dumps(trust.describe())
    return trust


def _connection_error(message: str) -> Exception:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    return RendezvousConnectionError(f"wansync rendezvous: {message}")


def _rendezvous_api() -> Any:
    from torch.distributed.elastic.rendezvous import api

    return api


class LateJoin:
    """c10d's handler, and a place again for a node that comes back (module docstring). What the
    members record, in the rendezvous store under `wansync/rdzv/<run id>/`: per round the world
    (`formed`, by rank 0: round, world size, where the workers' store is) and per rank its address
    and a heartbeat (a counter each agent adds to at every check torchrun makes, 10 a second). The
    store the agents get is this round's prefix of it, so that a node that takes a place meets the
    others' keys (its ranks as torchrun assigned them, the exit barrier)."""

    def __init__(self, inner: Any, store: Any, run_id: str, local_addr: str | None, served: "Served | None" = None):
        self.inner, self.raw, self.run_id, self.addr = inner, store, run_id, local_addr or ""
        self.served = served or Served()  # the gate or the local end a run secret puts before the store
        self.ns = f"wansync/rdzv/{run_id}"
        self.rank: int | None = None
        self.round = 0
        self.joined = False

    # ---- what torchrun asks -------------------------------------------------------------------
    def get_backend(self) -> str:
        return NAME

    @property
    def use_agent_store(self) -> bool:
        return bool(self.inner.use_agent_store)

    def get_run_id(self) -> str:
        return str(self.inner.get_run_id())

    def is_closed(self) -> bool:
        return bool(self.inner.is_closed())

    def set_closed(self) -> None:
        self.inner.set_closed()

    def shutdown(self) -> bool:
        return bool(self.inner.shutdown()) if self.joined else True

    def num_nodes_waiting(self) -> int:
        if self.rank is not None:
            try:
                self.raw.add(f"{self.ns}/r{self.round}/alive/{self.rank}", 1)
            except RuntimeError:  # the store's host is gone: c10d's own check says so below
                pass
        return int(self.inner.num_nodes_waiting()) if self.joined else 0

    def next_rendezvous(self) -> Any:
        if not self.joined and self.rank is None:
            place = self.vacant_place()
            if place is not None:
                return self.take(*place)
        api = _rendezvous_api()
        self.raw.delete_key(f"{self.ns}/formed")  # a round is forming: a late node goes through c10d
        info = self.inner.next_rendezvous()
        self.joined, self.rank = True, info.rank
        if info.rank == 0:
            self.round = self.raw.add(f"{self.ns}/rounds", 1)
            boot = info.bootstrap_store_info
            formed = {
                "round": self.round,
                "world_size": info.world_size,
                "master_addr": getattr(boot, "master_addr", None),
                "master_port": getattr(boot, "master_port", None),
            }
            self.raw.set(f"{self.ns}/formed", json.dumps(formed))
        else:
            self.round = json.loads(self.raw.get(f"{self.ns}/formed"))["round"]
        self.raw.set(f"{self.ns}/r{self.round}/member/{info.rank}", self.addr)
        self.raw.add(f"{self.ns}/r{self.round}/alive/{info.rank}", 1)
        boot = self.served.workers_store(info.bootstrap_store_info)
        return api.RendezvousInfo(self.round_store(), info.rank, info.world_size, boot)

    # ---- a node that comes back -----------------------------------------------------------------
    def round_store(self) -> Any:
        import torch.distributed as dist

        return dist.PrefixStore(f"{self.ns}/r{self.round}/agents", self.raw)

    def formed(self) -> dict[str, Any] | None:
        try:
            if not self.raw.check([f"{self.ns}/formed"]):
                return None
            return dict(json.loads(self.raw.get(f"{self.ns}/formed")))
        except (RuntimeError, ValueError):
            return None

    def vacant_place(self) -> tuple[dict[str, Any], int] | None:
        """The formed round and the rank of a node of this address that is gone; None when the run is
        not formed (a first start) or every node of this address is alive."""
        formed = self.formed()
        if formed is None or not formed.get("master_addr"):
            return None
        r, world = formed["round"], int(formed["world_size"])
        mine = [
            k
            for k in range(1, world)  # node 0 hosts the store: it cannot have gone and left it
            if self.raw.check([f"{self.ns}/r{r}/member/{k}"])
            and self.raw.get(f"{self.ns}/r{r}/member/{k}").decode() == self.addr
        ]
        if not mine:
            return None
        beats = {k: self.raw.add(f"{self.ns}/r{r}/alive/{k}", 0) for k in mine}
        time.sleep(GONE_AFTER_S)
        gone = [k for k in mine if self.raw.add(f"{self.ns}/r{r}/alive/{k}", 0) == beats[k]]
        return (formed, gone[0]) if gone else None

    def take(self, formed: dict[str, Any], rank: int) -> Any:
        """Rank `rank`'s place in the formed round: its rank and world, the round's store, the workers'
        store where rank 0 serves it; the workers learn that they rejoin (`REJOINED_ENV`)."""
        api = _rendezvous_api()
        self.rank, self.round = rank, formed["round"]
        self.raw.add(f"{self.ns}/r{self.round}/alive/{rank}", 1)
        os.environ[REJOINED_ENV] = "1"
        print(
            f"wansync rendezvous: the run {self.run_id} is training without the node of rank {rank} at "
            f"{self.addr}; this node takes its place",
            file=sys.stderr,
            flush=True,
        )
        boot = self.served.workers_store(api.RendezvousStoreInfo(formed["master_addr"], int(formed["master_port"])))
        return api.RendezvousInfo(self.round_store(), rank, int(formed["world_size"]), boot)


class Served:
    """What a run secret puts before the agents' store on this node: a `Gate` where the store is
    hosted (the store itself listens on loopback), a `Connector` elsewhere; the workers of this node
    reach the store through it too (`workers_store`). Without a secret, nothing."""

    def __init__(self, gate: Gate | None = None, connector: Connector | None = None, local_port: int = 0):
        self.gate, self.connector, self.local_port = gate, connector, local_port
        self.endpoint: tuple[str, int] | None = None  # with --bind: the workers meet at the agents' store

    def workers_store(self, info: Any) -> Any:
        if self.local_port:
            return type(info)("127.0.0.1", self.local_port)
        if self.endpoint is not None:
            return type(info)(*self.endpoint)
        return info


def rendezvous_store(
    host: str, port: int, is_host: bool | None, timeout: timedelta, trust: Trust | None = None
) -> tuple[Any, Served]:
    """The TCP store the agents meet at, as c10d makes it (multi-tenant: torchrun's workers share it).
    Hosted here when `is_host` says so or, unsaid, when this host owns the endpoint's address; then an
    agent that finds the port taken joins as a client: on one machine every agent owns the address,
    and one of them, the first to bind, hosts (c10d's own guess falls back the same way; a given
    `is_host=1` does not). It listens on the endpoint's address (`--bind`'s), never on every
    interface; with a run secret on loopback, behind a gate that admits (`trust.gate`), and a client
    node reaches it through a connector that is admitted first: a node with another secret is
    refused here in one line."""
    from torch.distributed import TCPStore

    trust = trust or Trust(None, Listen())
    secret = trust.secret

    def serve(address: str) -> tuple[Any, Served]:
        listener = _listener(address, port)  # OSError: the port is taken
        if secret is None:
            return _store_on(listener, address, timeout), Served()
        backend = _listener("127.0.0.1", 0)
        backend_port = backend.getsockname()[1]
        store = _store_on(backend, "127.0.0.1", timeout)
        return store, Served(
            gate=Gate(listener, ("127.0.0.1", backend_port), secret, "rendezvous"), local_port=backend_port
        )

    def join() -> tuple[Any, Served]:
        if secret is None:
            return TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout), Served()
        connector = Connector((host, port), secret, "rendezvous")
        try:
            connector.check(timeout.total_seconds())
        except AdmissionRefused as e:  # another secret: this node ends here, in one line, having joined nothing
            print(f"wansync rendezvous: {one_line(str(e))}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        local = connector.address[1]
        store = TCPStore("127.0.0.1", local, is_master=False, multi_tenant=True, timeout=timeout)
        return store, Served(connector=connector, local_port=local)

    try:
        if not (owns(host) if is_host is None else is_host):
            return join()
        try:
            return serve(trust.listen.address or address_of(host, "the rendezvous"))
        except OSError as e:
            if is_host is not None or e.errno != errno.EADDRINUSE:
                raise
            return join()  # another agent on this host hosts it
    except (ValueError, RuntimeError, TimeoutError, OSError, WansyncError) as e:
        raise _connection_error(f"cannot open the store at {host}:{port}: {first_line(e)}") from e


def _listener(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def _store_on(listener: socket.socket, address: str, timeout: timedelta) -> Any:
    """c10d's multi-tenant store serving on `listener` (bound and listening; the store takes it over)."""
    from torch.distributed import TCPStore

    store = TCPStore(
        address,
        listener.getsockname()[1],
        is_master=True,
        multi_tenant=True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )
    listener.detach()
    return store


def advertised_address(endpoint_host: str) -> str | None:
    """The address this node is reached at by the others: its route's to the endpoint. On one
    machine (a loopback endpoint) that is loopback; an endpoint whose name resolves here to loopback
    cannot say which address the other nodes reach, and the one line says what to pass."""
    try:
        route = route_to(endpoint_host)
    except OSError as e:
        print(
            f"wansync rendezvous: no route to the endpoint {endpoint_host} ({e.strerror or e}); " f"pass --local-addr",
            file=sys.stderr,
        )
        return None
    if route.loopback and not _literal_loopback(endpoint_host):
        print(
            f"wansync rendezvous: the endpoint {endpoint_host} resolves to a loopback address on this host, which "
            f"the other nodes cannot reach: pass --local-addr (this host's address on their side) or name the "
            f"endpoint by that address",
            file=sys.stderr,
        )
        return None
    return route.address


def _literal_loopback(host: str) -> bool:
    """An endpoint that names this machine's loopback outright: every node is on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
