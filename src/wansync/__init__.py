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

__version__ = "0.5.0.dev0"  # pyproject.toml's; the versions and what each changed: CHANGELOG.md


def init(backend: str = "gloo", wan: Any = None, seed: int = 0, fault_tolerant: bool = False) -> None:
    """Initialize torch.distributed: from a torchrun environment when there is one, else a
    one-process group on loopback. `wan` (a ``--wan`` string or a :class:`wansync.net.Topology`)
    runs the group under the emulated link, with jitter drawn from `seed`. `fault_tolerant`: this
    worker is a group of its own, under torchrun too (no collective may wait on a dead worker; its
    exchanges go over the quorum of ``ws.strategy(..., fault_tolerant=ws.FaultTolerance(...))``)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    emulator = None
    if wan:
        from . import net

        topology = net.parse_wan(wan) if isinstance(wan, str) else wan
        backend, emulator = net.install(), net.Emulator(topology, seed=seed)
    if fault_tolerant:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, pg_options=emulator)
        return
    from .runner.torchrun import join_network, torchrun_env

    env = torchrun_env()  # a partial or malformed one is refused in one line
    if emulator is not None:  # a topology file's workers are the launch's
        emulator.topology.check_workers(
            (env.world_size if env is not None else 1) // emulator.topology.ranks_per_worker
        )
    if env is not None:
        join_network(env)  # gloo on the route to node 0, whatever this host's name says
        dist.init_process_group(backend, init_method="env://", pg_options=emulator)
        return
    from .runner.localgroup import LoopbackStore

    # the group holds the store, and with it the loopback server, for as long as the group lives
    dist.init_process_group(backend, store=LoopbackStore().store, rank=0, world_size=1, pg_options=emulator)


def strategy(
    name: str, model: Any, optimizer: Any, *, group: Any = None, fault_tolerant: Any = None, **options: Any
) -> Any:
    """Build strategy `name` around an existing model and inner optimizer on the current group. A
    model sharded with FSDP2 (`fully_shard`) is exchanged shard by shard, its workers read from its
    mesh (`mesh=`: the 2-D workers x ranks mesh when they cannot be; docs/multinode.md). Settings
    known to go wrong (docs/guards.md) give a `RegimeWarning` on rank 0, as `wansync train` warns.
    `fault_tolerant` (a `ws.FaultTolerance`): exchanges over torchft's quorum of the workers alive,
    joined here, where a restarted worker heals from a live peer (docs/fault_tolerance.md)."""
    import dataclasses
    import warnings

    from .strategies import build, check_given
    from .strategies.guards import RegimeWarning, regime_warnings

    check_given(name, options)
    if fault_tolerant is not None:
        from .ft.own_loop import fault_tolerant_strategy

        sync = fault_tolerant_strategy(name, model, optimizer, fault_tolerant, group=group, **options)
    else:
        sync = build(name, model, optimizer, group=group, **options)
    if sync.rank == 0:
        for line in regime_warnings(name, dataclasses.asdict(sync.opts), python=True):
            warnings.warn(line, RegimeWarning, stacklevel=2)
    return sync


def __getattr__(name: str) -> Any:
    if name == "Run":  # ws.Run: the profiler, run directory, TensorBoard for your own loop
        from .telemetry.run import Run

        return Run
    if name == "FaultTolerance":  # ws.FaultTolerance: a worker's place in a fault-tolerant run of your loop
        from .ft.own_loop import FaultTolerance

        return FaultTolerance
    raise AttributeError(f"module 'wansync' has no attribute {name!r}")


__all__ = ["init", "strategy", "Run", "FaultTolerance", "__version__"]
