"""Where a fault-tolerant worker's torchft listeners bind, and how it reaches the lighthouse.

A worker serves its ranks and the quorum's process group a store, and torchft's Manager a gRPC server;
both bind the run's address (`--bind`'s, or with a run secret the address the worker advertises),
never every interface, on ports of `--ports` (`trust.listen`). With a run secret the lighthouse sits
behind a gate, and the worker's manager reaches it through a local end that is admitted first
(`trust.gate`). The heal server is the transport's (`ft.transport`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator
from urllib.parse import urlsplit

import torch

from ..trust.gate import Connector
from ..trust.listen import Listen, address_of
from ..trust.settings import Trust


def listen_address(trust: Trust, hostname: str) -> str | None:
    """Where this worker's listeners (its manager's server and store) bind: --bind's address; with
    a run secret and no --bind, the address `hostname` resolves to; else None (torchft's own choice,
    every interface)."""
    if trust.listen.address:
        return trust.listen.address
    if trust.secret is not None:
        return address_of(hostname, "this worker's manager")
    return None


@contextlib.contextmanager
def manager_bound(address: str | None) -> Iterator[None]:
    """torchft's Manager binds its server on every interface (`[::]:port`, torchft 0.2.0): while it
    is made here it binds `address` instead (the same port). The Manager is made by one thread."""
    if address is None:
        yield
        return
    import torchft.manager as manager_module

    original = manager_module.ManagerServer

    def bound(**kwargs: Any) -> Any:
        port = str(kwargs["bind"]).rsplit(":", 1)[1]
        return original(**{**kwargs, "bind": f"[{address}]:{port}" if ":" in address else f"{address}:{port}"})

    manager_module.ManagerServer = bound
    try:
        yield
    finally:
        manager_module.ManagerServer = original


def admitted_lighthouse(lighthouse: str, trust: Trust, timeout_s: float = 60.0) -> tuple[Connector | None, str]:
    """With a run secret the lighthouse is behind a gate: its clients (torchft's manager) reach it
    through a local end that is admitted first (one line here if this worker's secret is refused)."""
    if trust.secret is None:
        return None, lighthouse
    where = urlsplit(lighthouse if "://" in lighthouse else f"http://{lighthouse}")
    end = Connector((where.hostname or "", where.port or 0), trust.secret, "lighthouse")
    end.check(timeout_s)
    return end, f"http://127.0.0.1:{end.address[1]}"


def manager_store(hostname: str, inside: Any = None, trust: Trust | None = None, address: str | None = None) -> Any:
    """The store of this worker's manager, serving on `address` (None: every interface) at a port of its own, made
    by the worker's first rank (its others learn the port over `inside`): its ranks find their
    manager there, and the quorum's process group meets on the store of one of its members, at the
    address that member advertised. A restarted worker makes a new one: nothing of its last life
    (the manager's address) is read again."""
    import torch.distributed as dist
    from torch.distributed import TCPStore

    first = inside is None or dist.get_rank(inside) == 0
    store = None
    if first and address is None:
        store = TCPStore(hostname, 0, is_master=True, wait_for_workers=False)
    elif first and address is not None:
        sock = (trust or Trust(None, Listen())).listen.socket("manager store", default_host=address)
        store = TCPStore(
            hostname, sock.getsockname()[1], is_master=True, wait_for_workers=False, master_listen_fd=sock.fileno()
        )
        sock.detach()
    if inside is None:
        return store
    port = torch.tensor([store.port if store is not None else 0], dtype=torch.int64)
    dist.broadcast(port, src=dist.get_global_rank(inside, 0), group=inside)
    return store if first else TCPStore(hostname, int(port.item()), is_master=False, wait_for_workers=False)
