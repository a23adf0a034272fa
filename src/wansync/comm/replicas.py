"""Workers made of several ranks: where this rank sits, and the process groups that follow.

A *worker* is a replica group of R ranks (one per GPU, say) that trains one model with
PyTorch's DistributedDataParallel; the strategy's exchange runs between workers. Ranks
w·R … w·R+R−1 form worker w, so on `torchrun --nproc-per-node R` a node is a worker.

Two families of process groups serve that:

- `inside`: the R ranks of this worker (DDP's gradient all-reduce every step, and the all-gather
  that reassembles a sharded exchange). None when R = 1.
- `across`: local rank r of every worker. All ranks of a worker hold the same parameters, so an
  exchange splits the buffer into R shards and local rank r averages shard r over `across`
  (every rank carries 1/R of the model over the wide-area link, R transfers in parallel).
  None when R = 1 (the default group is the across group then).

`dist.new_group` must be called by every rank for every group, in the same order, so
`replica_groups` makes all of them on every rank and keeps its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..errors import ConfigError


@dataclass(frozen=True)
class Replicas:
    """This rank's place: worker `worker` of `workers`, local rank `local_rank` of `ranks_per_worker`."""
    ranks_per_worker: int = 1
    worker: int = 0
    workers: int = 1
    local_rank: int = 0
    inside: Any = None          # process group of this worker's ranks (None: R = 1)
    across: Any = None          # process group of local rank `local_rank` of every worker (None: R = 1)

    @property
    def sharded(self) -> bool:
        return self.ranks_per_worker > 1


def place(rank: int, world_size: int, ranks_per_worker: int) -> tuple[int, int, int]:
    """(worker, workers, local rank) of global `rank`; a world that R does not divide is refused."""
    if ranks_per_worker < 1:
        raise ConfigError(f"ranks_per_worker must be >= 1, got {ranks_per_worker}")
    if world_size % ranks_per_worker:
        raise ConfigError(f"--ranks-per-worker {ranks_per_worker} does not divide the world size {world_size} "
                          f"(workers x ranks per worker must equal the number of processes)")
    return rank // ranks_per_worker, world_size // ranks_per_worker, rank % ranks_per_worker


def replica_groups(ranks_per_worker: int) -> Replicas:
    """Make the inside and across groups (collective: every rank calls it) and return this rank's."""
    if not dist.is_initialized():
        if ranks_per_worker != 1:
            raise ConfigError("ranks_per_worker > 1 needs an initialized process group")
        return Replicas()
    rank, world = dist.get_rank(), dist.get_world_size()
    worker, workers, local = place(rank, world, ranks_per_worker)
    if ranks_per_worker == 1:
        return Replicas(1, worker, workers, local)
    from ..net import shared_uplink
    r = ranks_per_worker
    inside = across = None
    for w in range(workers):
        g = dist.new_group([w * r + i for i in range(r)])
        if w == worker:
            inside = g
    uplink = shared_uplink(r)          # the R across groups run at once over each site's uplink
    for i in range(r):
        g = dist.new_group([w * r + i for w in range(workers)], pg_options=uplink)
        if i == local:
            across = g
    return Replicas(r, worker, workers, local, inside, across)
