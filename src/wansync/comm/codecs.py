"""Codecs for exchanged tensors: fp32, bf16, int8 and fp4 (E2M1).

Strategies exchange flat float32 buffers (gradients, parameters, pseudo-gradients). Over a slow link the
bytes are what costs, so a codec turns a buffer into a compact byte payload and back. Streaming DiLoCo
sends its outer gradients as 4-bit floats with FP32 accumulation; the other codecs are the usual rungs
between that and full precision, so the bytes-vs-quality trade-off can be measured.

Contract, shared by every codec:

* ``encode(x)`` takes a float32 tensor (flattened if it is not 1-D) and returns an :class:`Encoded`
  whose ``data`` is a 1-D ``uint8`` tensor of exactly ``wire_bytes(x.numel())`` bytes: everything the
  receiver needs besides the element count, which both sides already know.
* ``decode(enc)`` returns a 1-D float32 tensor of ``enc.numel`` elements on ``enc.data``'s device.
* Encoding is deterministic, so every rank decodes the same bytes to the same bits.
* Non-finite values are never silently lost: a NaN or Inf makes (at least) its chunk decode to
  NaN/Inf, so the strategies' non-finite checks still fire.
* Multi-byte fields (fp32 scales, bf16 values) use the host's native byte order; all ranks of a job are
  assumed to share it.

Payload layouts (``n = ceil(numel / chunk)`` chunks for the scaled codecs)::

    fp32  numel × 4 B float32                                   wire = 4·numel
    bf16  numel × 2 B bfloat16 (round to nearest even)          wire = 2·numel
    int8  n × 4 B float32 scales, then numel × 1 B int8 codes   wire = 4·n + numel
    fp4   n × 4 B float32 scales, then ceil(numel/2) B codes    wire = 4·n + ceil(numel/2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from wansync.comm.choices import check_codec
from wansync.errors import ConfigError

__all__ = [
    "CODECS",
    "Bf16Codec",
    "Codec",
    "Encoded",
    "Fp32Codec",
    "Fp4Codec",
    "Int8Codec",
    "decode_into",
    "encode_into",
    "get_codec",
]

DEFAULT_CHUNK = 1024
#: values a blocked encode or decode (`encode_into`, `decode_into`) converts at once: its temporaries
#: stay about 1 MB each however large the buffer (a whole-buffer encode or decode allocates 2-3 copies of it)
BLOCK_VALUES = 1 << 18


@dataclass(frozen=True)
class Encoded:
    """One encoded payload: the codec's name, the element count and the bytes that go on the wire."""

    codec: str
    numel: int
    data: torch.Tensor  # 1-D uint8, exactly codec.wire_bytes(numel) long

    @property
    def nbytes(self) -> int:
        return self.data.numel()


@runtime_checkable
class Codec(Protocol):
    """What a strategy needs from a compression scheme; see the module docstring for the contract."""

    name: str

    def encode(self, x: torch.Tensor) -> Encoded: ...

    def decode(self, enc: Encoded) -> torch.Tensor: ...

    def wire_bytes(self, numel: int) -> int: ...


def _flat_f32(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        raise TypeError(f"codecs encode float32 tensors, got {x.dtype}")
    return x.detach().reshape(-1)


def _check(enc: Encoded, codec: Codec) -> None:
    if enc.codec != codec.name:
        raise ValueError(f"payload was encoded with {enc.codec!r}, cannot decode with {codec.name!r}")
    want = codec.wire_bytes(enc.numel)
    if enc.data.dtype != torch.uint8 or enc.data.numel() != want:
        raise ValueError(
            f"{codec.name} payload for {enc.numel} elements must be {want} uint8 bytes, "
            f"got {enc.data.numel()} {enc.data.dtype}"
        )


class Fp32Codec:
    """Identity: the float32 bytes themselves. Encode and decode are zero-copy views (they alias)."""

    name = "fp32"
    chunk, code_bits = 1, 32

    def wire_bytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: torch.Tensor) -> Encoded:
        x = _flat_f32(x).contiguous()
        return Encoded(self.name, x.numel(), x.view(torch.uint8))

    def decode(self, enc: Encoded) -> torch.Tensor:
        _check(enc, self)
        return enc.data.view(torch.float32)


