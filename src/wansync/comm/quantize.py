"""The statistical quantizer of SparseLoCo's reference code (CCLoco's `TopKCompressor`): the values a
sparse payload sends, in `bits` bits each, with a small lookup table per segment.

Per segment (one tensor's chosen values), with B = 2**bits bins::

    shift  = mean(v)                           # the values centred on their mean
    c      = v − shift
    σ      = ‖c‖ / √(n − 1)                    # 0 for a segment of one value
    scale  = range · σ / B                     # bins over range·σ (reference: range 6); 1 if 0 or not finite
    code   = clamp(round(c / scale + B // 2), 0, B − 1)
    table  = the mean of the c that fell in each bin (0 for an empty bin)
    decode = table[code] + shift

The bins need not be centred (B // 2 of them lie below the mean, B/2 − 1 above) and the outer two
take everything beyond them: each decoded value is the mean of its bin, which the table carries,
so the rounding has no bias within a bin. What travels per segment is `shift` and the table, B + 1
float32 (`table_bytes`); scale and offset are the sender's only. Our choice beyond the reference:
the statistics are accumulated in float64 (the reference takes them in the values' dtype), then
rounded once to the float32 the receiver decodes with; sender and receivers decode the same bytes.

Non-finite values are not lost: a NaN or Inf makes its segment's shift or table non-finite, so the
whole segment decodes non-finite and the exchange's check of the mean fires.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .choices import BITS, RAW

RANGE_SIGMAS = 6.0  # the reference's quantization_range


def table_bytes(segments: int, bits: int) -> int:
    """Bytes of the segments' shifts and lookup tables (none for raw values)."""
    return 0 if bits == RAW else 4 * segments * (2**bits + 1)


@dataclass(frozen=True)
class Quantized:
    """Codes (one per value, uint8) and, per segment, the shift and the lookup table (float32)."""

    codes: torch.Tensor  # (n,) uint8 in [0, 2**bits)
    shift: torch.Tensor  # (segments,) float32
    table: torch.Tensor  # (segments, 2**bits) float32


def quantize(
    values: torch.Tensor, segment: torch.Tensor, segments: int, bits: int, range_sigmas: float = RANGE_SIGMAS
) -> Quantized:
    """Each value's code, and each segment's shift and table (`segment`: each value's segment id, int64)."""
    if bits not in BITS:
        raise ValueError(f"the statistical quantizer takes {BITS[0]}-{BITS[-1]} bits, got {bits}")
    bins = 2**bits
    v = values.reshape(-1).to(torch.float64)
    seg = segment.reshape(-1)
    count = torch.zeros(segments, dtype=torch.float64, device=v.device).index_add_(0, seg, torch.ones_like(v))
    shift = torch.zeros_like(count).index_add_(0, seg, v) / count.clamp(min=1)
    c = v - shift[seg]
    sq = torch.zeros_like(count).index_add_(0, seg, c * c)
    sigma = torch.sqrt(sq / (count - 1).clamp(min=1)) * (count > 1)
    scale = range_sigmas * sigma / bins
    scale = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
    codes = torch.round(c / scale[seg] + bins // 2).clamp_(0, bins - 1)
    codes = torch.nan_to_num(codes, nan=0.0).to(torch.uint8)  # a NaN's code: any (its shift is NaN)
    slot = seg * bins + codes.long()
    sums = torch.zeros(segments * bins, dtype=torch.float64, device=v.device).index_add_(0, slot, c)
    hits = torch.zeros_like(sums).index_add_(0, slot, torch.ones_like(c))
    table = torch.where(hits > 0, sums / hits.clamp(min=1), torch.zeros_like(sums))
    nonfinite = ~torch.isfinite(shift)
    table = table.view(segments, bins)
    if bool(nonfinite.any()):  # the whole segment decodes non-finite
        table[nonfinite] = shift[nonfinite].view(-1, 1)
    return Quantized(codes, shift.float(), table.float())


def dequantize(codes: torch.Tensor, segment: torch.Tensor, shift: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The float32 values the codes stand for: table[segment, code] + shift[segment]."""
    bins = table.shape[1]
    seg = segment.reshape(-1)
    return table.reshape(-1)[seg * bins + codes.reshape(-1).long()] + shift[seg]
