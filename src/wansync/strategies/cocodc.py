"""CoCoDC (Zhu et al. 2025, arXiv:2504.17672): Streaming DiLoCo's fragments and overlap with delay
compensation and adaptive transmission.

- Merge (`compensation`): `taylor` (the paper's) replaces the α-merge by
  `θ ← θ̃_p + τ·(g + λ·g⊙g⊙D)`, `g = (θ(t_l) − θ(t_p))/τ` (forward difference; the paper's printed
  Eq. (4) has the opposite sign), `D = (θ(t_p) − θ̃_p)/H`; `damped` (default) is the Taylor merge with
  the outer step damped by α at the launch point (`θ ← α·θ(t_p) + (1−α)·θ̃_p + τ·g_corr`: the τ local
  steps kept whole, unlike the α-merge); `alpha` keeps Streaming DiLoCo's α-merge. `eager=True`
  replaces whichever with Streaming DiLoCo's eager updates (`streaming.py`: the worker steps with its
  own Δ/M at the start, corrected at the merge). The default is not
  the paper's: handing every merge the full outer step, `taylor` ends 2.5–4 % behind DiLoCo on the
  tiny LM where `damped` does not (docs/strategies.md); the `cocodc-paper` preset pins `taylor`.
  Every merge's "sync" event records `lam_term_rel = ‖λ·g⊙g⊙D‖/‖g‖` (this rank's value).
- Count (`syncs_per_period`): 0 (default) derives N once, at the first step ≥ H after that step's
  fragment work (the timetable's rule, `fragment_timetable.py`), by the rule stated in
  `transmission.py` (the paper's `⌊γ·H·T_c/T_s⌋`, at least P, capped at `max_syncs_per_fragment`·P:
  without that cap a fast link makes every fragment take a full outer step every few steps, which
  diverges), from the measured inner-step time and the modelled or measured fragment sync time,
  agreed on all ranks; until then the schedule runs with `N = P` (and, when T_s is
  measured, those first-period syncs are waited for at once to time them). A positive value
  fixes N (matched-frequency ablations; deterministic runs). A "schedule" event records N, T_c, T_s.
- Choice (`schedule`): `adaptive_fair` (default: the paper's staleness rule, then argmax R_p, among
  the fragments not yet synced in the current round, so that no fragment syncs more than N/P times a
  period), `adaptive` (the paper's rule, which can lock in on one fragment; see `fragments.py`) or
  `round_robin`. `outer_scaling=interval` scales each merge's outer lr by I_p/H (default `none`). `compensation=alpha, schedule=round_robin` is Streaming DiLoCo with N syncs per
  period.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .catalog import CoCoDCOptions
from .compensation import damped_compensate, delay_compensate
from .fragment_timetable import FragmentTimetable
from .inflight import InFlight
from .streaming import Streaming
from .transmission import agree


class CoCoDCTimetable(FragmentTimetable):
    """Streaming DiLoCo's, with CoCoDC's choice and merge, and N decided once when it is automatic."""

    def __init__(self, options: CoCoDCOptions) -> None:
        super().__init__(
            options, choice=options.schedule, merge=options.compensation, automatic_n=options.syncs_per_period == 0
        )


class CoCoDC(Streaming):
    name = "cocodc"
    Options, Timetable = CoCoDCOptions, CoCoDCTimetable

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
        self.tc_sum, self.tc_count = 0.0, 0
        self.t_s: float | None = None
        self.t_s_source = ""
        self._modelled_t_s()

    def _modelled_t_s(self) -> None:
        """T_s from the emulated link's model, when there is one (else it is measured)."""
        if not self.timetable.n_decided:
            numel = round(sum(f.numel for f in self.fragments) / self.P)
            modelled = self.exchange.modelled_seconds(numel, self.codec, self.opts.codec_collective)
            if modelled is not None:
                self.t_s, self.t_s_source = modelled, "model"

    # ---- hooks ---------------------------------------------------------------------------------
    def merge_values(
        self, x: InFlight, local: torch.Tensor, anchor: torch.Tensor, elapsed: int
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        if self.timetable.merge in ("alpha", "eager"):  # Streaming DiLoCo's merges
            return super().merge_values(x, local, anchor, elapsed)
        assert x.theta_start is not None
        if self.opts.compensation == "damped":
            new, rel = damped_compensate(x.theta_start, local, anchor, elapsed, self.H, self.opts.lam, self.opts.alpha)
            return new, {"merge": "damped", "alpha": self.opts.alpha, "lam": self.opts.lam, "lam_term_rel": rel}
        new, rel = delay_compensate(x.theta_start, local, anchor, elapsed, self.H, self.opts.lam)
        return new, {"merge": "taylor", "lam": self.opts.lam, "lam_term_rel": rel}

    def outer_lr_for(self, x: InFlight) -> float | None:
        if self.opts.outer_scaling == "none":
            return None
        return self.opts.outer_lr * min(1.0, x.interval / self.H)

    # ---- T_c, T_s and N ------------------------------------------------------------------------
    def after_inner_step(self) -> None:
        if not self.timetable.n_decided and self.since_last_step_s is not None:  # T_c: the base class's timings
            self.tc_sum += self.since_last_step_s + self.last_inner_s
            self.tc_count += 1
        super().after_inner_step()

    def after_launch(self, x: InFlight) -> None:
        if not self.timetable.n_decided and self.t_s_source in ("", "measured"):  # time the first period's syncs
            x.handle.wait()
            took = time.perf_counter() - x.handle.started_at
            self.t_s = took if self.t_s is None else min(self.t_s, took)
            self.t_s_source = "measured"

    def decide_n(self, t: int) -> int:
        """N from the mean T_c and T_s of every rank (the timetable asks once, at the first step ≥ H)."""
        t_c = self.tc_sum / self.tc_count if self.tc_count else 0.0
        n, t_c, t_s = agree(
            t_c, self.t_s or 0.0, self.opts.gamma, self.H, self.P, self.opts.max_syncs_per_fragment, self.exchange
        )
        self.emit(
            "schedule",
            syncs_per_period=n,
            t_c=t_c,
            t_s=t_s,
            t_s_source=self.t_s_source,
            gamma=self.opts.gamma,
            max_syncs_per_fragment=self.opts.max_syncs_per_fragment,
        )
        return n

    # ---- resumable state -----------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {
            **super().extra_state(),
            "transmission": {
                "n_decided": self.timetable.n_decided,
                "tc_sum": self.tc_sum,
                "tc_count": self.tc_count,
                "t_s": self.t_s,
                "t_s_source": self.t_s_source,
            },
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        super().load_extra_state(state)
        tr = state["transmission"]
        self.timetable.n_decided = bool(tr["n_decided"])
        self.tc_sum, self.tc_count = float(tr["tc_sum"]), int(tr["tc_count"])
        self.t_s, self.t_s_source = tr["t_s"], str(tr["t_s_source"])
