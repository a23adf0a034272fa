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
- Agreement: every rank contributes its (T_c, T_s) to one float64 all-reduce (mean), computes N, and
  rank 0's N is broadcast, so all ranks use identical N even if their float arithmetic differed.
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from ..comm.ledger import CommLedger


def max_syncs(sync_every: int, fragments: int, per_fragment: int) -> int:
    """The cap on N: min(c·P, H), or H when c = 0 (no per-fragment cap)."""
    return min(sync_every, per_fragment * fragments) if per_fragment > 0 else sync_every


def syncs_per_period(gamma: float, sync_every: int, fragments: int, t_c: float, t_s: float, *,
                     per_fragment: int) -> int:
    """N = max(P, min(⌊γ·H·T_c/T_s⌋, c·P, H)) with c = `per_fragment` (0: no c·P cap)."""
    cap = max_syncs(sync_every, fragments, per_fragment)
    if not (t_s > 0) or not math.isfinite(t_c):
        return cap
    n = math.floor(gamma * sync_every * t_c / t_s)
    return int(max(fragments, min(cap, n)))


def agree(t_c: float, t_s: float, gamma: float, sync_every: int, fragments: int, per_fragment: int,
          ledger: CommLedger, group: Any = None, exchange: Any = None) -> tuple[int, float, float]:
    """(N, mean T_c, mean T_s), identical on every rank of `group` (see module docstring). A
    fault-tolerant `exchange` averages over its quorum instead: the same mean bits on every
    participant give the same N, so no broadcast is needed."""
    vals = torch.tensor([t_c, t_s], dtype=torch.float64)
    if exchange is not None and exchange.ft is not None:
        tc, ts = (float(v) for v in exchange.mean(vals, "schedule").wait())
        return syncs_per_period(gamma, sync_every, fragments, tc, ts, per_fragment=per_fragment), tc, ts
    ledger.count("schedule", vals.numel() * vals.element_size())
    started = time.perf_counter()
    dist.all_reduce(vals, op=dist.ReduceOp.SUM, group=group)
    vals /= dist.get_world_size(group)
    tc, ts = float(vals[0]), float(vals[1])
    n = torch.tensor([syncs_per_period(gamma, sync_every, fragments, tc, ts, per_fragment=per_fragment)], dtype=torch.int64)
    ledger.count("schedule", n.numel() * n.element_size())
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(n, src=src, group=group)
    ledger.waited("schedule", time.perf_counter() - started)   # blocked on both: exposed communication
    return int(n[0]), tc, ts
