"""The orthonormal DCT-II on blocks: DeMo's transform of every chunk before its top-k, optional in
SparseLoCo (the reference code's `use_dct`).

A block X of h × w values becomes D_h · X · D_wᵀ, D_n the n × n orthonormal DCT-II matrix

    D_n[k, i] = c_k · √(2/n) · cos(π (2i + 1) k / 2n),    c_0 = 1/√2, c_k = 1 otherwise,

whose inverse is its transpose: X = D_hᵀ · Y · D_w. Orthonormal, so a coefficient's size is its
energy's, and top-k over coefficients keeps the most energy a chunk can keep in k numbers. The
matrices are built in float64 and rounded once (`dct_matrix`); a transform is two batched matrix
products on a (chunks, h, w) tensor. The reference code builds the same matrices from an FFT of the
identity; only their last bits differ.
"""

from __future__ import annotations

import math

import torch


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """D_n, the n × n orthonormal DCT-II matrix (rows: frequencies)."""
    k = torch.arange(n, dtype=torch.float64).view(-1, 1)
    i = torch.arange(n, dtype=torch.float64).view(1, -1)
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(dtype=dtype, device=device)


class BlockDCT:
    """The 2-D DCT of blocks of h × w (a vector's chunks: h = 1, a 1-D DCT), its matrices made once."""

    def __init__(self, h: int, w: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        self.h, self.w = h, w
        self.dh, self.dw = dct_matrix(h, dtype, device), dct_matrix(w, dtype, device)

    def forward(self, chunks: torch.Tensor) -> torch.Tensor:
        """(chunks, h·w) values -> (chunks, h·w) coefficients: D_h · X · D_wᵀ per chunk."""
        x = chunks.view(-1, self.h, self.w)
        y = torch.matmul(x, self.dw.T) if self.h == 1 else torch.matmul(torch.matmul(self.dh, x), self.dw.T)
        return y.reshape(-1, self.h * self.w)

    def inverse(self, coefficients: torch.Tensor) -> torch.Tensor:
        """(chunks, h·w) coefficients -> values: D_hᵀ · Y · D_w per chunk."""
        y = coefficients.view(-1, self.h, self.w)
        x = torch.matmul(y, self.dw) if self.h == 1 else torch.matmul(torch.matmul(self.dh.T, y), self.dw)
        return x.reshape(-1, self.h * self.w)
