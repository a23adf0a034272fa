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

_local_store: Any = None


def init(backend: str = "gloo", wan: str | None = None, seed: int = 0) -> None:
    """Initialize torch.distributed: from a torchrun environment when there is one, else a
    one-process group on loopback. `wan` runs the group under the emulated link."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    if wan:
        from .net import install, parse_wan
        backend = install(parse_wan(wan), seed=seed)
    from .launch import torchrun_env
    if torchrun_env() is not None:              # a partial or malformed one is refused in one line
        dist.init_process_group(backend, init_method="env://")
        return
    global _local_store
    from .localgroup import LoopbackStore
    _local_store = LoopbackStore()
    dist.init_process_group(backend, store=_local_store.store, rank=0, world_size=1)


def strategy(name: str, model: Any, optimizer: Any, *, group: Any = None, **options: Any) -> Any:
    """Build strategy `name` around an existing model and inner optimizer on the current group."""
    from .strategies import build
    return build(name, model, optimizer, group=group, **options)


__all__ = ["init", "strategy", "__version__"]
