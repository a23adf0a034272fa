"""A fixed list of tensors exchanged as one contiguous buffer.

Strategies never exchange tensor by tensor: one collective per exchange (per fragment), so
that latency is paid once and the byte count is exact.
"""
from __future__ import annotations

from typing import Iterable

import torch


class FlatTensors:
    """Gathers a list of same-dtype tensors into one flat buffer and scatters it back."""

    def __init__(self, tensors: Iterable[torch.Tensor]):
        self.tensors = list(tensors)
        if not self.tensors:
            raise ValueError("FlatTensors needs at least one tensor")
        dtypes = {t.dtype for t in self.tensors}
        if len(dtypes) != 1:
            raise ValueError(f"FlatTensors needs one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = self.tensors[0].dtype
        self.device = self.tensors[0].device
        self.numel = sum(t.numel() for t in self.tensors)
        self.nbytes = self.numel * self.tensors[0].element_size()

    def gather(self) -> torch.Tensor:
        """A new flat copy of the current values."""
        return torch.cat([t.detach().reshape(-1) for t in self.tensors])

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` shaped like the tensors (no copy)."""
        out, offset = [], 0
        for t in self.tensors:
            n = t.numel()
            out.append(flat[offset:offset + n].view_as(t))
            offset += n
        return out

    def scatter(self, flat: torch.Tensor) -> None:
        """Copy `flat` back into the tensors in place."""
        with torch.no_grad():
            torch._foreach_copy_([t.detach() for t in self.tensors], self.views(flat))
