"""What the syncer does with a stale pseudo-gradient: the staleness rules of asynchronous DiLoCo.

A contribution's staleness τ is the number of versions the syncer published between the version the
learner started its round from and the one this merge publishes minus one: τ = v − base, where v is
the syncer's current version. Fresh contributions (τ = 0) are what lock-step DiLoCo merges.

`none`: no correction. Each merge is one outer Nesterov step on the token-weighted mean pseudo-
gradient, as lock-step DiLoCo's (`outer.Anchor`).

`polynomial` (Xie et al. 2019, FedAsync, arXiv:1903.03934; the baseline Liu et al. 2024 run on
pseudo-gradients): each contribution's pseudo-gradient is scaled by s(τ) = (1 + τ)^(−a) before the
token-weighted sum, a = 0.5 (both papers' setting). The weights are not renormalized: a merge of
stale contributions takes a shorter step, which is the rule's point.

`delayed_nesterov` (Liu et al. 2024, Asynchronous Local-SGD, arXiv:2401.09135, Algorithm 3): each
merge is one arrival g_t (the token-weighted mean of what it merged). With buffer B and period N::

    B ← B + g_t
    every N-th arrival:   m ← β·m + B/N ;  θ̃ ← θ̃ − ε·(β·m + g_t/N) ;  B ← 0
    any other arrival:                      θ̃ ← θ̃ − ε·g_t/N              (m unchanged)

with the paper's default momentum activation c = 0 (its Table 4 found c = 0.1 no better). Over one
period this is one Nesterov step on the mean of the N arrivals; with N = 1 it is Nesterov SGD itself
(tested). The paper's N equals its worker count, one arrival per worker; our arrivals are merges of a
quorum, so the default period is the learners over the quorum, rounded (about one contribution of
every learner per period), and `dn_period` sets it.

Buffers (BatchNorm statistics) are never optimized: every rule gives them θ̃ − Σ w·Δ, the plain
weighted average, as `outer.Anchor` does.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .catalog import STALENESS_RULES as RULES  # noqa: F401 - the names, declared without torch

POLY_A = 0.5


def polynomial_weight(staleness: int, a: float = POLY_A) -> float:
    """s(τ) = (1 + τ)^(−a)."""
    return float((1.0 + staleness) ** (-a))


def default_period(learners: int, quorum: int) -> int:
    """Delayed Nesterov's N when `dn_period` is 0: about one contribution of every learner per period."""
    return max(1, round(learners / max(1, quorum)))


class DelayedNesterov:
    """Algorithm 3 of Liu et al. 2024 (c = 0) on a flat θ̃: `arrive(g)` applies one arrival in place.
    `plain`: the (start, end) ranges of buffers, which take θ̃ − g (the plain average) instead."""

    def __init__(
        self, value: torch.Tensor, *, lr: float, momentum: float, period: int, plain: Sequence[tuple[int, int]]
    ):
        self.value, self.lr, self.beta, self.period = value, lr, momentum, period
        self.plain = list(plain)
        self.buffer = torch.zeros_like(value)
        self.momentum = torch.zeros_like(value)
        self.arrivals = 0

    def arrive(self, g: torch.Tensor) -> None:
        plain = [(a, b, self.value[a:b] - g[a:b]) for a, b in self.plain]
        self.buffer.add_(g)
        self.arrivals += 1
        if self.arrivals % self.period == 0:
            self.momentum.mul_(self.beta).add_(self.buffer, alpha=1.0 / self.period)
            step = g.div(self.period).add_(self.momentum, alpha=self.beta)
            self.buffer.zero_()
        else:
            step = g.div(self.period)
        self.value.add_(step, alpha=-self.lr)
        for a, b, avg in plain:
            self.value[a:b] = avg

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": self.buffer.clone(), "momentum": self.momentum.clone(), "arrivals": self.arrivals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.copy_(state["buffer"])
        self.momentum.copy_(state["momentum"])
        self.arrivals = int(state["arrivals"])
