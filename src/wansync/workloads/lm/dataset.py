"""Token windows, a disjoint per-rank shard, and a resumable per-epoch shuffled batch order.

The corpus splits once into train and validation by document: the last `val_fraction` of every
document is held out, so validation samples the whole corpus (not the end of its last file), and
the two texts are tokenized apart, so no window straddles the boundary. Training tokens are cut into non-overlapping windows of
`seq_len + 1` (inputs are the first `seq_len`, targets the last `seq_len`). All ranks permute
the window ids with the same seed and rank r takes `perm[r::world_size]`, truncated so every
rank has the same number: shards are disjoint, and steps per epoch agree across ranks.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from wansync.errors import ConfigError, DataError

Batch = tuple[torch.Tensor, torch.Tensor]


def split_documents(docs: Sequence[str], val_fraction: float, sep: str = "\n") -> tuple[str, str]:
    """(train text, validation text): the validation text is the tail `val_fraction` (in characters) of
    every document, the training text their heads, each joined with `sep` in document order."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cuts = [len(d) - int(len(d) * val_fraction) for d in docs]
    return (sep.join(d[:c] for d, c in zip(docs, cuts)), sep.join(d[c:] for d, c in zip(docs, cuts) if c < len(d)))


def window_batch(tokens: np.ndarray, window_ids: np.ndarray, seq_len: int) -> Batch:
    """(inputs, targets), each (len(window_ids), seq_len) int64, from windows of seq_len + 1 tokens."""
    starts = np.asarray(window_ids, dtype=np.int64) * (seq_len + 1)
    rows = torch.from_numpy(tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64))
    return rows[:, :-1], rows[:, 1:]


def shard_windows(n_windows: int, *, seed: int, rank: int, world_size: int) -> np.ndarray:
    """Rank `rank`'s window ids: perm[rank::world_size] of a seed-only permutation, equal length on all ranks."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in [0, world_size={world_size})")
    perm = np.random.default_rng([seed]).permutation(n_windows)
    return perm[rank::world_size][: n_windows // world_size]


class ShardSampler:
    """Endless batches of window ids from one shard; reshuffled each epoch from (seed, rank, epoch).

    The state is just (epoch, position): the order of an epoch is a pure function of the seed,
    so a resumed sampler yields exactly the batch an uninterrupted one would have.
    """

    def __init__(self, shard: np.ndarray, batch_size: int, *, seed: int, rank: int) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be positive, got {batch_size}")
        self.shard, self.batch_size, self.seed, self.rank = shard, batch_size, seed, rank
        self.batches_per_epoch = len(shard) // batch_size
        self.epoch = self.position = 0
        self._order_epoch, self._order = -1, shard

    def next_window_ids(self) -> np.ndarray:
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        if self._order_epoch != self.epoch:
            self._order = np.random.default_rng([self.seed, self.rank, self.epoch]).permutation(self.shard)
            self._order_epoch = self.epoch
        start = self.position * self.batch_size
        self.position += 1
        return self._order[start : start + self.batch_size]

    def epoch_progress(self) -> float:
        return self.epoch + self.position / self.batches_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def skip_to(self, batches: int) -> None:
        """Where a sampler that served `batches` batches from the start would be."""
        self.epoch, self.position = divmod(batches, self.batches_per_epoch)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError):
            raise DataError(f"data state {state!r} needs integer 'epoch' and 'position'") from None
        if epoch < 0 or not 0 <= position <= self.batches_per_epoch:
            raise DataError(f"data state {state} does not fit this shard ({self.batches_per_epoch} batches per epoch)")
        self.epoch, self.position = epoch, position


def eval_window_ids(n_windows: int, n_batches: int, batch_size: int) -> list[np.ndarray]:
    """Fixed validation batches: up to n_batches * batch_size window ids spread evenly over the split."""
    n = min(n_windows, n_batches * batch_size)
    ids = np.linspace(0, n_windows - 1, n).round().astype(np.int64) if n else np.zeros(0, np.int64)
    return [ids[i : i + batch_size] for i in range(0, n, batch_size)]
