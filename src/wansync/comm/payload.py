"""What one `Exchange.mean` carries through its pipeline: the payload a rank puts in (`Payload`) and
the payload on its way (`Sent`), shared by the exchange and the collectives that move it
(`exchange`'s fp32 all-reduce and quorum mean, `lossy_mean`'s two lossy paths)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import NonFiniteError
from .codecs import Codec


@dataclass
class Payload:
    """What this rank puts into one `mean`: the buffer (values, then `extra` side-band scalars), where
    the mean lands, and the non-finite guard's verdict on the values."""

    buf: torch.Tensor
    purpose: str
    codec: Codec
    extra: int
    dest: torch.Tensor | None  # `buf` itself with `inplace`, else None (a new tensor)
    valid: bool  # the values may count (finite, or not checked)
    weighted: bool  # a weight (fp32) or flag (lossy) rides along: "skip" may drop it
    collective: str = "auto"  # a lossy mean's: allgather | reduce_scatter | auto (LOSSY_COLLECTIVES)
    residual: torch.Tensor | None = None  # error feedback: what the codec dropped of this worker's values

    @property
    def values_bytes(self) -> int:
        return (self.buf.numel() - self.extra) * self.buf.element_size()

    def sent_values(self) -> torch.Tensor:
        """The flat float32 buffer to send: zeros for a contribution the guard dropped ("skip")."""
        flat = self.buf.detach().reshape(-1)
        return flat if self.valid else torch.zeros_like(flat)

    def target(self, n: int) -> torch.Tensor:
        """Where the flat mean of `n` values is put together: the destination itself when it is a
        flat float32 buffer of its own, else a new one (`land` copies it over)."""
        dest = self.dest
        if dest is not None and dest.dtype == torch.float32 and dest.is_contiguous() and dest.numel() == n:
            return dest.view(-1)
        return torch.empty(n, dtype=torch.float32, device=self.buf.device)

    def land(self, mean: torch.Tensor) -> torch.Tensor:
        """The mean in the destination (`inplace`), or the flat mean itself."""
        dest = self.dest
        if dest is None:
            return mean
        if mean.data_ptr() != dest.data_ptr():
            dest.copy_(mean.view_as(dest))
        return dest


@dataclass
class Sent:
    """A payload on its way: what to wait for, how its mean is finished once it has arrived, and
    the bytes this rank put on the wire (values, side band, guard)."""

    work: Any  # the collective's Work; None: nothing to wait for
    finish: Callable[[], torch.Tensor]  # the mean of what was sent (this rank's shard, sharded)
    wire_bytes: int
    side_bytes: int
    guard_bytes: int
    blocked: bool = False  # sending waited for the mean already (the quorum's)
    participants: int | None = None  # the workers in the quorum that averaged it
    sent: int | None = None  # what this rank transmits in all (None: the payload)
    advance: Callable[[], None] | None = None  # a two-phase mean: finish the first, start the second
    parts: dict[str, int] | None = None  # a sparse payload's bytes by kind (indices, values, tables)
    started_at: float | None = None  # blocked: when the collective began (perf_counter), after encoding


def contributors(n: float, purpose: str) -> float:
    """What a mean divides by: the number (or summed weight) of valid contributions, never 0."""
    if n == 0:
        raise NonFiniteError(f"every worker's {purpose} was non-finite: nothing left to average")
    return n
