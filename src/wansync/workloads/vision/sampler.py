"""A rank's disjoint, deterministic shard of training indices, served as an endless batch stream.

Shard: permute all indices with a generator seeded by `seed`; rank r takes perm[r::W], truncated
so every rank has the same length (ranks then agree on epochs and steps). Each epoch reshuffles the
shard with a generator seeded from (seed, rank, epoch). Batches are consecutive slices of that
stream and may straddle an epoch boundary, so nothing is dropped and tiny datasets still work.
The position (epoch, offset, batches served) is the whole state: resuming from it replays exactly.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from wansync.errors import ConfigError, DataError


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from a tuple of ints, stable across processes and Python versions."""
    digest = hashlib.sha256(repr(tuple(int(p) for p in parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


class ShardSampler:
    def __init__(self, n: int, *, rank: int, world_size: int, seed: int, batch_size: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside a world of size {world_size}")
        if batch_size < 1:
            raise ConfigError(f"batch size must be positive, got {batch_size}")
        if n // world_size == 0:
            raise DataError(f"{n} training images cannot be split across {world_size} workers")
        self.rank, self.world_size, self.seed, self.batch_size = rank, world_size, seed, batch_size
        perm = torch.randperm(n, generator=_generator(mix_seed(seed, 0x5A4D)))
        self.shard_indices = perm[rank::world_size][: n // world_size].clone()
        self.epoch, self.offset, self.batches = 0, 0, 0
        self._order_epoch, self._order = -1, self.shard_indices

    def __len__(self) -> int:
        return len(self.shard_indices)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._order_epoch:
            g = _generator(mix_seed(self.seed, self.rank, epoch))
            self._order = self.shard_indices[torch.randperm(len(self), generator=g)]
            self._order_epoch = epoch
        return self._order

    def next_indices(self) -> torch.Tensor:
        """The next `batch_size` indices of the stream (crossing epochs when needed)."""
        parts, need = [], self.batch_size
        while need:
            order = self._epoch_order(self.epoch)
            take = order[self.offset : self.offset + need]
            parts.append(take)
            need -= len(take)
            self.offset += len(take)
            if self.offset == len(self):
                self.epoch, self.offset = self.epoch + 1, 0
        self.batches += 1
        return torch.cat(parts)

    def batch_seed(self) -> int:
        """Seed for the augmentation of the batch about to be served (depends only on position)."""
        return mix_seed(self.seed, self.rank, self.batches, 0xA06)

    def epoch_progress(self) -> float:
        return self.epoch + self.offset / len(self)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "batches": self.batches,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "shard_size": len(self),
        }

    def skip_to(self, batches: int) -> None:
        """Where a sampler that served `batches` batches from the start would be."""
        self.epoch, self.offset = divmod(batches * self.batch_size, len(self))
        self.batches = batches

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("seed", "rank", "world_size", "shard_size"):
            if key in state and state[key] != mine[key]:
                raise DataError(
                    f"data state is for {key}={state[key]} but this worker has "
                    f"{key}={mine[key]}; resume with the same seed, rank and worker count"
                )
        if not 0 <= int(state["offset"]) < len(self):
            raise DataError(f"data state offset {state['offset']} is outside the shard of {len(self)}")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.batches = int(state["batches"])
