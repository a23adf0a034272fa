"""Norms and finiteness of model-state buffers, one pass each where the buffer is large: the
exchange's non-finite guard and its check of a mean (`comm.exchange`), the drift telemetry's exact
square norms (`strategies`)."""

from __future__ import annotations

import math

import torch


def all_finite(x: torch.Tensor) -> bool:
    """No NaN/Inf in `x`. A sum is finite only if every element is (NaN and Inf propagate), and it
    is one pass without a temporary, ~30x cheaper than `isfinite(x).all()` on a model-sized
    buffer; only a non-finite sum (a NaN, an Inf, or an overflowing sum) pays for the exact test."""
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def sq_norm(x: torch.Tensor) -> float:
    """‖x‖₂²: for a flat float32/float64 buffer BLAS's dot(x, x) (one pass, and closer to the
    float64 value than `vector_norm`'s float32 accumulation)."""
    if x.dim() == 1 and x.is_contiguous() and x.dtype in (torch.float32, torch.float64) and x.device.type == "cpu":
        return float(torch.dot(x, x)) if x.numel() else 0.0
    return float(torch.linalg.vector_norm(x)) ** 2


# `exact_sq_norm`: each row of EXACT_ROW values sums its squares in one reduction (float32 result),
# the rows' sums are added in float64, and the EXACT_TOP largest rows, which carry most of the
# rounding when a few tensors dominate the norm (a transformer's norm weights, all ones), are summed
# again in float64
EXACT_ROW, EXACT_TOP = 1024, 16


def exact_sq_norm(x: torch.Tensor) -> float:
    """‖x‖₂² within ~1e-9 relative: about a float32 dot's time on CPU, where a float32 dot of a
    million values is off by ~1e-6 and `vector_norm(x, dtype=float64)` first converts the whole
    buffer (4-5x the time). Squares beyond float32's range still come out right (the rows' norms
    fit it); nan or inf when x holds one."""
    flat = x.detach().reshape(-1)
    rows = flat.numel() // EXACT_ROW
    if flat.dtype != torch.float32 or flat.device.type != "cpu" or rows <= EXACT_TOP:
        # converted whole: a half type's row norms would round to its 8 or 11 bits; short or on an accelerator, it is cheap
        return float(torch.linalg.vector_norm(flat, dtype=torch.float64)) ** 2
    head, tail = flat[: rows * EXACT_ROW].view(rows, EXACT_ROW), flat[rows * EXACT_ROW :].double()
    sums = torch.linalg.vector_norm(head, dim=1).double().square_()
    top = torch.topk(sums, EXACT_TOP, sorted=False).indices
    sums[top] = torch.linalg.vector_norm(head[top], dim=1, dtype=torch.float64).square_()
    return float(sums.sum()) + float(tail.square_().sum())


def l2_norm(x: torch.Tensor) -> float:
    """‖x‖₂ (`sq_norm`'s root; inf when the square overflows, nan when x holds one)."""
    return math.sqrt(sq_norm(x))


def finite_norm(x: torch.Tensor) -> float | None:
    """‖x‖₂ (inf if a square overflows) when every element of `x` is finite, else None. Like the sum,
    the norm is finite only if every element is, so one pass both checks a mean of model state and
    measures it; only a non-finite norm pays for the exact test."""
    norm = l2_norm(x)
    return norm if math.isfinite(norm) or bool(torch.isfinite(x).all()) else None
