"""The sparse exchange (SparseLoCo's and DeMo's, `comm.sparse`): its bytes against the dense exchanges
over M workers, and its speed against a direct torch transcription of the reference code's
compress/decompress (CCLoco's), side by side in one run.

`--bytes` (real gloo groups of 2, 4 and 8 ranks, the tiny LM): every rank trains its own copy for a few
steps from the same start, then one exchange of Δ_m = θ_start − θ_m: what a rank's ledger books (its
payload, by kind: indices, values, tables) and what it put on the wire, for `sparseloco` at its defaults
(density 32/4096, 2 bits) and at 3 %, for DeMo's payload (float32 values, DCT), and for the dense means
(fp32's ring all-reduce; int8's and fp4's reduce-scatter, whose bytes per rank do not grow with M); and
`wansync plan`'s bytes for the same exchange beside the ledger's. The M at which the sparse all-gather
stops beating a dense one follows from the formula (the all-gather sends (M − 1)·w_sparse, the
reduce-scatter 2(M − 1)/M·w_dense): M* = 2·w_dense / w_sparse, printed from the measured payloads.

`--speed` (one process): encode (the chunks' top-k, the quantizer, the residual) for each of M workers'
buffers, then the mean of the M payloads (decode, scatter-add in rank order, divide, back into the
buffer's order), on a 100M-value transformer-shaped model (6 blocks of 1024-wide attention and a
4096-wide SwiGLU, an embedding of 4096 x 1024), wansync's `SparseCodec` against the reference's steps
written out per tensor (rearrange to blocks, the 2-D DCT as its einsum of basis matrices,
`torch.topk(x.abs())`, gather, the statistical quantizer with its scatter-add tables,
`scatter_reduce(..., "mean", include_self=False)` of a local and of the concatenated payloads, rearrange
back; its indices int64 and its codes uint8, as the reference sends them). With the DCT a third column
runs the same steps with the DCT as two matrix products, wansync's way, to show what the einsum costs. Best of `--reps`, M = 2 and 4, 2-bit and DCT (DeMo's float32 values); the ratio is wansync's time
over the peer's. Communication is not timed: the same all-gather for both.

    .venv/bin/python benchmarks/sparse_exchange.py --bytes [--workers 2,4,8]
    .venv/bin/python benchmarks/sparse_exchange.py --speed [--reps 3] [--values 100e6]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import time
from typing import Any

import torch

from wansync.runner.localgroup import run_ranks


# ---- bytes over M workers ---------------------------------------------------------------------------
CASES = {
    "sparseloco (defaults: 32/4096, 2-bit)": ("sparseloco", {}),
    "sparseloco 3 %, 2-bit": ("sparseloco", {"density": 0.03}),
    "demo's payload (32/4096, DCT, float32)": ("demo", {}),
    "fp32 all-reduce": ("diloco", {}),
    "int8 reduce-scatter": ("diloco", {"codec": "int8", "codec_collective": "reduce_scatter"}),
    "fp4 reduce-scatter": ("diloco", {"codec": "fp4", "codec_collective": "reduce_scatter"}),
}


def exchange_bytes(rank: int, world: int, steps: int) -> dict[str, Any]:
    from lossy_mean import pseudo_gradient  # the same real pseudo-gradients, of the tiny LM
    from wansync.comm.codecs import get_codec
    from wansync.comm.exchange import Exchange
    from wansync.strategies import make_options, strategy_class

    delta, model = pseudo_gradient(rank, world, steps, "tiny")
    shapes = [p.shape for p in model.parameters() if p.requires_grad]
    out = {}
    for label, (strategy, options) in CASES.items():
        opts = make_options(strategy, **options)
        codec = strategy_class(strategy).wire_codec(opts, shapes)
        exchange = Exchange()
        buf = delta.clone()
        exchange.mean(
            buf,
            "pseudo_grads",
            codec if codec.name != "fp32" else get_codec("fp32"),
            inplace=True,
            collective=getattr(opts, "codec_collective", "auto"),
            residual=torch.zeros_like(buf) if getattr(codec, "sparse", False) else None,
        )
        t = exchange.ledger.snapshot()["pseudo_grads"]
        out[label] = {"payload": t["bytes"], "sent": t["sent"], "parts": t.get("parts", {})}
    out["fp32_bytes"] = 4 * delta.numel()
    return out


def planned_bytes(world: int) -> dict[str, int]:
    """`wansync plan`'s payload per exchange for each case (the same layout, the same codecs)."""
    from wansync.net.wan import PRESETS
    from wansync.planner import of_name, setting
    from wansync.planner.schedule import trace

    size = of_name("tiny")
    out = {}
    for label, (strategy, options) in CASES.items():
        h = {"sync_every": 1} if strategy != "demo" else {}
        s = setting(
            strategy,
            {**options, **h, **({"drift_telemetry": False} if strategy == "diloco" else {})},
            size,
            world,
            PRESETS["lan"],
            0.1,
        )
        tr = trace(strategy, s.options, size, world, 1)
        out[label] = sum(
            a.transfer.payload
            for a in tr.steps[0]
            if a.kind == "issue" and a.transfer.purpose in ("pseudo_grads", "params", "momentum")
        )
    return out


