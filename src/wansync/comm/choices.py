"""The exchange's choices as a strategy option names them, and the defaults they start from.

Plain values, no torch: the strategies' options declare their flags, help and rules from these
(`strategies/options.py`), and `wansync --help` lists them without loading torch. The modules that
implement each choice import its names from here: the codecs (`codecs.py`, whose registry holds
exactly `CODEC_NAMES`, tested), how a lossy mean travels (`mean_cost.py`), the robust mean
(`robust.py`), a sparse exchange (`sparse.py`) and its quantizer (`quantize.py`).
"""

from __future__ import annotations

from ..errors import check

CODEC_NAMES = ("fp32", "bf16", "int8", "fp4")  # `codecs.CODECS`, lightest compression first
LOSSY_COLLECTIVES = ("auto", "allgather", "reduce_scatter")  # how a lossy codec's mean travels
ROBUST_MEANS = ("off", "median")  # `robust_mean`: no clipping, or clipping by the median norm
DEFAULT_KAPPA = 2.0  # the robust mean's clip, in medians (`robust.py`: why 2)
AGGREGATES = ("chosen", "all")  # how the workers' sparse values are averaged (`sparse.py`)
DEFAULT_DENSITY = 32 / 4096  # the reference code's top-k of 32 in a 64 x 64 block
BITS = (2, 3, 4, 5, 6, 7, 8)  # the statistical quantizer's widths (`quantize.py`)
RAW = 32  # bits per value sent as it is: float32, no quantizer


def check_codec(value: str) -> None:
    """A codec's name, or the one-line ConfigError that lists them (`codecs.get_codec`'s too)."""
    check(value in CODEC_NAMES, f"unknown codec {value!r}; valid codecs: {', '.join(sorted(CODEC_NAMES))}")


def check_bits(name: str, value: int) -> None:
    """An option rule: a statistical width, or 32 for the values as they are."""
    check(
        value in BITS or value == RAW,
        f"{name} must be one of {', '.join(map(str, BITS))} (bits per value of the "
        f"statistical quantizer) or {RAW} (values unquantized), got {value}",
    )
