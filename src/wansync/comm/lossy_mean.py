"""The two ways a lossy codec's mean travels between the workers (`Exchange`; `mean_cost.lossy_path`
picks one): every rank's encoded payload all-gathered, or an all-to-all of encoded chunks reduced,
re-encoded and all-gathered. A lossy codec cannot be summed on the wire (every rank has its own
scales), so both decode and accumulate in fp32 in rank order: the same bytes summed in the same
order, the same bits on every rank (the strategies' anchors must not drift apart).

Memory: both encode and decode block by block (`codecs.encode_into`, `decode_into`) and write the
mean into the destination when there is one (`inplace`), so for a buffer of s fp32 bytes whose
payload is w = wire(s), what a mean allocates beyond one block's temporaries (`codecs.BLOCK_VALUES`)
is what travels: the all-gather's payload and the M it gathers, (1 + M)·w; the reduce-scatter's send
and receive buffers, this rank's re-encoded chunk and the M gathered ones, (3 + 1/M)·w; and, without
a destination, the mean itself, s (`planner.memory` books the same)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from .codecs import Codec, decode_into, encode_into
from .ledger import CommLedger
from .mean_cost import mean_collectives
from .payload import Payload, Sent, contributors


def all_gather_mean(payload: Payload, group: Any, m: int) -> Sent:
    """Every rank's encoded payload (then the side-band scalars as raw float32; weighted: then a
    validity flag) all-gathered over the `m` ranks of `group`; each decodes and accumulates the valid
    ones in fp32, in rank order, and divides by their number."""
    codec, purpose, extra, weighted, valid = (
        payload.codec,
        payload.purpose,
        payload.extra,
        payload.weighted,
        payload.valid,
    )
    flat = payload.sent_values()
    numel = flat.numel() - extra
    size = codec.wire_bytes(numel)
    wire = torch.empty(size + 4 * extra + int(weighted), dtype=torch.uint8, device=flat.device)
    encode_into(codec, flat[:numel], wire)
    if payload.residual is not None and valid:
        _keep_dropped(codec, flat[:numel], [(0, numel, wire[:size], numel)], payload.residual)
    wire[size : size + 4 * extra] = flat[numel:].float().view(torch.uint8)
    if weighted:
        wire[-1] = int(valid)
    gathered, work = all_gather_rows(wire, group, m)

    def finish() -> torch.Tensor:
        acc, n = payload.target(numel + extra).zero_(), 0
        for data in gathered:  # rank order: the same sum, bit for bit, on every rank
            if weighted and not int(data[-1]):
                continue
            if extra:  # a copy: the side band may start off a 4-byte boundary
                acc[numel:] += data[size : size + 4 * extra].clone().view(torch.float32)
            decode_into(codec, data[:size], numel, acc[:numel], add=True)
            n += 1
        return payload.land(acc.div_(contributors(n, purpose)))

    return Sent(
        work,
        finish,
        size,
        4 * extra,
        1 if weighted else 0,
        sent=sum(c.sent for c in mean_collectives(numel, codec, "allgather", m, extra, weighted)),
    )


def reduce_scatter_mean(payload: Payload, group: Any, m: int, ledger: CommLedger) -> Sent:
    """The values cut into `m` chunks of q (the last zero-padded), each encoded on its own; an
    all-to-all sends chunk j of every rank to rank j (with the side band as raw float32 and,
    weighted, a validity flag); rank j decodes and sums them in fp32 in rank order, divides by the
    valid contributors and re-encodes that mean chunk; the mean chunks are all-gathered and decoded.
    Every rank decodes the same bytes: the same bits everywhere. The all-gather starts at
    `MeanHandle.advance` (an overlapped sync: halfway through its overlap), else when the mean is
    waited for; the time blocked on either phase is booked as waiting."""
    codec, purpose, extra, weighted, valid = (
        payload.codec,
        payload.purpose,
        payload.extra,
        payload.weighted,
        payload.valid,
    )
    flat = payload.sent_values()
    numel = flat.numel() - extra
    q = -(-numel // m)  # chunk length
    per = codec.wire_bytes(q)
    piece = per + 4 * extra + int(weighted)
    send = torch.empty(m * piece, dtype=torch.uint8, device=flat.device)
    spans = [(j * q, max(j * q, min((j + 1) * q, numel))) for j in range(m)]
    side = flat[numel:].float().view(torch.uint8)
    for j, (a, b) in enumerate(spans):
        encode_into(codec, flat[a:b], send[j * piece : j * piece + per], numel=q)
        send[j * piece + per : j * piece + per + 4 * extra] = side
        if weighted:
            send[(j + 1) * piece - 1] = int(valid)
    if payload.residual is not None and valid:
        _keep_dropped(
            codec,
            flat[:numel],
            [(a, b, send[j * piece : j * piece + per], q) for j, (a, b) in enumerate(spans)],
            payload.residual,
        )
    recv = torch.empty_like(send)
    if dist.is_initialized():
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    else:
        recv.copy_(send)
        work = None

    second: dict[str, Any] = {}  # the all-gather of the mean chunks, once started

    def advance() -> None:
        if second:
            return
        acc, side_sum, n = torch.zeros(q, dtype=torch.float32, device=flat.device), None, 0
        for i in range(m):  # rank order: the same sum everywhere
            data = recv[i * piece : (i + 1) * piece]
            if weighted and not int(data[-1]):
                continue
            if extra:  # a copy: 4-byte aligned
                raw = data[per : per + 4 * extra].clone().view(torch.float32)
                side_sum = raw if side_sum is None else side_sum + raw
            decode_into(codec, data[:per], q, acc, add=True)
            n += 1
        n = contributors(n, purpose)
        mine = encode_into(codec, acc.div_(n), torch.empty(per, dtype=torch.uint8, device=flat.device))
        gathered, work2 = all_gather_rows(mine, group, m)
        second.update(gathered=gathered, work=work2, n=n, side=side_sum)

    def finish() -> torch.Tensor:
        advance()
        t0 = time.perf_counter()
        if second["work"] is not None:
            second["work"].wait()
        ledger.waited(purpose, time.perf_counter() - t0)
        mean = payload.target(numel + extra)
        for (a, b), data in zip(spans, second["gathered"]):
            if b > a:
                decode_into(codec, data, q, mean[a:b])
        if extra:
            mean[numel:] = second["side"].div_(second["n"])
        return payload.land(mean)

    return Sent(
        work,
        finish,
        codec.wire_bytes(numel),
        4 * extra,
        1 if weighted else 0,
        sent=sum(c.sent for c in mean_collectives(numel, codec, "reduce_scatter", m, extra, weighted)),
        advance=advance,
    )


def all_gather_rows(data: torch.Tensor, group: Any, m: int) -> tuple[list[torch.Tensor], Any]:
    """Every rank's `data` (the same size on every rank), in rank order, as views of one buffer
    (all_gather_single: no flat copy beside a list of outputs, which `all_gather` makes), and
    the Work to wait for."""
    if not dist.is_initialized():
        return [data], None
    out = torch.empty(m * data.numel(), dtype=data.dtype, device=data.device)
    work = dist.all_gather_single(out, data, group=group, async_op=True)
    return list(out.view(m, -1).unbind(0)), work


def _keep_dropped(
    codec: Codec, values: torch.Tensor, pieces: list[tuple[int, int, torch.Tensor, int]], residual: torch.Tensor
) -> None:
    """Error feedback: `residual` becomes what the codec dropped of `values`, values − decode(payload),
    from the encoded pieces (a, b, data, encoded length) that cover them."""
    r = residual.view(-1)
    for a, b, data, numel in pieces:
        if b > a:
            decode_into(codec, data, numel, r[a:b])
    torch.sub(values, r, out=r)
