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

Everything else is c10d's. Registered through the `torchrun.handlers` entry point (pyproject.toml).
"""

from __future__ import annotations

import ipaddress
import sys
from datetime import timedelta
from typing import Any, Callable

from ..errors import first_line
from .route import owns, route_to

NAME = "wansync"
DEFAULT_PORT = 29400


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
    if not params.local_addr:
        params.local_addr = advertised_address(host)
    if params.get("store_type", "tcp").strip().lower() != "tcp":  # a file store: c10d's own
        _, store = create_backend(params)
    else:
        store = rendezvous_store(
            host, port, params.get_as_bool("is_host"), timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
        )
    return c10d_handler(store, Backend(store, params.run_id), params)


def rendezvous_store(host: str, port: int, is_host: bool | None, timeout: timedelta) -> Any:
    """The TCP store the agents meet at, as c10d makes it (multi-tenant: torchrun's workers share it).
    Hosted here when `is_host` says so or, unsaid, when this host owns the endpoint's address; then an
    agent that finds the port taken joins as a client: on one machine every agent owns the address,
    and one of them, the first to bind, hosts (c10d's own guess falls back the same way; a given
    `is_host=1` does not)."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    def store(server: bool) -> Any:
        return TCPStore(host, port, is_master=server, multi_tenant=True, timeout=timeout)

    try:
        if not (owns(host) if is_host is None else is_host):
            return store(False)
        try:
            return store(True)
        except RuntimeError as e:
            if is_host is not None or not port_taken(e):
                raise
            return store(False)  # another agent on this host hosts it
    except (ValueError, RuntimeError, TimeoutError) as e:
        raise RendezvousConnectionError(
            f"wansync rendezvous: cannot open the store at {host}:{port}: " f"{first_line(e)}"
        ) from e


def port_taken(exc: BaseException) -> bool:
    """A store's failure to listen because the port is in use (by another agent, or anything else)."""
    text = str(exc)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


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