class Bf16Codec:
    """bfloat16: float32's exponent range with 8 significant bits, so relative error ≤ 2^-8 (normals)."""

    name = "bf16"
    chunk, code_bits = 1, 16

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: torch.Tensor) -> Encoded:
        x = _flat_f32(x)
        return Encoded(self.name, x.numel(), x.to(torch.bfloat16).contiguous().view(torch.uint8))

    def decode(self, enc: Encoded) -> torch.Tensor:
        _check(enc, self)
        return enc.data.view(torch.bfloat16).float()


class _ChunkScaled:
    """Shared machinery of the codecs with one float32 absmax scale per chunk of ``chunk`` elements.

    The scale is ``absmax / qmax`` rounded *up* to the next float32 (one ulp), so ``|x| / scale`` never
    exceeds ``qmax`` and no element is clipped, even when the scale is a denormal. An all-zero chunk gets
    scale 0 and decodes to zeros.
    """

    name: str
    qmax: float
    code_bits: int

    def __init__(self, chunk: int = DEFAULT_CHUNK) -> None:
        if chunk < 1:
            raise ConfigError(f"{self.name} chunk size must be >= 1, got {chunk}")
        self.chunk = chunk

    def n_chunks(self, numel: int) -> int:
        return math.ceil(numel / self.chunk)

    def wire_bytes(self, numel: int) -> int:
        return 4 * self.n_chunks(numel) + math.ceil(numel * self.code_bits / 8)

    def _chunked(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as (n_chunks, chunk), zero-padded at the end (a view when no padding is needed)."""
        pad = -x.numel() % self.chunk
        if pad:
            x = torch.cat([x, x.new_zeros(pad)])
        return x.view(-1, self.chunk)

    def _scales(self, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales to store, scales safe to divide by) for per-chunk ``absmax``."""
        up = torch.nextafter(absmax / self.qmax, absmax.new_tensor(math.inf))
        scale = torch.where(absmax > 0, up, absmax)  # 0 stays 0, NaN stays NaN
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        return scale, safe

    def _split(self, enc: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
        _check(enc, self)  # type: ignore[arg-type]
        n = self.n_chunks(enc.numel)
        return enc.data[: 4 * n].view(torch.float32), enc.data[4 * n :]

    def _rescale(self, values: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        """Multiply per-chunk ``values`` (≥ numel elements, chunk-aligned) by their chunk's scale."""
        vc = self._chunked(values[:numel])
        return (vc * scales[:, None]).view(-1)[:numel]


def _absmax(xc: torch.Tensor) -> torch.Tensor:
    """Per-row max of |x| of a (chunks, chunk) tensor, NaN if the row has one, without an |x| temporary."""
    if xc.numel() == 0:
        return xc.new_zeros(xc.shape[0])
    lo, hi = torch.aminmax(xc, dim=1)
    return torch.maximum(-lo, hi)


class Int8Codec(_ChunkScaled):
    """Symmetric int8: ``q = round(x / scale)`` in [-127, 127], ``scale = absmax / 127`` per chunk.

    Round to nearest (ties to even), so the error is at most ``scale / 2`` per element.
    """

    name = "int8"
    qmax = 127.0
    code_bits = 8

    def encode(self, x: torch.Tensor) -> Encoded:
        x = _flat_f32(x)
        numel = x.numel()
        xc = self._chunked(x)
        scale, safe = self._scales(_absmax(xc))
        q = torch.round(xc / safe[:, None]).clamp_(-127, 127).to(torch.int8).view(-1)[:numel]
        data = torch.cat([scale.view(torch.uint8), q.view(torch.uint8)])
        return Encoded(self.name, numel, data)

    def decode(self, enc: Encoded) -> torch.Tensor:
        scales, codes = self._split(enc)
        return self._rescale(codes.view(torch.int8).float(), scales, enc.numel)


# E2M1 magnitudes, indexed by the 3 low bits of a code (exponent bias 1; exponent 0 is subnormal).
_FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_magnitude_code(a: torch.Tensor) -> torch.Tensor:
    """The 3-bit E2M1 code (0..7) nearest to each ``a`` in [0, 6], ties toward zero, as uint8.

    Equivalent to ``torch.bucketize(a, midpoints)`` but 2-3x faster on CPU, by working on float bits:
    above 1, E2M1 is float32 cut to one mantissa bit, so rounding the float32 bits at mantissa bit 22
    and re-biasing the exponent (127 -> 1) gives the code directly; below 1 (subnormals and 0) the step
    is a fixed 0.5. Each part saturates at code 2 (the value 1.0) on the other side, so their sum minus
    2 covers the whole range without a branch. NaN gives an arbitrary code (its chunk's scale is
    non-finite anyway), masked to 3 bits so it cannot spill into the neighbouring nibble.
    """
    # a >= 1: adding 2^21 - 1 then dropping 22 bits rounds half down at the kept mantissa bit, leaving
    # (exponent + 127) << 1 | mantissa; the code is that minus 252. `high` is code - 2, 0 below 1.
    high = a.clamp(min=1.0).view(torch.int32).add_(0x1FFFFF).bitwise_right_shift_(22).sub_(254)
    # a < 1: codes 0, 1, 2 for 0, 0.5, 1; ceil(2a - 0.5) rounds to nearest, ties toward zero; 2 above 1
    low = a.clamp(max=1.0).mul_(2).sub_(0.5).ceil_().to(torch.int32)
    return high.add_(low).bitwise_and_(7).to(torch.uint8)


class Fp4Codec(_ChunkScaled):
    """4-bit floats (FP4 of Streaming DiLoCo): the E2M1 element format of OCP MX, but with one float32
    absmax scale per chunk instead of MX's power-of-two scale, so the largest value maps exactly to 6.

    Each element is a 4-bit code ``s e1 e0 m``: sign bit ``s`` (bit 3), two exponent bits, one mantissa
    bit, exponent bias 1, exponent 0 subnormal, no Inf/NaN. The 3 magnitude bits 0..7 mean
    ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``; the decoded value is ``±magnitude · scale`` with
    ``scale = absmax / 6`` per chunk. Encoding rounds ``|x| / scale`` to the nearest magnitude (ties
    toward zero), so the error is at most half the gap between the two neighbouring magnitudes times the
    scale: 0.25·scale below 2, 0.5·scale in [2, 4], 1·scale in [4, 6]. Codes are packed two per byte,
    element ``2i`` in the low nibble and ``2i + 1`` in the high nibble; an odd tail is padded with code 0.
    ``-0.0`` keeps its sign.
    """

    name = "fp4"
    qmax = 6.0
    code_bits = 4

    def __init__(self, chunk: int = DEFAULT_CHUNK) -> None:
        super().__init__(chunk)
        mags = torch.tensor(_FP4_MAGNITUDES)
        values = torch.cat([mags, -mags])  # code -> value, sign in bit 3
        byte = torch.arange(256)
        # byte -> (value of low nibble, value of high nibble): one lookup per byte when decoding.
        self._pair_lut = torch.stack([values[byte & 15], values[byte >> 4]], dim=1)

    def encode(self, x: torch.Tensor) -> Encoded:
        x = _flat_f32(x)
        numel = x.numel()
        ax = self._chunked(x).abs()
        scale, safe = self._scales(_absmax(ax))
        mag = _e2m1_magnitude_code(ax.div_(safe[:, None])).view(-1)
        codes = mag[:numel] | (torch.signbit(x).to(torch.uint8) << 3)
        if numel % 2:
            codes = torch.cat([codes, codes.new_zeros(1)])
        packed = codes[0::2] | (codes[1::2] << 4)
        data = torch.cat([scale.view(torch.uint8), packed])
        return Encoded(self.name, numel, data)

    def decode(self, enc: Encoded) -> torch.Tensor:
        scales, packed = self._split(enc)
        lut = self._pair_lut.to(packed.device)
        values = lut[packed.long()].view(-1)
        return self._rescale(values, scales, enc.numel)


# ---- blocked encode and decode: the same bytes and bits, without whole-buffer temporaries ----------


def _scale_bytes(codec: Codec, numel: int) -> int:
    """The payload's leading per-chunk scales (none for the element-wise codecs)."""
    return 4 * codec.n_chunks(numel) if isinstance(codec, _ChunkScaled) else 0


def _blocks(codec: Codec, numel: int) -> list[tuple[int, int, slice, slice]]:
    """Value ranges [a, b) of about `BLOCK_VALUES` covering `numel`, each starting on a chunk and a
    byte boundary, with the byte ranges of their scales and codes in the whole payload. Every codec
    encodes a chunk from its own values only, so a block's payload is those two ranges' bytes."""
    chunk, bits = codec.chunk, codec.code_bits  # type: ignore[attr-defined]
    step = chunk * max(1, BLOCK_VALUES // chunk)
    step += step % 2 * chunk * (bits < 8)  # fp4: two codes a byte, blocks on even values
    head, scaled = _scale_bytes(codec, numel), isinstance(codec, _ChunkScaled)
    out = []
    for a in range(0, numel, step):
        b = min(a + step, numel)
        scales = slice(4 * (a // chunk), 4 * -(-b // chunk)) if scaled else slice(0, 0)
        out.append((a, b, scales, slice(head + a * bits // 8, head + -(-b * bits // 8))))
    return out


def encode_into(codec: Codec, x: torch.Tensor, out: torch.Tensor, numel: int | None = None) -> torch.Tensor:
    """`codec.encode(x).data` written into the first `wire_bytes(numel)` bytes of the uint8 `out`
    (returned), block by block (`BLOCK_VALUES`): the same bytes, with a block's temporaries only.
    `numel` (≥ x's): encode `x` as if zero-padded to that many values, without the padded copy."""
    x = _flat_f32(x)
    numel, have = x.numel() if numel is None else numel, x.numel()
    for a, b, scales, codes in _blocks(codec, numel):
        block = x[a:b] if b <= have else torch.cat([x[a : max(a, have)], x.new_zeros(b - max(a, have))])
        data = codec.encode(block).data
        n = scales.stop - scales.start
        out[scales].copy_(data[:n])
        out[codes].copy_(data[n:])
    return out[: codec.wire_bytes(numel)]


def decode_into(codec: Codec, data: torch.Tensor, numel: int, out: torch.Tensor, add: bool = False) -> torch.Tensor:
    """The first `out.numel()` values of `codec.decode(Encoded(codec.name, numel, data))` copied into
    the float32 `out` (or added to it, `add`), block by block: the same bits as decoding the whole
    payload (every codec decodes element-wise within a chunk), without its whole-buffer temporaries."""
    want = codec.wire_bytes(numel)
    if data.dtype != torch.uint8 or data.numel() != want or out.numel() > numel:
        raise ValueError(
            f"{codec.name} payload for {numel} elements must be {want} uint8 bytes for at most "
            f"{numel} values, got {data.numel()} {data.dtype} for {out.numel()}"
        )
    flat, k = out.view(-1), out.numel()
    for a, b, scales, codes in _blocks(codec, numel):
        if a >= k:
            break
        piece = torch.cat([data[scales], data[codes]]) if scales.stop > scales.start else data[codes].clone()
        values = codec.decode(Encoded(codec.name, b - a, piece))[: min(b, k) - a]
        target = flat[a : min(b, k)]
        target.add_(values) if add else target.copy_(values)
    return out


CODECS: dict[str, Codec] = {c.name: c for c in (Fp32Codec(), Bf16Codec(), Int8Codec(), Fp4Codec())}


def get_codec(name: str | Codec) -> Codec:
    """The registered codec called ``name`` (a codec object passes through unchanged)."""
    if not isinstance(name, str):
        return name
    check_codec(name)
    return CODECS[name]
