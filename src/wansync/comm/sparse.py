"""A sparse payload: what one worker sends of a buffer in a sparse exchange (SparseLoCo's error-fed
pseudo-gradient, DeMo's momentum), and how the workers' payloads become one mean.

Per chunk (`comm.chunks`: 2-D blocks of matrices, 1-D chunks of vectors), optionally in the DCT
domain (`comm.dct`), the k values of largest magnitude (`comm.topk`); their chunk-local indices,
packed to the bits a chunk's size needs (`comm.bitpack`: 12 for a 64 × 64 block); their values,
quantized by the statistical quantizer (`comm.quantize`, a lookup table per tensor) or sent as
float32 (`bits` 32). Every payload of a layout has the same size, so the exchange all-gathers them
(`comm.sparse_mean`) and every rank decodes and adds the same bytes in rank order, in fp32: the
same bits on every rank. Group by group (g: N_g chunks of c_g values, k_g kept, S_g tensors)::

    floats   per group: each tensor's shift and table, 4·S_g·(2^bits + 1) B (raw values: 4·N_g·k_g B instead)
    ints     per group: N_g·k_g indices of ⌈log2 c_g⌉ bits, then (quantized) N_g·k_g codes of `bits` bits

    wire = Σ_g ⌈N_g·k_g·⌈log2 c_g⌉ / 8⌉ + ⌈N_g·k_g·bits / 8⌉ + 4·S_g·(2^bits + 1)

At SparseLoCo's defaults (64 × 64 blocks, k = 32, 2 bits) a block of 4096 fp32 values (16 KB) sends
32 × (12 + 2) bits = 56 B: 0.34 % of fp32, before the tables.

Aggregation (`aggregate`): `chosen`, per index the mean over the workers that sent it (the reference
code's `scatter_reduce(..., "mean", include_self=False)`: an index two of four workers chose gets the
mean of their two values, not half of their sum), or `all`, the sum over the workers divided by their
number (a worker that did not choose an index counts as a zero there). Both are the same at density 1.

Memory: encoding and aggregating take a run of about `BATCH_VALUES` values' chunks at a time (their
copy, their magnitudes or DCT coefficients, the mean's accumulator and count: a few buffers of 16 MB);
what grows with the model is the chosen entries, a few per cent of its values (their indices as
int64 and their values while a group is encoded, one payload's while it is decoded), and the
payloads: this rank's and the M gathered.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import torch

from .bitpack import alignment, pack, packed_bytes, unpack
from .choices import AGGREGATES, DEFAULT_DENSITY
from .chunks import ChunkLayout, Group
from .dct import BlockDCT
from .quantize import RANGE_SIGMAS, RAW, dequantize, quantize, table_bytes
from .topk import chunk_topk, kept_per_chunk

#: values of a run of chunks taken out at once: the dense work's buffers (the chunks, their
#: magnitudes or coefficients, the mean's accumulator and count) stay about 16 MB each
BATCH_VALUES = 1 << 22


def batches(chunks: int, size: int, k: int, bit_widths: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Runs of about `BATCH_VALUES` values covering `chunks` chunks of `size`, each starting where the
    packed streams of its k entries per chunk (of these widths) start on a byte of their own."""
    step = 1
    for bits in bit_widths:
        a = alignment(bits)
        step = math.lcm(step, a // math.gcd(a, k))
    per = max(step, BATCH_VALUES // max(size, 1) // step * step)
    return tuple((a, min(a + per, chunks)) for a in range(0, chunks, per))


def is_sparse(codec: Any) -> bool:
    """Is this what an exchange sends a sparse payload (`SparseCodec`), not a dense codec's?"""
    return isinstance(codec, SparseCodec)


@dataclass(frozen=True)
class Section:
    """One group's part of a payload: its chunks' k, and where its bytes lie."""

    group: Group
    k: int
    index_bits: int
    segment: torch.Tensor  # each chunk's tensor, numbered within the group (int64)
    segments: int
    floats: slice  # the tables (quantized) or the values (raw), float32
    indices: slice
    codes: slice  # quantized values' codes (empty for raw values)
    batches: tuple[tuple[int, int], ...]  # runs of chunks worked on at once (`BATCH_VALUES`)

    @property
    def kept(self) -> int:
        return self.group.chunks * self.k


@dataclass(frozen=True)
class SparseCodec:
    """The sparse payload of a buffer laid out as `layout` (see the module docstring)."""

    layout: ChunkLayout
    density: float = DEFAULT_DENSITY
    topk: int = 0  # values kept per chunk (0: from density)
    bits: int = 2  # per value: 2-8 (statistical quantizer) or 32 (float32 values)
    range_sigmas: float = RANGE_SIGMAS
    dct: bool = False
    aggregate: str = "chosen"

    name: ClassVar[str] = "sparse"

    def __post_init__(self) -> None:
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {', '.join(AGGREGATES)}, got {self.aggregate!r}")

    # ---- the payload's shape ---------------------------------------------------------------------
    @cached_property
    def sections(self) -> tuple[Section, ...]:
        raw = self.bits == RAW
        specs = []
        for g in self.layout.groups:
            k = kept_per_chunk(g.size, self.density, self.topk)
            tensors = torch.unique(g.chunk_tensor, sorted=True)
            segment = torch.searchsorted(tensors, g.chunk_tensor)
            floats = 4 * g.chunks * k if raw else table_bytes(len(tensors), self.bits)
            specs.append((g, k, (g.size - 1).bit_length(), segment, len(tensors), floats))
        out, at = [], sum(s[5] for s in specs)  # the floats of every group first, then the ints
        float_at = 0
        for g, k, ib, segment, segments, floats in specs:
            n = g.chunks * k
            idx_bytes, code_bytes = packed_bytes(n, ib), 0 if raw else packed_bytes(n, self.bits)
            out.append(
                Section(
                    g,
                    k,
                    ib,
                    segment,
                    segments,
                    slice(float_at, float_at + floats),
                    slice(at, at + idx_bytes),
                    slice(at + idx_bytes, at + idx_bytes + code_bytes),
                    batches(g.chunks, g.size, k, (ib,) if raw else (ib, self.bits)),
                )
            )
            float_at += floats
            at += idx_bytes + code_bytes
        return tuple(out)

    @cached_property
    def parts(self) -> dict[str, int]:
        """This payload's bytes by kind: indices, values (codes or float32) and the quantizer's tables."""
        idx = sum(s.indices.stop - s.indices.start for s in self.sections)
        if self.bits == RAW:
            return {"indices": idx, "values": sum(s.floats.stop - s.floats.start for s in self.sections), "tables": 0}
        return {
            "indices": idx,
            "values": sum(s.codes.stop - s.codes.start for s in self.sections),
            "tables": sum(s.floats.stop - s.floats.start for s in self.sections),
        }

    @property
    def kept(self) -> int:
        """Values a payload sends."""
        return sum(s.kept for s in self.sections)

    def wire_bytes(self, numel: int | None = None) -> int:
        """The payload's bytes for the layout's buffer; for `numel` values of another size (a shard's,
        in the cost model) the same bytes per value."""
        whole = sum(self.parts.values())
        if numel is None or numel == self.layout.numel or self.layout.numel == 0:
            return whole
        return -(-whole * numel // self.layout.numel)

    def restrict(self, start: int, stop: int) -> "SparseCodec":
        """The payload of the values [start, stop) only (a worker's rank's shard, `ChunkLayout.bounds`),
        made once per shard: an exchange asks for the same one every time."""
        made: dict[tuple[int, int], SparseCodec] = self.__dict__.setdefault("_restricted", {})
        if (start, stop) not in made:
            made[(start, stop)] = dataclasses.replace(self, layout=self.layout.restrict(start, stop))
        return made[(start, stop)]

    def bounds(self, parts: int) -> list[int]:
        """`ChunkLayout.bounds`, made once per number of parts."""
        made: dict[int, list[int]] = self.__dict__.setdefault("_bounds", {})
        if parts not in made:
            made[parts] = self.layout.bounds(parts)
        return made[parts]

    def _dct(self, s: Section, device: torch.device) -> BlockDCT:
        cache: dict[Any, BlockDCT] = self.__dict__.setdefault("_dcts", {})
        key = (s.group.h, s.group.w, device)
        if key not in cache:
            cache[key] = BlockDCT(s.group.h, s.group.w, torch.float32, device)
        return cache[key]

    # ---- one worker's payload ------------------------------------------------------------------------
    def encode_into(self, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The payload of the flat float32 `x` written into the uint8 `out` (returned, `wire_bytes()`
        long). `residual` (error feedback): set to what was not sent, x − decode(payload): exactly 0
        where a value went unquantized (with the DCT: when every coefficient did). A group's chunks
        are chosen a run at a time (`batches`), then its values quantized together (a table per
        tensor), then, for the residual, each run taken out once more."""
        out = out[: self.wire_bytes()]
        for s in self.sections:
            idx = torch.empty(s.group.chunks, s.k, dtype=torch.int64, device=x.device)
            vals = torch.empty(s.group.chunks, s.k, dtype=torch.float32, device=x.device)
            for a, b in s.batches:
                idx[a:b], vals[a:b] = chunk_topk(self._chosen_domain(s, s.group.take(x, a, b)), s.k)
            pack(idx, s.index_bits, out[s.indices])
            sent = self._encode_values(s, vals, out)
            if residual is not None:
                self._keep_rest(s, x, idx, vals, sent, residual)
        return out

    def _keep_rest(
        self,
        s: Section,
        x: torch.Tensor,
        idx: torch.Tensor,
        vals: torch.Tensor,
        sent: torch.Tensor,
        residual: torch.Tensor,
    ) -> None:
        """The section's part of `residual` set to x less what its payload decodes to: the decoded
        values put where they came from, a run of chunks at a time (with the DCT, back from the
        coefficients: IDCT of the sent ones, as the reference code computes it), then x minus them over
        each piece's values in one pass; at a chosen value x − Q(x), exactly 0 unquantized. With the DCT
        and every coefficient sent, IDCT of their rounding alone (0 when unquantized)."""
        every = self.dct and s.k == s.group.size
        for a, b in s.batches:
            dense = torch.zeros(b - a, s.group.size, device=x.device)
            dense.scatter_(1, idx[a:b], vals[a:b] - sent[a:b] if every else sent[a:b])
            s.group.put(self._dct(s, x.device).inverse(dense) if self.dct else dense, residual, a, b)
        if not every:
            for p in s.group.pieces:
                span = slice(p.offset, p.offset + p.numel)
                torch.sub(x[span], residual[span], out=residual[span])

    def _chosen_domain(self, s: Section, chunks: torch.Tensor) -> torch.Tensor:
        """The chunks where their values are chosen: their DCT coefficients, or themselves (a copy)."""
        return self._dct(s, chunks.device).forward(chunks) if self.dct else chunks

    def _encode_values(self, s: Section, vals: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the chosen values (quantized, or as float32) and return what they decode to."""
        if self.bits == RAW:
            out[s.floats].copy_(vals.contiguous().view(-1).view(torch.uint8))
            return vals
        seg = s.segment.to(vals.device).repeat_interleave(s.k)
        q = quantize(vals, seg, s.segments, self.bits, self.range_sigmas)
        out[s.floats].copy_(torch.cat([q.shift.view(-1, 1), q.table], dim=1).view(-1).view(torch.uint8))
        pack(q.codes, self.bits, out[s.codes])
        return dequantize(q.codes, seg, q.shift, q.table).view_as(vals)

    def _entries(self, s: Section, data: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One payload's entries of chunks [a, b) of a section: (indices, float32 values), (b − a, k)."""
        n, start = (b - a) * s.k, a * s.k
        idx = unpack(data[s.indices], n, s.index_bits, start).view(-1, s.k)
        if self.bits == RAW:
            return idx, data[s.floats][4 * start : 4 * (start + n)].clone().view(torch.float32).view(-1, s.k)
        tables = data[s.floats].clone().view(torch.float32).view(s.segments, 2**self.bits + 1)  # a copy: aligned
        seg = s.segment[a:b].to(data.device).repeat_interleave(s.k)
        codes = unpack(data[s.codes], n, self.bits, start)
        return idx, dequantize(codes, seg, tables[:, 0].contiguous(), tables[:, 1:]).view(-1, s.k)

    def decode_into(self, data: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """One payload (`wire_bytes()` uint8) decoded into the flat float32 `out` (returned): the values it
        sent where they came from, 0 elsewhere (the mean of one payload: `aggregate_into`)."""
        return self.aggregate_into([data], out, 1.0)

    # ---- every worker's payloads: the mean -------------------------------------------------------------
    def aggregate_into(self, payloads: list[torch.Tensor], out: torch.Tensor, contributors: float) -> torch.Tensor:
        """The mean of the payloads (each `wire_bytes()` uint8, in rank order) written into the flat
        float32 `out` (returned): decoded and added in fp32 in the order given, then divided per
        index by how many sent it (`chosen`) or by `contributors` (`all`), then back from the DCT
        domain and into the buffer's order, a run of chunks at a time. Every value of `out` is written."""
        for s in self.sections:
            for a, b in s.batches:
                acc = torch.zeros(b - a, s.group.size, dtype=torch.float32, device=out.device)
                count = torch.zeros_like(acc) if self.aggregate == "chosen" else None
                for data in payloads:
                    idx, vals = self._entries(s, data, a, b)
                    acc.scatter_add_(1, idx, vals)
                    if count is not None:
                        count.scatter_add_(1, idx, torch.ones_like(vals))
                if count is not None:
                    acc.div_(count.clamp_(min=1))
                else:
                    acc.div_(contributors)
                s.group.put(self._dct(s, out.device).inverse(acc) if self.dct else acc, out, a, b)
        return out
