"""wansync: data-parallel training across slow links.

    import wansync as ws
    ws.init()
    sync = ws.strategy("local_sgd", model, optimizer, sync_every=8)
    for batch in loader:
        loss_fn(sync.model(batch)).backward()
        sync.step()
        sync.zero_grad()

`ws.Run(sync, out=DIR)` around the loop gives it the profiler, run directory and TensorBoard of
`wansync train` (docs/your_model.md).
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
    mesh (`mesh=`: the 2-D workers x ranks mesh when they cannot be; docs/multinode.md). Settings
    known to go wrong (docs/guards.md) give a `RegimeWarning` on rank 0, as `wansync train` warns."""
    import dataclasses
    import warnings

    from .strategies import build
    from .strategies.guards import RegimeWarning, regime_warnings
    sync = build(name, model, optimizer, group=group, **options)
    if sync.rank == 0:
        for line in regime_warnings(name, dataclasses.asdict(sync.opts)):
            warnings.warn(line, RegimeWarning, stacklevel=2)
    return sync


def __getattr__(name: str) -> Any:
    if name == "Run":                   # ws.Run: the profiler, run directory, TensorBoard for your own loop
        from .telemetry.run import Run
        return Run
    raise AttributeError(f"module 'wansync' has no attribute {name!r}")


__all__ = ["init", "strategy", "Run", "__version__"]
