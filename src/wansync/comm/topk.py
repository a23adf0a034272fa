"""Chunked top-k: the k values of largest magnitude in every chunk, the selection of SparseLoCo and
DeMo (the reference code's `torch.topk(x.abs(), k, dim=-1)` per chunk).

k comes from the density (the fraction of each chunk kept, rounded to the nearest count, at least
one) or is given as a count (`topk`, the reference code's knob, clamped to a smaller chunk as it
clamps it). Every value kept (k = the chunk's size) is a selection of everything, in order, with no
top-k run.
"""

from __future__ import annotations

import math

import torch


def kept_per_chunk(size: int, density: float, topk: int = 0) -> int:
    """Values kept of a chunk of `size`: `topk` when given (at most the chunk), else density × size
    rounded half up, at least 1."""
    k = topk if topk > 0 else math.floor(density * size + 0.5)
    return max(1, min(size, k))


def chunk_topk(chunks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, values) of the k largest-magnitude values of each row of the (chunks, size)
    matrix: int64 indices within the row, and the values themselves (signed), both (chunks, k)."""
    size = chunks.shape[1]
    if not 1 <= k <= size:
        raise ValueError(f"top-k of {k} values from chunks of {size} (k must be in [1, {size}])")
    if k == size:
        idx = torch.arange(size, device=chunks.device).expand(chunks.shape[0], size)
        return idx, chunks
    idx = torch.topk(chunks.abs(), k, dim=1, largest=True, sorted=False).indices
    return idx, torch.gather(chunks, 1, idx)
