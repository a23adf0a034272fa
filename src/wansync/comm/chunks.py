"""How a sparse exchange (SparseLoCo, DeMo) cuts a model's tensors into chunks, and takes their values
out in chunk order and puts them back.

The rule is the reference code's (CCLoco and DeMo's chunking): a matrix of R × C values is cut into
whole blocks of h × w, h the largest divisor of R not above `chunk` (64 by default) and w the same of
C; a vector of n values into 1-D chunks of w, the largest divisor of n not above `chunk`. Ours beyond
it: a tensor of three or more dimensions is a matrix of its first dimension by the rest (a
convolution's out × in·kh·kw; the reference takes matrices and vectors only), and a scalar one chunk
of one value. A dimension with no divisor near `chunk` (a prime) gets blocks of side 1: the
reference's rule, kept, which sends such a tensor nearly whole (its chunks are small).

A `ChunkLayout` places the tensors of one flat buffer (in `comm.flat.FlatTensors` order) as `Piece`s:
where each starts, its 2-D shape, its block. Pieces with the same block form a `Group`; its chunks, or
any run of them, are taken out as one (chunks, h·w) matrix (`take`) and written back (`put`): top-k,
the DCT and the mean work on a run of chunks at a time (`comm.sparse`), never on a reordered copy of
the whole buffer.

Between the ranks of a worker with DDP inside, each rank sends its own shard of the buffer
(`comm.worker_shards`); a layout is cut there between tensors where that keeps the shards near-equal,
else at whole rows of blocks (`bounds`, `restrict`), so every chunk lies whole in one shard and each
shard's chunks are the whole layout's (a tensor cut in two is quantized as two, a table each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Iterator, Sequence

import torch

DEFAULT_CHUNK = 64


def chunk_side(n: int, target: int) -> int:
    """The largest divisor of `n` not above `target` (`n` itself when it is smaller)."""
    for d in range(min(n, target), 0, -1):
        if n % d == 0:
            return d
    return 1


def as_matrix(shape: Sequence[int]) -> tuple[int, int]:
    """The 2-D shape a tensor is chunked as: a vector is one row, a tensor of three or more
    dimensions its first dimension by the rest, a scalar 1 × 1."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, int(shape[0])
    return int(shape[0]), math.prod(int(s) for s in shape[1:])


