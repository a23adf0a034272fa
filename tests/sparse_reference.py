"""SparseLoCo's and DeMo's published rules written out directly, with no wansync code: the reference
the strategy tests compare `sparseloco` and `demo` with, tensor by tensor as the reference code
(CCLoco, bloc97/DeMo) loops over parameters.

Per tensor: a matrix R × C (a tensor of more dimensions: its first dimension by the rest) in blocks of
h × w, h and w the largest divisors of R and C not above `chunk`; a vector in 1-D chunks of the
largest divisor of its length not above `chunk`; top-k by magnitude per block; the statistical
quantizer per tensor (statistics in float64, wansync's documented choice); the values all-gathered
and averaged per index over the workers that sent them (`scatter_reduce(..., "mean",
include_self=False)`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def side(n: int, chunk: int) -> int:
    return max(d for d in range(1, min(n, chunk) + 1) if n % d == 0)


def blocks(shape: torch.Size, chunk: int) -> tuple[int, int, int, int]:
    rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))
    return rows, cols, side(rows, chunk), side(cols, chunk)


def to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    rows, cols, h, w = blocks(x.shape, chunk)
    return x.reshape(rows // h, h, cols // w, w).permute(0, 2, 1, 3).reshape(-1, h * w).clone()


def from_chunks(c: torch.Tensor, shape: torch.Size, chunk: int) -> torch.Tensor:
    rows, cols, h, w = blocks(shape, chunk)
    return c.reshape(rows // h, cols // w, h, w).permute(0, 2, 1, 3).reshape(shape)


def dct(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix, from its textbook definition."""
    m = torch.tensor(
        [
            [
                math.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n) * (1 / math.sqrt(2) if k == 0 else 1)
                for i in range(n)
            ]
            for k in range(n)
        ],
        dtype=torch.float64,
    )
    return m.float()


def transform(c: torch.Tensor, shape: torch.Size, chunk: int, inverse: bool = False) -> torch.Tensor:
    _, _, h, w = blocks(shape, chunk)
    dh, dw = dct(h), dct(w)
    x = c.reshape(-1, h, w)
    y = dh.T @ x @ dw if inverse else dh @ x @ dw.T
    return y.reshape(-1, h * w)


def quantize(v: torch.Tensor, bits: int, rng: float = 6.0) -> torch.Tensor:
    """The statistical quantizer on one tensor's values: what they decode to."""
    if bits == 32:
        return v
    bins = 2**bits
    v64 = v.double()
    shift = v64.mean()
    c = v64 - shift
    std = c.norm() / math.sqrt(c.numel() - 1) if c.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
    scale = rng * std / bins
    if scale == 0 or not torch.isfinite(scale):
        scale = torch.tensor(1.0, dtype=torch.float64)
    codes = (c / scale + bins // 2).round().clamp(0, bins - 1).long()
    table = torch.zeros(bins, dtype=torch.float64)
    for b in range(bins):
        if (codes == b).any():
            table[b] = c[codes == b].mean()
    return (table.float()[codes] + shift.float()).view_as(v)


def sparse_round(
    tensors: list[torch.Tensor], errors: list[torch.Tensor], k: int, chunk: int, bits: int, use_dct: bool
) -> list[torch.Tensor]:
    """Every worker's chunked top-k of each tensor (quantized), removed from its error buffer; returns
    the aggregated tensors (the per-index mean over the workers that sent it)."""
    world = dist.get_world_size()
    out = []
    for t, e in zip(tensors, errors):
        x = to_chunks(t, chunk)
        if use_dct:
            x = transform(x, t.shape, chunk)
        kk = min(k, x.shape[1])
        idx = torch.topk(x.abs(), kk, dim=1).indices
        val = quantize(x.gather(1, idx), bits)
        sent = torch.zeros_like(x).scatter(1, idx, val)  # what this worker's payload decodes to
        e.copy_(t - from_chunks(transform(sent, t.shape, chunk, inverse=True) if use_dct else sent, t.shape, chunk))
        idxs = [torch.zeros_like(idx) for _ in range(world)]
        vals = [torch.zeros_like(val) for _ in range(world)]
        dist.all_gather(idxs, idx.contiguous())
        dist.all_gather(vals, val.contiguous())
        agg = torch.zeros_like(x).scatter_reduce(1, torch.cat(idxs, 1), torch.cat(vals, 1), "mean", include_self=False)
        if use_dct:
            agg = transform(agg, t.shape, chunk, inverse=True)
        out.append(from_chunks(agg, t.shape, chunk))
    return out
