"""Small non-negative integers packed to the bits they need: a sparse payload's chunk-local indices
(12 bits for a 64 × 64 block) and its quantized values (2 bits at SparseLoCo's default).

`pack(values, bits)` writes `values` (each < 2**bits) into ⌈len·bits/8⌉ bytes, value i at bit
offset i·bits, least significant bit first; `unpack` reads them back. Values are taken in groups
whose bits fill whole bytes (g = 8/gcd(bits, 8) values, grown while they fit in 64 bits), each
group's bits summed into one int64 and its low bytes kept: a handful of vector ops, no per-bit
temporary. An odd width above 8 (9, 11, 13, ... bits: a group of 8 values would pass 64 bits) goes
bit by bit (a byte per bit per value, transient), to the same bytes. The groups' bytes are
little-endian int64 bytes, the layout of every platform torch runs on (checked: `ORDER`).
"""

from __future__ import annotations

import math
import sys

import torch

ORDER = sys.byteorder
MAX_BITS = 32


def packed_bytes(count: int, bits: int) -> int:
    """Bytes of `count` values of `bits` bits each (0 bits: nothing to send)."""
    return -(-count * bits // 8)


def _group(bits: int) -> int:
    """Values per packed group: whole bytes, as many as fit in 64 bits (0: none fit, bit by bit)."""
    g = 8 // math.gcd(bits, 8)
    if g * bits > 64:
        return 0
    while 2 * g * bits <= 64:
        g *= 2
    return g


_BIT = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)  # a byte's bits, low first (read-only)


def _pack_bits(v: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """`pack` bit by bit: value i's bit j at stream bit i·bits + j."""
    shifts = torch.arange(bits, device=v.device, dtype=torch.int64)
    stream = ((v.view(-1, 1) >> shifts) & 1).to(torch.uint8).view(-1)
    stream = torch.cat([stream, stream.new_zeros(-stream.numel() % 8)]).view(-1, 8)
    out.copy_((stream * _BIT.to(v.device)).sum(dim=1, dtype=torch.uint8))
    return out


def _unpack_bits(data: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    stream = ((data.view(-1, 1) & _BIT.to(data.device)) != 0).view(-1)[: count * bits].to(torch.int64)
    weights = torch.ones(bits, dtype=torch.int64, device=data.device) << torch.arange(bits, device=data.device)
    return (stream.view(count, bits) * weights).sum(dim=1)


def alignment(bits: int) -> int:
    """Values from the start of a packed stream to a byte boundary its groups begin at: unpacking
    `count` values from a multiple of it is unpacking the bytes from (start·bits)/8 on."""
    if bits == 0:
        return 1
    return _group(bits) or 8 // math.gcd(bits, 8)


def pack(values: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """`values` (integers in [0, 2**bits)) as ⌈n·bits/8⌉ uint8 bytes, into `out` when given."""
    if not 0 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in [0, {MAX_BITS}], got {bits}")
    if ORDER != "little":
        raise RuntimeError("wansync's sparse payloads need a little-endian host")
    n = values.numel()
    size = packed_bytes(n, bits)
    out = torch.empty(size, dtype=torch.uint8, device=values.device) if out is None else out[:size]
    if size == 0:
        return out
    v = values.reshape(-1).to(torch.int64)
    g = _group(bits)
    if not g:
        return _pack_bits(v, bits, out)
    nbytes = g * bits // 8
    pad = -n % g
    if pad:
        v = torch.cat([v, v.new_zeros(pad)])
    v = v.view(-1, g)
    shifts = torch.arange(g, device=v.device, dtype=torch.int64) * bits
    words = (v << shifts).sum(dim=1)  # disjoint bits: the sum is an OR
    out.copy_(words.view(torch.uint8).view(-1, 8)[:, :nbytes].reshape(-1)[:size])
    return out


def unpack(data: torch.Tensor, count: int, bits: int, start: int = 0) -> torch.Tensor:
    """The `count` values of `bits` bits packed in the uint8 `data` (`pack`), from value `start` on (a
    multiple of `alignment(bits)`), as int64."""
    if start:
        if start % alignment(bits):
            raise ValueError(f"unpacking from value {start} of {bits}-bit values: not at a byte boundary of the stream")
        data = data[start * bits // 8 :]
    if bits == 0:
        return torch.zeros(count, dtype=torch.int64, device=data.device)
    g = _group(bits)
    if not g:
        return _unpack_bits(data, count, bits)
    nbytes = g * bits // 8
    groups = -(-count // g)
    raw = torch.zeros(groups, 8, dtype=torch.uint8, device=data.device)
    staged = torch.zeros(groups * nbytes, dtype=torch.uint8, device=data.device)
    have = min(data.numel(), staged.numel())
    staged[:have] = data[:have]
    raw[:, :nbytes] = staged.view(groups, nbytes)
    words = raw.view(torch.int64).view(-1, 1)
    shifts = torch.arange(g, device=data.device, dtype=torch.int64) * bits
    mask = (1 << bits) - 1
    return ((words >> shifts) & mask).view(-1)[:count]