def bytes_table(workers: list[int], steps: int) -> None:
    results = {m: run_ranks(exchange_bytes, m, steps, timeout=600)[0] for m in workers}
    fp32 = results[workers[0]]["fp32_bytes"]
    print(
        f"tiny LM ({fp32 // 4:,} values, {fp32 / 1e6:.2f} MB fp32); per rank per exchange, from the ledger; "
        f"'plan' is wansync plan's payload for the same exchange"
    )
    print()
    print("| exchange | M | payload | indices / values / tables | sent per rank | of fp32 ring's sent | plan/ledger |")
    print("|---|---|---|---|---|---|---|")
    for m in workers:
        plan = planned_bytes(m)
        ring = results[m]["fp32 all-reduce"]["sent"]
        for label in CASES:
            r = results[m][label]
            parts = (
                " / ".join(f"{r['parts'][k] / 1e3:.1f}" for k in ("indices", "values", "tables")) + " kB"
                if r["parts"]
                else "–"
            )
            print(
                f"| {label} | {m} | {r['payload'] / 1e3:.1f} kB | {parts} | {r['sent'] / 1e3:.1f} kB | "
                f"{r['sent'] / ring:.4f} | {plan[label] / r['payload']:.4f} |"
            )
    first = results[workers[0]]
    print()
    print(
        "The M where the sparse all-gather stops beating a dense mean, M* = 2·w_dense / w_sparse "
        "(from the payloads above; sent per rank: (M−1)·w_sparse against 2(M−1)/M·w_dense):"
    )
    print()
    print("| sparse payload | against fp32 ring | against int8 reduce-scatter | against fp4 reduce-scatter |")
    print("|---|---|---|---|")
    for label in [k for k in CASES if "sparseloco" in k or "demo" in k]:
        w = first[label]["payload"]
        cells = [
            f"{2 * first[d]['payload'] / w:.0f}"
            for d in ("fp32 all-reduce", "int8 reduce-scatter", "fp4 reduce-scatter")
        ]
        print(f"| {label} | " + " | ".join(cells) + " |")


# ---- speed against the reference's steps --------------------------------------------------------------
def model_shapes(values: float) -> list[tuple[int, ...]]:
    """A transformer-shaped model of about `values` values: an embedding, blocks of attention (4 of
    d x d) and SwiGLU (3 of d x 4d), two norms each."""
    d, ff, vocab = 1024, 4096, 4096
    block = 4 * d * d + 3 * d * ff + 2 * d
    shapes: list[tuple[int, ...]] = [(vocab, d)]
    for _ in range(max(1, round((values - vocab * d) / block))):
        shapes += [(d, d)] * 4 + [(ff, d), (ff, d), (d, ff), (d,), (d,)]
    return shapes


