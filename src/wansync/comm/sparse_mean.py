"""A sparse exchange's mean (`Exchange.mean` with a `comm.sparse.SparseCodec`): every worker's sparse
payload all-gathered, then decoded and added in fp32 in rank order by every rank.

A sparse payload cannot be summed on the wire (every worker chose its own indices), nor cut into a
reduce-scatter's chunks without densifying them, so it travels one way: each rank receives the M − 1
other payloads, (M − 1)·w bytes for a payload of w (the dense ring all-reduce of 4n bytes sends
2(M − 1)/M · 4n per rank; a lossy reduce-scatter 2(M − 1)/M of its payload). The sparse all-gather
thus wins while (M − 1)·w < 2(M − 1)/M · w_dense, i.e. for M < 2·w_dense/w: at SparseLoCo's defaults
(w ≈ 0.35 % of fp32's bytes plus tables) up to a few hundred workers against fp32, and about 150
against a dense int8 reduce-scatter (docs/performance.md has the table; the planner books the same
collectives, `comm.mean_cost`).

Side-band scalars ride after the payload as raw float32 and a "skip" guard's flag as one byte, as in
the lossy all-gather (`comm.lossy_mean`); a contribution the guard dropped sends zeros and is left out
of the mean (`all`: of the division; `chosen`: it chose nothing). With error feedback (`residual`) the
sender's residual becomes what its payload did not carry (`SparseCodec.encode_into`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from .lossy_mean import all_gather_rows
from .mean_cost import mean_collectives
from .payload import Payload, Sent, contributors

Gather = Callable[[torch.Tensor], tuple[list[torch.Tensor], Any]]  # a rank's bytes -> (every rank's, Work)


def sparse_mean(payload: Payload, group: Any, m: int, gather: Gather | None = None, blocked: bool = False) -> Sent:
    """Every rank's sparse payload (then the side band, then the guard's flag) all-gathered over the
    `m` ranks of `group` (or by `gather`: a fault-tolerant quorum's, `blocked` till it returns); the
    valid ones decoded and averaged in rank order (`aggregate_into`)."""
    codec, purpose, extra, weighted, valid = (
        payload.codec,
        payload.purpose,
        payload.extra,
        payload.weighted,
        payload.valid,
    )
    flat = payload.sent_values()
    numel = flat.numel() - extra
    size = codec.wire_bytes()
    wire = torch.empty(size + 4 * extra + int(weighted), dtype=torch.uint8, device=flat.device)
    residual = payload.residual.view(-1) if payload.residual is not None and valid else None
    codec.encode_into(flat[:numel], wire[:size], residual=residual)
    wire[size : size + 4 * extra] = flat[numel:].float().view(torch.uint8)
    if weighted:
        wire[-1] = int(valid)
    started_at = time.perf_counter()  # the wait of a blocking gather starts here, not before encoding
    gathered, work = (gather or (lambda data: all_gather_rows(data, group, m)))(wire)

    def finish() -> torch.Tensor:
        rows = [data for data in gathered if not weighted or int(data[-1])]  # rank order
        n = contributors(len(rows), purpose)
        mean = payload.target(numel + extra)
        codec.aggregate_into([data[:size] for data in rows], mean[:numel], n)
        if extra:  # a copy: the side band may start off a 4-byte boundary
            mean[numel:] = sum(data[size : size + 4 * extra].clone().view(torch.float32) for data in rows) / n
        return payload.land(mean)

    return Sent(
        work,
        finish,
        size,
        4 * extra,
        1 if weighted else 0,
        sent=sum(c.sent for c in mean_collectives(numel, codec, "allgather", m, extra, weighted)),
        parts=dict(codec.parts),
        blocked=blocked,
        participants=len(gathered) if blocked else None,
        started_at=started_at if blocked else None,
    )
