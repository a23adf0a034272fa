"""How a late fragment result is merged into the local fragment: Streaming DiLoCo's α-merge
(arXiv:2501.18512), CoCoDC's delay compensation (arXiv:2504.17672) and eager updates' correction
(arXiv:2502.12996). Pure functions on flat float32 buffers, so they can be tested in isolation."""

from __future__ import annotations

import torch


def alpha_merge(local: torch.Tensor, anchor: torch.Tensor, alpha: float) -> torch.Tensor:
    """θ ← α·θ(t_l) + (1−α)·θ̃_p (α: weight on the local fragment). α = 0 returns θ̃_p's exact bits.
    Overwrites `local` (the caller's gathered copy) for 0 < α < 1."""
    if alpha == 0:
        return anchor.clone()
    if alpha == 1:
        return local.clone()
    return local.mul_(alpha).add_(anchor * (1.0 - alpha))  # `local` is the caller's gathered copy


def delay_compensate(
    theta_start: torch.Tensor,
    theta_now: torch.Tensor,
    anchor: torch.Tensor,
    tau: int,
    sync_every: int,
    lam: float,
    *,
    printed_sign: bool = False,
) -> tuple[torch.Tensor, float]:
    """CoCoDC's merge; returns (new local fragment, ‖λ·g⊙g⊙D‖ / ‖g‖).

        g      = (θ(t_l) − θ(t_p)) / τ          forward difference: the local change rate
        D      = (θ(t_p) − θ̃_p) / H
        g_corr = g + λ·g⊙g⊙D
        θ      ← θ̃_p + τ·g_corr

    `printed_sign=True` uses the paper's Eq. (4) as printed, g = (θ(t_p) − θ(t_l))/τ, which points
    backwards in time; it exists only so the tests can show that reading fails the constant-velocity
    check. τ = 0 (nothing trained during the exchange) gives θ̃_p.
    """
    if tau <= 0:
        return anchor.clone(), 0.0
    g = (theta_start - theta_now) / tau if printed_sign else (theta_now - theta_start) / tau
    if lam != 0:
        drift = (theta_start - anchor) / sync_every
        term = g * g * drift * lam
        g_norm = float(torch.linalg.vector_norm(g))
        rel = float(torch.linalg.vector_norm(term)) / g_norm if g_norm > 0 else 0.0
        g_corr = g + term
    else:
        rel, g_corr = 0.0, g
    return anchor + g_corr * tau, rel


def damped_compensate(
    theta_start: torch.Tensor,
    theta_now: torch.Tensor,
    anchor: torch.Tensor,
    tau: int,
    sync_every: int,
    lam: float,
    alpha: float,
) -> tuple[torch.Tensor, float]:
    """The Taylor merge with the α-merge's damping of the outer step, applied at the launch point:

        θ ← α·θ(t_p) + (1−α)·θ̃_p + τ·g_corr

    The α-merge damps both the outer step and the τ local steps taken during the exchange (it mixes
    θ(t_l)); this keeps the local steps whole and damps only the outer step. α = 0 is `delay_compensate`;
    λ = 0 with α = 1 keeps the local fragment unchanged.
    """
    new, rel = delay_compensate(theta_start, theta_now, anchor, tau, sync_every, lam)
    if alpha == 0:
        return new, rel
    return new + (theta_start - anchor) * alpha, rel


def eager_correct(theta_now: torch.Tensor, eager: torch.Tensor, anchor: torch.Tensor, elapsed: int) -> torch.Tensor:
    """Eager updates' correction when the true mean has arrived: the proxy outer step the worker took
    at the sync's start (θ̂ = OuterOpt(θ̃_p, Δ_m/M) without its state change, `Anchor.lookahead`) is
    swapped for the true one (θ̃_p, after OuterOpt(θ̃_p, Δ̄_p)), the steps trained since kept whole:

        θ ← θ(t_l) + (θ̃_p − θ̂)

    Overwrites `theta_now` (the caller's gathered copy). The difference is formed first, so a proxy
    equal to θ̃_p bit for bit (one worker: Δ̄ = Δ_m) leaves θ(t_l)'s exact bits. Nothing elapsed (τ = 0:
    the worker still holds θ̂) returns θ̃_p's exact bits."""
    if elapsed <= 0:
        return anchor.clone()
    return theta_now.add_(anchor - eager)


def lands_on_anchor(merge: str, alpha: float, elapsed: int) -> bool:
    """Does `merge` (alpha | taylor | damped | eager), `elapsed` steps after its sync started, return
    θ̃_p's exact bits? The α-merge iff α = 0 (whatever elapsed); the Taylor merge and eager updates
    iff nothing elapsed (`delay_compensate`'s τ·g_corr is then 0; `eager_correct` returns θ̃_p); the
    damped merge iff both (it adds α·(θ(t_p) − θ̃_p)). Decided from these alone, so every rank decides
    alike."""
    if merge == "alpha":
        return alpha == 0
    return elapsed == 0 and (merge in ("taylor", "eager") or alpha == 0)
