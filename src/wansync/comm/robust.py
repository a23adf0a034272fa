"""A robust mean of pseudo-gradients (`robust_mean median`): before the mean, each worker's
contribution is clipped to κ times the median of the contributions' L2 norms, so that one worker
whose pseudo-gradient went wrong with finite values (a corrupted buffer, a diverged replica) moves
the mean by at most κ·median/M instead of wrecking the model. Templar clips by the median norm in
the same way. The rule, for the M contributions Δ_m of one mean::

    n_m = ‖Δ_m‖₂                        # each worker's whole contribution (every shard of it)
    μ   = median_m n_m                  # over the finite norms; of an even count, the midpoint
    c_m = κ·μ / n_m  if n_m > κ·μ  else 1
    Δ̄   = mean_m c_m·Δ_m                # the exchange's mean, unchanged, of the clipped contributions

The norms travel first: one all-gather of M float64 numbers before the mean (`Exchange.mean`'s
`origin`), then every rank computes the same factors from the same numbers, so the ranks stay
bitwise identical, and a worker whose factor is 1 sends exactly what it would have sent without the
rule (with no outlier, `median` is `off` bit for bit). Clipping before sending, rather than on
receipt of an all-gather, serves every codec and collective alike and keeps a faulty contribution
out of the worker's own error feedback (a lossy codec's residual, SparseLoCo's error buffer, DeMo's
momentum), which would otherwise send it again round after round.

κ = 2 by default (`DEFAULT_KAPPA`): the workers of a healthy run draw from the same data and start
each round from the same anchor, so their norms sit close together (the tiny LM's DiLoCo runs: the
largest within 1.07 x the median at every exchange, docs/robust_mean.md), and 2 never clips one of
them; a faulty worker is cut to twice the median, so its pull on the mean is at most that of two
healthy ones. M < 3 workers at κ ≥ M cannot clip anything (`check_workers`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import check
from ..rules import positive
from .choices import DEFAULT_KAPPA
from .norms import exact_sq_norm

ROBUST_NORMS = "robust_norms"  # ledger purpose: the all-gather of the workers' norms


@dataclass(frozen=True)
class Clip:
    """One worker's contribution clipped in one mean: by `factor`, its norm above κ·median."""

    worker: int
    factor: float
    norm: float
    median: float
    kappa: float

    @classmethod
    def from_event(cls, record: dict[str, Any]) -> "Clip":
        """The clip a `robust_clip` event (metrics.jsonl) records."""
        return cls(*(record[f.name] for f in dataclasses.fields(cls)))

    def line(self, step: int) -> str:
        """The one line rank 0 prints (`telemetry.run`)."""
        return (
            f"wansync: robust mean at step {step}: worker {self.worker}'s pseudo-gradient clipped by "
            f"{self.factor:.2g} (norm {self.norm:.2g} > {self.kappa:g} x median {self.median:.2g})"
        )


def clip_factors(norms: Sequence[float], kappa: float) -> tuple[list[float], float]:
    """Each contribution's factor c_m and the median μ (module docstring). A non-finite norm (a
    contribution holding NaN/Inf, which the non-finite guard deals with) takes no part in the median
    and keeps factor 1; without any finite norm, μ is NaN and nothing is clipped."""
    finite = [n for n in norms if math.isfinite(n)]
    if not finite:
        return [1.0] * len(norms), math.nan
    median = statistics.median(finite)
    bound = kappa * median
    return [bound / n if math.isfinite(n) and n > bound else 1.0 for n in norms], median


def contribution_norm(values: torch.Tensor, origin: torch.Tensor | float) -> float:
    """‖values − origin‖₂ in float64 accumulation (`exact_sq_norm`: right beyond float32's squares)."""
    delta = values if isinstance(origin, float) and origin == 0.0 else values.float() - _like(origin, values)
    return math.sqrt(exact_sq_norm(delta))


def scale_contribution(
    buf: torch.Tensor, origin: torch.Tensor | float, factor: float, extra: int, inplace: bool
) -> torch.Tensor:
    """`buf` whose first numel − `extra` values v become origin + factor·(v − origin): in `buf` itself
    when `inplace` (the mean lands there anyway), else in a copy, leaving the caller's buffer alone."""
    out = buf if inplace else buf.detach().clone()
    flat = out.view(-1)
    values = flat[: flat.numel() - extra]
    with torch.no_grad():
        if isinstance(origin, float) and origin == 0.0:
            values.mul_(factor)
        else:
            o = _like(origin, values)
            values.sub_(o).mul_(factor).add_(o)
    return out


def _like(origin: torch.Tensor | float, values: torch.Tensor) -> torch.Tensor | float:
    if isinstance(origin, float):
        return origin
    return origin.reshape(-1).to(values.device, values.dtype)


def check_workers(workers: int, kappa: float) -> None:
    """An option that does nothing is refused: with M < 3 workers and κ ≥ M no norm can exceed κ
    times the median (of two, their midpoint, which the larger is at most twice), so the faulty one
    cannot be told from the healthy one."""
    check(
        workers >= 3 or kappa < workers,
        f"robust_mean median cannot clip anything with {workers} worker{'s' if workers != 1 else ''} at "
        f"robust_kappa {kappa:g} (no norm exceeds {kappa:g} x the median of {workers}): it needs 3 workers or more",
    )


class RobustMean:
    """The rule with its κ, applied to this worker's contribution to one mean.

    Args:
        kappa: κ > 0; a contribution is clipped to κ times the median norm.
    """

    def __init__(self, kappa: float = DEFAULT_KAPPA):
        positive("robust_kappa", kappa)
        self.kappa = float(kappa)

    def clip(
        self,
        buf: torch.Tensor,
        origin: torch.Tensor | float,
        extra: int,
        inplace: bool,
        *,
        worker: int,
        whole_norm: Callable[[float], float],
        gather: Callable[[float], list[tuple[int, float]]],
    ) -> tuple[torch.Tensor, list[Clip]]:
        """This worker's contribution `buf − origin` (the first numel − `extra` values; the side band
        is left alone) clipped by its factor, and every clip of this mean. `worker`: this worker's
        number; `whole_norm`: the worker's whole norm from this rank's part's (its shards summed);
        `gather`: every contributing worker's (number, norm), the same list on every rank (a
        collective: the group's workers in order, or a fault-tolerant quorum's members)."""
        values = buf.reshape(-1)[: buf.numel() - extra]
        pairs = gather(whole_norm(contribution_norm(values, origin)))
        norms = [n for _, n in pairs]
        factors, median = clip_factors(norms, self.kappa)
        clips = [Clip(w, f, n, median, self.kappa) for (w, n), f in zip(pairs, factors) if f < 1.0]
        mine = next((f for (w, _), f in zip(pairs, factors) if w == worker), 1.0)
        if mine < 1.0:
            buf = scale_contribution(buf, origin, mine, extra, inplace)
        return buf, clips
