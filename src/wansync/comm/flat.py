"""A fixed list of tensors exchanged as one contiguous buffer.

Strategies never exchange tensor by tensor: one collective per exchange (per fragment), so
that latency is paid once and the byte count is exact.
"""

from __future__ import annotations

from typing import Iterable

import torch


class FlatTensors:
    """Gathers a list of same-dtype tensors into one flat buffer and scatters (or re-points) them back."""

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
        packed = self.packed()
        return packed.clone() if packed is not None else torch.cat([t.detach().reshape(-1) for t in self.tensors])

    def minus(self, ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The current values less the flat `ref`, written into the flat `out` (returned) without
        gathering a copy of them first (one buffer fewer at the peak of a lossy exchange)."""
        packed = self.packed()
        if packed is not None:
            return torch.sub(packed, ref, out=out)
        for t, r, o in zip(self.tensors, self.views(ref), self.views(out)):
            torch.sub(t.detach(), r, out=o)
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` shaped like the tensors (no copy)."""
        out, offset = [], 0
        for t in self.tensors:
            n = t.numel()
            out.append(flat[offset : offset + n].view_as(t))
            offset += n
        return out

    def packed(self) -> torch.Tensor | None:
        """The tensors as one flat view of their storage when they lie back to back in it, in order
        (as after `adopt`, or torch's averager), else None: one flat op then replaces a loop over
        the tensors."""
        first = self.tensors[0].detach()
        ptr, storage = first.data_ptr(), first.untyped_storage().data_ptr()
        for t in self.tensors:
            if t.data_ptr() != ptr or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage:
                return None
            ptr += t.numel() * t.element_size()
        return first.as_strided((self.numel,), (1,), first.storage_offset())

    def scatter(self, flat: torch.Tensor) -> None:
        """Copy `flat` back into the tensors in place (from wherever it lies: host memory too)."""
        flat = flat.to(self.device)
        with torch.no_grad():
            packed = self.packed()
            if packed is not None:
                packed.copy_(flat)
            else:
                torch._foreach_copy_([t.detach() for t in self.tensors], self.views(flat))

    def adopt(self, flat: torch.Tensor, views: list[torch.Tensor] | None = None) -> None:
        """Give the tensors `flat`'s values by making them views of it (no copy), as torch's
        `PeriodicModelAverager` does: one pass over the bytes cheaper than `scatter`. Only `.data`
        changes, so a Parameter keeps its identity (the optimizer's state, hooks and a DDP wrapper
        still refer to it); its previous storage no longer follows it. A non-contiguous tensor (a
        channels-last weight) is copied into instead, keeping its layout. `views`: `views(flat)`,
        made once for a buffer adopted again and again."""
        with torch.no_grad():
            for t, v in zip(self.tensors, views if views is not None else self.views(flat)):
                if t.is_contiguous():
                    t.data = v
                else:
                    t.copy_(v)
