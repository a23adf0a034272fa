"""A worker's own ranks in an exchange between workers (`comm.exchange`): the shard of a buffer this
rank averages across workers, the whole put back together inside the worker, and the values summed or
averaged over the worker's ranks. Every collective here runs over the worker's `inside` group and is
booked as `inside/<purpose>`.

- **DDP inside** (`Replicas.ddp_inside`): every rank holds the whole buffer. It is cut into R
  contiguous, near-equal shards (`shard`; the side-band scalars ride on the last; a sparse payload's
  at whole rows of its chunks), local rank r averages shard r, and the worker's ranks all-gather the
  averaged shards (`reassemble`). A buffer with fewer values than R is not split (`splits`).
- **FSDP inside** (`Replicas.shards`): each rank holds its own shard already; what describes the
  worker's whole model (a norm, the drift) is summed over its ranks (`sum`, `norm`), and values
  every rank holds on its own are averaged over them (`mean`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from .ledger import INSIDE, CommLedger
from .payload import Payload
from .replicas import Replicas
from .sparse import is_sparse


class WorkerShards:
    """This rank's part of its worker (see the module docstring); its collectives booked on `ledger`."""

    def __init__(self, replicas: Replicas, ledger: CommLedger):
        self.replicas, self.ledger = replicas, ledger

    def _inside(self, purpose: str, nbytes: int, collective: Any) -> None:
        """Run `collective()` over the worker's ranks (blocking) and book its bytes and time."""
        t0 = time.perf_counter()
        collective()
        self.ledger.count(INSIDE + purpose, nbytes)
        self.ledger.waited(INSIDE + purpose, time.perf_counter() - t0)

    # ---- sharded inside: the worker's whole from each rank's part ----------------------------------
    def sum(self, values: list[float], purpose: str = "telemetry") -> list[float]:
        """Per-shard scalars summed over the worker's ranks (float64): with the model sharded inside
        a worker each rank measures only its shard (a norm², a drift term); otherwise every rank
        holds the whole and the values are returned as they are."""
        if not self.replicas.shards or self.replicas.ranks_per_worker == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        self._inside(purpose, t.numel() * t.element_size(), lambda: dist.all_reduce(t, group=self.replicas.inside))
        return t.tolist()

    def norm(self, norm: float) -> float:
        """The L2 norm of a worker's whole tensor from this rank's shard's (`sum`)."""
        return self.sum([norm * norm])[0] ** 0.5 if self.replicas.shards else norm

    def mean(self, payload: Payload) -> Payload:
        """The payload with its values averaged over the worker's ranks."""
        mean = payload.buf.detach() / self.replicas.ranks_per_worker
        self._inside(
            payload.purpose,
            mean.numel() * mean.element_size(),
            lambda: dist.all_reduce(mean, group=self.replicas.inside),
        )
        return dataclasses.replace(payload, buf=mean)

    # ---- DDP inside: a shard across workers, the whole inside the worker ---------------------------
    def splits(self, payload: Payload) -> bool:
        """Is this mean split between a worker's ranks? (Not a buffer with fewer values than R.)"""
        return self.replicas.ddp_inside and payload.buf.numel() - payload.extra >= self.replicas.ranks_per_worker

    @property
    def _last(self) -> bool:
        return self.replicas.local_rank == self.replicas.ranks_per_worker - 1

    def _bounds(self, payload: Payload) -> list[int]:
        """Where the R shards of the payload's values start (and the last ends): near-equal, none
        empty; a sparse payload's cut at whole rows of its chunks (`ChunkLayout.bounds`)."""
        r = self.replicas.ranks_per_worker
        if is_sparse(payload.codec):
            return payload.codec.bounds(r)
        q, rem = divmod(payload.buf.numel() - payload.extra, r)
        return [i * q + min(i, rem) for i in range(r + 1)]

    def shard(self, payload: Payload) -> Payload:
        """This local rank's contiguous shard of the values (the last one also holds the side-band),
        averaged into a new tensor: `reassemble` writes the destination. A sparse payload's codec
        covers the shard's chunks only."""
        flat = payload.buf.detach().reshape(-1)
        bounds = self._bounds(payload)
        r = self.replicas.local_rank
        a, b = bounds[r], bounds[r + 1]
        shard = flat[a:] if self._last else flat[a:b]
        residual = None if payload.residual is None else payload.residual.view(-1)[a:b]
        codec = payload.codec.restrict(a, b) if is_sparse(payload.codec) else payload.codec
        return dataclasses.replace(
            payload, buf=shard, extra=payload.extra if self._last else 0, dest=None, residual=residual, codec=codec
        )

    def reassemble(self, shard_mean: torch.Tensor, payload: Payload) -> torch.Tensor:
        """All-gather every local rank's averaged shard inside the worker (blocking) and put the
        buffer back together; into the destination when given."""
        whole, extra, dest = payload.buf, payload.extra, payload.dest
        bounds = self._bounds(payload)
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        lengths[-1] += extra
        piece = shard_mean.new_zeros(max(lengths))  # equal lengths for the all-gather
        piece[: shard_mean.numel()] = shard_mean
        pieces = [torch.empty_like(piece) for _ in lengths]
        self._inside(
            payload.purpose,
            piece.numel() * piece.element_size(),
            lambda: dist.all_gather(pieces, piece, group=self.replicas.inside),
        )
        mean = torch.cat([p[:k] for p, k in zip(pieces, lengths)])
        return dest.copy_(mean.view_as(whole)) if dest is not None else mean.view_as(whole)
