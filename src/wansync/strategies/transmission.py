"""CoCoDC's adaptive transmission count (Zhu et al. 2025, arXiv:2504.17672), the one statement of it:

    N = max(P, min(⌊γ·H·T_c/T_s⌋, c·P, H))

The paper's rule is `N = max(P, ⌊γ·H·T_c/T_s⌋)`, at most H (one sync start per step): spend the
spare bandwidth. `c` (`max_syncs_per_fragment`, default 2) caps how often one fragment can take an
outer step per period, i.e. a minimum interval of H/c steps between two syncs of the same fragment
(exactly, with the default `adaptive_fair` schedule, which gives every fragment N/P syncs a period).
Without it (c = 0) a fast link drives N to H and every fragment takes a full outer Nesterov step
(tuned for one step per H inner steps) every few steps, which diverges; with c = 2 the paper's setting
(H = 100, P = 4: N = 8) keeps its N.

- `T_c`, the inner-step time, is measured by the strategy: per step, the time from the end of the
  previous `step()` call to the start of this one (forward, backward, data) plus the inner optimizer
  step; sync work done inside `step()` is excluded. The first step is skipped (warm-up).
- `T_s`, the time to sync one fragment, is modelled from the WAN emulator's link when the group runs
  under it (`Exchange.modelled_seconds` on a mean-sized fragment: an all-reduce of its float32
  bytes for fp32, an all-gather of every worker's encoded payload for the lossy codecs; sharded
  over the ranks of a worker when workers have several), else measured
  on the fragment syncs of the first period (N = P of them): each is waited for at once instead of τ
  steps later (the arithmetic is unchanged, only their overlap is lost) and T_s is the fastest one
  (the first includes the connection warm-up).
- Agreement: every worker's (T_c, T_s) goes into one float64 mean through the exchange (purpose
  `schedule`, booked as a wait: exposed communication), over the group or the quorum alike. The mean
  has the same bits on every rank (one collective's result), so N, computed from it by the same
  float64 arithmetic, is the same everywhere: nothing more is sent.
"""

from __future__ import annotations

import math

import torch

from ..comm.exchange import Exchange


def max_syncs(sync_every: int, fragments: int, per_fragment: int) -> int:
    """The cap on N: min(c·P, H), or H when c = 0 (no per-fragment cap)."""
    return min(sync_every, per_fragment * fragments) if per_fragment > 0 else sync_every


def syncs_per_period(
    gamma: float, sync_every: int, fragments: int, t_c: float, t_s: float, *, per_fragment: int
) -> int:
    """N = max(P, min(⌊γ·H·T_c/T_s⌋, c·P, H)) with c = `per_fragment` (0: no c·P cap)."""
    cap = max_syncs(sync_every, fragments, per_fragment)
    if not (t_s > 0) or not math.isfinite(t_c):
        return cap
    n = math.floor(gamma * sync_every * t_c / t_s)
    return int(max(fragments, min(cap, n)))


def agree(
    t_c: float, t_s: float, gamma: float, sync_every: int, fragments: int, per_fragment: int, exchange: Exchange
) -> tuple[int, float, float]:
    """(N, mean T_c, mean T_s), identical on every rank (see the module docstring)."""
    mean = exchange.mean(torch.tensor([t_c, t_s], dtype=torch.float64), "schedule").wait()
    tc, ts = float(mean[0]), float(mean[1])
    return syncs_per_period(gamma, sync_every, fragments, tc, ts, per_fragment=per_fragment), tc, ts
