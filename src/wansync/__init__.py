"""wansync: data-parallel training across slow links.

    import wansync as ws
    ws.init()
    sync = ws.strategy("local_sgd", model, optimizer, sync_every=8)
    for batch in loader:
        loss_fn(sync.model(batch)).backward()
        sync.step()
        sync.zero_grad()
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def init(backend: str = "gloo", wan: Any = None, seed: int = 0) -> None:
    """Initialize torch.distributed: from a torchrun environment when there is one, else a
    one-process group on loopback. `wan` (a ``--wan`` string or a :class:`wansync.net.Topology`)
    runs the group under the emulated link, with jitter drawn from `seed`."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    emulator = None
    if wan:
        from . import net
        topology = net.parse_wan(wan) if isinstance(wan, str) else wan
        backend, emulator = net.install(), net.Emulator(topology, seed=seed)
    from .runner.torchrun import join_network, torchrun_env
    env = torchrun_env()                        # a partial or malformed one is refused in one line
    if env is not None:
        join_network(env)                       # gloo on the route to node 0, whatever this host's name says
        dist.init_process_group(backend, init_method="env://", pg_options=emulator)
        return
    from .runner.localgroup import LoopbackStore
    # the group holds the store, and with it the loopback server, for as long as the group lives
    dist.init_process_group(backend, store=LoopbackStore().store, rank=0, world_size=1, pg_options=emulator)


def strategy(name: str, model: Any, optimizer: Any, *, group: Any = None, **options: Any) -> Any:
    """Build strategy `name` around an existing model and inner optimizer on the current group. A
    model sharded with FSDP2 (`fully_shard`) is exchanged shard by shard, its workers read from its
    mesh (`mesh=`: the 2-D workers x ranks mesh when they cannot be; docs/multinode.md)."""
    from .strategies import build
    return build(name, model, optimizer, group=group, **options)


__all__ = ["init", "strategy", "__version__"]