def _side(n: int, chunk: int) -> int:
    return max(v for v in range(1, min(n, chunk) + 1) if n % v == 0)


def _unblocks(c: torch.Tensor, dims: tuple[int, int, int, int], shape: torch.Size) -> torch.Tensor:
    rows, cols, h, w = dims
    return c.reshape(rows // h, cols // w, h, w).permute(0, 2, 1, 3).reshape(shape)


def _peer_quantize(val: torch.Tensor, bins: int, rng: float = 6.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's statistical quantizer, as it runs: its codes (uint8), shift and table."""
    shift = val.mean()
    c = val - shift
    std = c.norm() / math.sqrt(c.numel() - 1) if c.numel() > 1 else torch.zeros(())
    scale = rng * std / bins
    if scale == 0 or not torch.isfinite(scale):
        scale = torch.ones(())
    codes = (c / scale + bins // 2).round().clamp(0, bins - 1).to(torch.uint8)
    flat = codes.long().reshape(-1)
    sums = torch.zeros(bins).scatter_add_(0, flat, c.reshape(-1))
    counts = torch.zeros(bins).scatter_add_(0, flat, torch.ones_like(c.reshape(-1)))
    return codes, shift, torch.where(counts > 0, sums / counts, torch.zeros(()))


def _peer_dct(c4: torch.Tensor, mats: dict[int, torch.Tensor], inverse: bool, einsum: bool) -> torch.Tensor:
    """The 2-D DCT of (y, x, h, w) blocks as the reference code writes it: an einsum with the basis
    matrices (`einsum`), or as two matrix products (wansync's way, for comparison)."""
    dh, dw = mats[c4.shape[2]], mats[c4.shape[3]]
    if einsum:  # the reference's index strings: its f = Dᵀ (forward), b = D (inverse)
        return (
            torch.einsum("...ijbd,bk,dl->...ijkl", c4, dh, dw)
            if inverse
            else torch.einsum("...ijkl,kb,ld->...ijbd", c4, dh.T, dw.T)
        )
    return dh.T @ c4 @ dw if inverse else dh @ c4 @ dw.T


def peer_round(
    buffers: list[list[torch.Tensor]],
    errors: list[list[torch.Tensor]],
    k: int,
    bins: int | None,
    mats: dict[int, torch.Tensor] | None,
    einsum: bool = True,
    chunk: int = 64,
) -> list[torch.Tensor]:
    """The reference's compress / decompress, per tensor: every worker's payload and residual, then
    the mean of the M payloads (`mats`: the DCT's matrices, None without the DCT)."""

    def blocks4(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
        rows, cols = (1, x.shape[0]) if x.dim() == 1 else (x.shape[0], x.shape[1])
        h, w = _side(rows, chunk), _side(cols, chunk)
        return x.reshape(rows // h, h, cols // w, w).permute(0, 2, 1, 3), (rows, cols, h, w)  # a view

    payloads = []
    for bufs, errs in zip(buffers, errors):  # each worker: compress, keep the rest
        mine = []
        for x, e in zip(bufs, errs):
            c4, dims = blocks4(x)
            if mats is not None:
                c4 = _peer_dct(c4, mats, False, einsum)
            c = c4.reshape(-1, dims[2] * dims[3])
            kk = min(k, c.shape[1])
            idx = torch.topk(c.abs(), kk, dim=1, largest=True, sorted=False).indices
            val = torch.gather(c, 1, idx)
            if bins is not None:
                codes, shift, table = _peer_quantize(val, bins)
                sent = table[codes.long()] + shift
            else:
                codes, shift, table, sent = val, None, None, val
            local = torch.zeros_like(c).scatter_reduce_(1, idx, sent, "mean", include_self=False)
            local4 = local.view(c4.shape)
            if mats is not None:
                local4 = _peer_dct(local4, mats, True, einsum)
            e.copy_(x - _unblocks(local4.reshape(-1, dims[2] * dims[3]), dims, x.shape))
            mine.append((idx, codes, shift, table, dims, x.shape, c4.shape))
        payloads.append(mine)
    means = []
    for t in range(len(buffers[0])):  # every tensor: the mean of the M payloads
        idx = torch.cat([p[t][0] for p in payloads], dim=1)
        vals = torch.cat(
            [(p[t][3][p[t][1].long()] + p[t][2]) if bins is not None else p[t][1] for p in payloads], dim=1
        )
        dims, shape, shape4 = payloads[0][t][4], payloads[0][t][5], payloads[0][t][6]
        agg = torch.zeros(idx.shape[0], dims[2] * dims[3]).scatter_reduce_(1, idx, vals, "mean", include_self=False)
        agg4 = agg.view(shape4)
        if mats is not None:
            agg4 = _peer_dct(agg4, mats, True, einsum)
        means.append(_unblocks(agg4.reshape(-1, dims[2] * dims[3]), dims, shape))
    return means


def ours_round(codec: Any, flats: list[torch.Tensor], residuals: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    payloads = []
    for x, r in zip(flats, residuals):
        data = torch.empty(codec.wire_bytes(), dtype=torch.uint8)
        codec.encode_into(x, data, residual=r)
        payloads.append(data)
    return codec.aggregate_into(payloads, out, len(flats))


def speed(values: float, reps: int) -> None:
    from wansync.comm.chunks import ChunkLayout
    from wansync.comm.dct import dct_matrix
    from wansync.comm.sparse import SparseCodec

    shapes = model_shapes(values)
    layout = ChunkLayout.of_shapes(shapes)
    n = layout.numel
    print(
        f"{n / 1e6:.0f}M values in {len(shapes)} tensors; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"best of {reps}"
    )
    print()
    print(
        "| payload | M | wansync (s) | reference's steps (s) | wansync / reference | reference with matmul DCT (s) | wansync / that |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, bits, dct in (("2-bit, 32/4096 (SparseLoCo)", 2, False), ("float32, DCT, 32/4096 (DeMo)", 32, True)):
        codec = SparseCodec(layout, bits=bits, dct=dct)
        mats = {s: dct_matrix(s) for g in layout.groups for s in (g.h, g.w)} if dct else None
        for m in (2, 4):
            g = torch.Generator().manual_seed(m)
            flats = [torch.randn(n, generator=g) for _ in range(m)]
            bufs = [[f[p.offset : p.offset + p.numel].view(shapes[p.tensor]) for p in layout.pieces] for f in flats]
            residuals = [torch.empty(n) for _ in range(m)]
            errs = [[r[p.offset : p.offset + p.numel].view(shapes[p.tensor]) for p in layout.pieces] for r in residuals]
            out = torch.empty(n)
            ours, theirs, matmul = [], [], []
            for _ in range(reps):  # alternated, so that all see the same machine
                t0 = time.perf_counter()
                ours_round(codec, flats, residuals, out)
                ours.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                peer_round(bufs, errs, 32, 2**bits if bits != 32 else None, mats)
                theirs.append(time.perf_counter() - t0)
                if dct:
                    t0 = time.perf_counter()
                    peer_round(bufs, errs, 32, None, mats, einsum=False)
                    matmul.append(time.perf_counter() - t0)
            extra = f"{min(matmul):.3f} | {min(ours) / min(matmul):.2f}" if matmul else "– | –"
            print(f"| {label} | {m} | {min(ours):.3f} | {min(theirs):.3f} | {min(ours) / min(theirs):.2f} | {extra} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", action="store_true")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--workers", default="2,4,8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--values", type=float, default=100e6)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    print(
        f"{datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    if args.bytes or not args.speed:
        bytes_table([int(w) for w in args.workers.split(",")], args.steps)
        print()
    if args.speed or not args.bytes:
        speed(args.values, args.reps)


if __name__ == "__main__":
    main()