@dataclass(frozen=True)
class Piece:
    """One tensor, or whole rows of blocks of one, in the flat buffer: values [offset, offset +
    rows·cols) as a rows × cols matrix cut into blocks of h × w."""

    offset: int
    rows: int
    cols: int
    h: int
    w: int
    tensor: int  # which of the layout's tensors (the quantizer's segment)

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def chunks(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The piece's values of the flat buffer as (rows/h, cols/w, h, w): block (i, j) at [i, j], a
        strided view (no copy)."""
        x = flat[self.offset : self.offset + self.numel].view(self.rows // self.h, self.h, self.cols // self.w, self.w)
        return x.permute(0, 2, 1, 3)


@dataclass(frozen=True)
class Group:
    """The pieces whose chunks have the same block h × w: one (chunks, h·w) matrix."""

    h: int
    w: int
    pieces: tuple[Piece, ...]

    @property
    def size(self) -> int:
        """Values per chunk."""
        return self.h * self.w

    @cached_property
    def chunks(self) -> int:
        return sum(p.chunks for p in self.pieces)

    @cached_property
    def chunk_tensor(self) -> torch.Tensor:
        """Which of the layout's tensors each chunk belongs to (int64, one per chunk)."""
        return torch.cat([torch.full((p.chunks,), p.tensor, dtype=torch.int64) for p in self.pieces])

    def take(self, flat: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The group's chunks [start, stop) of the flat buffer as a new (chunks, h·w) matrix."""
        stop = self.chunks if stop is None else stop
        out = torch.empty(stop - start, self.size, dtype=flat.dtype, device=flat.device)
        for row, view in self._blocks(flat, start, stop):
            out[row : row + view.shape[0] * view.shape[1]].view(view.shape).copy_(view)
        return out

    def put(self, chunks: torch.Tensor, flat: torch.Tensor, start: int = 0, stop: int | None = None) -> None:
        """Write the (chunks, h·w) matrix of chunks [start, stop) back where `take` found them."""
        stop = self.chunks if stop is None else stop
        for row, view in self._blocks(flat, start, stop):
            view.copy_(chunks[row : row + view.shape[0] * view.shape[1]].view(view.shape))

    def _blocks(self, flat: torch.Tensor, start: int, stop: int) -> Iterator[tuple[int, torch.Tensor]]:
        """The chunks [start, stop) as rectangles of blocks (views of the flat buffer, (ny, nx, h, w)),
        each with the row of the (chunks, h·w) matrix its first block goes to: a piece's partial row
        of blocks, its whole rows, and a partial row at the end."""
        first = 0
        for p in self.pieces:
            a, b = max(start, first) - first, min(stop, first + p.chunks) - first
            per_row = p.cols // p.w
            while a < b:
                y, x = divmod(a, per_row)
                if x == 0 and b - a >= per_row:  # whole rows of blocks
                    n = (b - a) // per_row
                    yield first + a - start, p.view(flat)[y : y + n]
                    a += n * per_row
                else:
                    end = min(b, (y + 1) * per_row)
                    yield first + a - start, p.view(flat)[y : y + 1, x : x + end - a]
                    a = end
            first += p.chunks


@dataclass(frozen=True)
class ChunkLayout:
    """The pieces of a flat buffer of `numel` values (`of_shapes`), grouped by block."""

    pieces: tuple[Piece, ...]
    numel: int
    tensors: int  # how many tensors the pieces come from

    @classmethod
    def of_shapes(cls, shapes: Iterable[Sequence[int]], chunk: int = DEFAULT_CHUNK) -> "ChunkLayout":
        """The layout of tensors of these shapes laid end to end (empty ones take no piece)."""
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        pieces, offset, count = [], 0, 0
        for i, shape in enumerate(shapes):
            rows, cols = as_matrix(shape)
            count = i + 1
            if rows * cols == 0:
                continue
            pieces.append(Piece(offset, rows, cols, chunk_side(rows, chunk), chunk_side(cols, chunk), i))
            offset += rows * cols
        return cls(tuple(pieces), offset, count)

    @cached_property
    def groups(self) -> tuple[Group, ...]:
        """The pieces by block, in order of each block's first piece."""
        by: dict[tuple[int, int], list[Piece]] = {}
        for p in self.pieces:
            by.setdefault((p.h, p.w), []).append(p)
        return tuple(Group(h, w, tuple(ps)) for (h, w), ps in by.items())

    @property
    def largest_side(self) -> int:
        """The longest side of any tensor: a `chunk` beyond it cuts nothing."""
        return max((max(p.rows, p.cols) for p in self.pieces), default=0)

    # ---- shards: whole rows of blocks ---------------------------------------------------------------
    def bounds(self, parts: int) -> list[int]:
        """Where `parts` near-equal shards of the buffer start (and the last ends): at each even
        split, the nearest start of a tensor when it is within a quarter of a shard (a tensor whole in
        one shard keeps one quantizer table, as it has at one rank per worker), else the nearest
        start of a row of blocks."""
        tensors = sorted({p.offset for p in self.pieces} | {self.numel})
        rows = sorted({p.offset + i * p.h * p.cols for p in self.pieces for i in range(p.rows // p.h)} | {self.numel})
        out = [0]
        for j in range(1, parts):
            want = j * self.numel / parts

            def nearest(cuts: list[int]) -> int:
                return min((c for c in cuts if c > out[-1]), key=lambda c: (abs(c - want), c), default=self.numel)

            cut = nearest(tensors)
            out.append(cut if abs(cut - want) <= self.numel / parts / 4 else nearest(rows))
        return out + [self.numel]

    def restrict(self, start: int, stop: int) -> "ChunkLayout":
        """The layout of the values [start, stop) of the buffer (cut at rows of blocks, `bounds`),
        offsets counted from `start`."""
        pieces = []
        for p in self.pieces:
            a, b = max(start, p.offset), min(stop, p.offset + p.numel)
            if a >= b:
                continue
            band = p.h * p.cols
            if (a - p.offset) % band or (b - p.offset) % band:
                raise ValueError(f"values [{start}, {stop}) cut a row of blocks of tensor {p.tensor}")
            pieces.append(Piece(a - start, (b - a) // p.cols, p.cols, p.h, p.w, p.tensor))
        return ChunkLayout(tuple(pieces), stop - start, self.tensors)
