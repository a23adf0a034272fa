"""A mean weighted by each worker's share of the work: Σ_m w_m x_m / Σ_m w_m.

Workers of different speeds under a slow policy (`strategies.pace`) contribute the steps they
computed, and each contribution weighs by them. The weight rides on the exchange that happens anyway,
as one more side-band element (`Exchange.mean`'s `extra`): every worker sends w_m·x_m and w_m, the
exchange averages both over the M workers as it averages anything (any codec, any collective), and
the ratio of the two means is the weighted mean. A lossy codec quantizes w_m·x_m; its error feedback
keeps what it dropped of that product.

The non-finite check and the norms the handle reports are the weighted mean's, measured after the
division (`Exchange._measure`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import NonFiniteError


def weighted_mean(
    exchange: Any,
    handle_type: Any,
    buf: torch.Tensor,
    weight: float,
    purpose: str,
    *,
    codec: Any,
    async_op: bool,
    inplace: bool,
    extra: int,
    mean_sq: bool,
    collective: str,
    residual: torch.Tensor | None,
    replay: bool,
) -> Any:
    """`exchange.mean(buf, ...)` weighted by this worker's `weight` (module docstring): a handle of
    `handle_type` (the exchange's `MeanHandle`) whose wait gives the weighted mean."""
    if not weight >= 0:
        raise ValueError(f"a contribution's weight must be >= 0, got {weight!r}")
    flat = buf.detach().reshape(-1)
    n = flat.numel() - extra
    wire = torch.empty(flat.numel() + 1, dtype=flat.dtype, device=flat.device)
    torch.mul(flat[:n], weight, out=wire[:n])
    wire[n : n + extra] = flat[n:]
    wire[-1] = weight
    inner = exchange.mean(
        wire,
        purpose,
        codec,
        async_op=async_op,
        inplace=True,
        extra=extra + 1,
        collective=collective,
        residual=residual,
        replay=replay,
    )

    def finish() -> torch.Tensor:
        mean = inner.wait()
        total = float(mean[-1])
        if not total > 0:
            raise NonFiniteError(f"the workers' {purpose} weigh nothing (every weight was 0): nothing to average")
        out = buf if inplace else torch.empty_like(buf)
        view = out.view(-1)
        torch.div(mean[:n], total, out=view[:n])
        view[n:] = mean[n : n + extra]
        exchange._measure(handle, out, buf, extra, purpose, mean_sq)
        handle.waited_s, handle.participants = inner.waited_s, inner.participants
        return out

    handle = handle_type(
        exchange.ledger, purpose, None, finish, inner.wire_bytes, inner.payload_bytes, inner.started_at
    )
    handle._advance = inner.advance
    if not async_op:
        handle.wait()
    return handle
