"""Workers made of several ranks: where this rank sits, and the process groups that follow.

A *worker* is a replica group of R ranks (one per GPU, say) that trains one model; the strategy's
exchange runs between workers. Ranks w·R … w·R+R−1 form worker w, so on
`torchrun --nproc-per-node R` a node is a worker. Inside a worker the model is either

- **replicated** (DDP inside, the default): every rank holds the whole model and PyTorch's
  DistributedDataParallel all-reduces gradients over the worker's ranks every step. All ranks of a
  worker hold the same state, so an exchange splits its buffer into R shards, local rank r
  averages shard r over `across` (every rank carries 1/R of the model over the wide-area link, R
  transfers in parallel) and the worker's ranks all-gather the result; or
- **sharded** (FSDP inside, `shards`): PyTorch's FSDP2 (`fully_shard`) shards every parameter over
  the worker's ranks (`mesh`: a 2-D DeviceMesh, dimension `across` x `inside`, the worker's
  dimension sharded, the other replicated: hybrid sharding). Local rank r of every worker holds
  the same shard of every parameter, so the strategy's exchange runs on each rank's local shards
  over `across`, with nothing to split or gather, and its anchors and outer state are 1/R of the
  worker's.

Two families of process groups serve both:

- `inside`: the R ranks of this worker. None when R = 1 with DDP inside.
- `across`: local rank r of every worker. None when R = 1 (the default group is the across group).

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
    inside: Any = None  # process group of this worker's ranks (None: R = 1, DDP inside)
    across: Any = None  # process group of local rank `local_rank` of every worker (None: R = 1)
    shards: bool = False  # FSDP inside: each rank holds its own shard of the worker's model state
    mesh: Any = None  # with `shards`: the (across, inside) DeviceMesh the model is sharded on

    @property
    def ddp_inside(self) -> bool:
        """Several ranks holding the same state: DDP inside, and an exchange that splits its buffer."""
        return self.ranks_per_worker > 1 and not self.shards

    @property
    def between_workers(self) -> bool:
        """Does the strategy's exchange run over `across` (between workers), not over every rank?"""
        return self.ranks_per_worker > 1 or self.shards


def place(rank: int, world_size: int, ranks_per_worker: int) -> tuple[int, int, int]:
    """(worker, workers, local rank) of global `rank`; a world that R does not divide is refused."""
    if ranks_per_worker < 1:
        raise ConfigError(f"ranks_per_worker must be >= 1, got {ranks_per_worker}")
    if world_size % ranks_per_worker:
        raise ConfigError(
            f"--ranks-per-worker {ranks_per_worker} does not divide the world size {world_size} "
            f"(workers x ranks per worker must equal the number of processes)"
        )
    return rank // ranks_per_worker, world_size // ranks_per_worker, rank % ranks_per_worker


def replica_groups(ranks_per_worker: int, shard_inside: bool = False, device_type: str = "cpu") -> Replicas:
    """Make the inside and across groups (collective: every rank calls it) and return this rank's;
    `shard_inside` (FSDP inside): also the (across, inside) DeviceMesh of `device_type` built on them."""
    if not dist.is_initialized():
        if ranks_per_worker != 1 or shard_inside:
            raise ConfigError("workers of several ranks, or sharded inside, need an initialized process group")
        return Replicas()
    rank, world = dist.get_rank(), dist.get_world_size()
    worker, workers, local = place(rank, world, ranks_per_worker)
    if ranks_per_worker == 1 and not shard_inside:
        return Replicas(1, worker, workers, local)
    from ..net import shared_uplink

    r = ranks_per_worker
    inside = across = None
    for w in range(workers):
        g = dist.new_group([w * r + i for i in range(r)])
        if w == worker:
            inside = g
    uplink = shared_uplink(r)  # the R across groups run at once over each site's uplink
    for i in range(r):
        g = dist.new_group([w * r + i for w in range(workers)], pg_options=uplink)
        if i == local:
            across = g
    if not shard_inside:
        return Replicas(r, worker, workers, local, inside, across)
    return Replicas(
        r,
        worker,
        workers,
        local,
        inside,
        across,
        shards=True,
        mesh=worker_mesh(across or dist.group.WORLD, inside, workers, r, device_type),
    )


def worker_mesh(across: Any, inside: Any, workers: int, ranks_per_worker: int, device_type: str) -> Any:
    """The 2-D DeviceMesh (across, inside) on the groups made here (so the emulator's options on
    `across` stay): FSDP2 on it shards over `inside` and replicates over `across` (hybrid sharding)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    layout = torch.arange(workers * ranks_per_worker, dtype=torch.int).view(workers, ranks_per_worker)
    return DeviceMesh.from_group([across, inside], device_type, mesh=layout, mesh_dim_names=("across", "inside"))


def replicas_of(model: Any, mesh: Any = None) -> Replicas | None:
    """This rank's place in the worker a user's model is sharded over with FSDP2 (`fully_shard`:
    DTensor parameters); None for a model that is not sharded. The model's mesh says it: a 2-D
    (workers x ranks per worker) mesh, hybrid sharding; a 1-D mesh cut from such a one (its
    second dimension); a 1-D mesh of every rank (one worker). `mesh` gives the 2-D mesh for a
    model sharded over its second dimension otherwise."""
    from torch.distributed.tensor import DTensor

    sharded = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    if sharded is None:
        return None
    if mesh is None:
        root = sharded._get_root_mesh()
        cut_from_root = root.ndim == 2 and sharded.mesh.tolist() in root.mesh.tolist()  # one row: a worker
        mesh = sharded if sharded.ndim == 2 else root if cut_from_root else None
    if mesh is None and sharded.ndim == 1 and sharded.size() == dist.get_world_size():
        return _one_worker(sharded)
    if mesh is None or mesh.ndim != 2:
        raise ConfigError(
            "the model is sharded on a mesh whose workers wansync cannot tell: shard it with fully_shard "
            "on a 2-D (workers x ranks per worker) DeviceMesh, or pass mesh= that 2-D mesh"
        )
    worker, local = mesh.get_coordinate()
    workers, r = mesh.shape
    return Replicas(r, worker, workers, local, mesh.get_group(1), mesh.get_group(0), shards=True, mesh=mesh)


def _one_worker(mesh: Any) -> Replicas:
    """Every rank in one worker: each rank its own across group (nothing to exchange with)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    across = None
    for r in range(world):  # every rank makes every group, in the same order
        g = dist.new_group([r])
        if r == rank:
            across = g
    return Replicas(world, 0, 1, rank, mesh.get_group(0), across, shards=True, mesh=mesh)
