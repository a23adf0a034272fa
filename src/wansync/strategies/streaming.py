"""Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512): fragments with staggered,
overlapped outer syncs and an α-merge.

Each fragment `p` (`fragments.py`: the partition and the schedule) has its own `outer.Anchor`: the
global value θ̃_p and its own outer SGD-Nesterov state (DiLoCo's class and `outer_step`)::

    sync start at t_p:  Δ_{m,p} = θ̃_p − θ_{m,p}(t_p); launch the async mean of Δ_{m,p}
    τ steps later t_l:  Δ̄_p = wait(); θ̃_p ← OuterOpt(θ̃_p, Δ̄_p)        # the new anchor first
                        θ_{m,p} ← α·θ_{m,p}(t_l) + (1−α)·θ̃_p             # α: weight on the local fragment

Eager updates (Kale, Douillard, Donchev 2025, arXiv:2502.12996; `eager=True`) replace the merge:
the worker steps at once with its own fresh Δ as a proxy for the mean it has not received, and swaps
the proxy for the true step when the mean arrives (docs/strategies.md: the reading and its choices)::

    sync start at t_p:  Δ_{m,p} as above, launched;  θ_{m,p} ← θ̂_{m,p} = OuterOpt(θ̃_p, Δ_{m,p}/M)
                        (a look-ahead: θ̃_p and the outer momentum are not changed)
    τ steps later t_l:  Δ̄_p = wait(); θ̃_p ← OuterOpt(θ̃_p, Δ̄_p)
                        θ_{m,p} ← θ_{m,p}(t_l) + (θ̃_p − θ̂_{m,p})             # α is not used

so the τ steps of the overlap run on a model that already holds this worker's share of the outer
step (the paper's Δ̂_m = Δ_m/M + Σ_{k≠m} Δ_k(delayed)/M, the others' delayed shares being in θ̃_p
already), θ̃_p and its momentum see only true means, and every inner step enters exactly one mean.

The mean goes through the strategy's `Exchange` in the chosen `codec` (the paper sends 4-bit
floats, accumulated in FP32): it books this rank's wire bytes as `pseudo_grads`, the blocked time
as exposed communication, and applies the non-finite policy. One "sync" event per merge carries
the fragment, the start step, the bytes, the codec and the syncs per period.

A model in bfloat16 (or float16) keeps each fragment's θ̃, outer momentum, Δ and merge in float32
(`Anchor(dtype=float32)`: the paper's FP32 accumulation); the model receives every merge rounded
to its own dtype, and the exchange sends float32 unless the codec says otherwise (`bf16` halves it).
On rank 0 the constructor warns (`FragmentImbalanceWarning`) when the largest fragment holds more
than twice the bytes of the smallest (`fragments.imbalance`).

What happens when is the timetable's (`fragment_timetable.py`; the planner follows the same one).
Several fragments may be in flight at once (τ may be anything below H); within one step, merges
that are due happen first, then the slot's sync starts (and, with τ = 0, merges at once), so
`fragments=1, overlap=0, alpha=0` is DiLoCo step for step (and so is `eager=True` with
`overlap=0`, or with one worker at any overlap). `syncs_per_period N` (0 = P) gives `N`
round-robin syncs per period instead of `P` (CoCoDC's matched-frequency ablation).

`finish()` first merges every exchange still in flight (early: with the steps actually elapsed),
then brings every rank to identical parameters with one last blocking outer sync of each fragment
(`Δ̄_p`, outer step, `θ_{m,p} ← θ̃_p`), exactly like DiLoCo's final boundary. A fragment that a merge
left exactly at its anchor at this step (α = 0) is skipped, so the DiLoCo identity holds through
`finish()` too.

Checkpoints may be taken at any step: `state_dict()` holds every anchor and outer-optimizer state,
the schedule (round-robin pointer, last starts, R_p) and the exchanges in flight (`inflight.py`).
`WANSYNC_DEBUG=1` checks that every rank chose the same fragment at every slot (`debug.py`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..comm.codecs import get_codec
from ..comm.exchange import MeanHandle
from ..errors import ConfigError
from .base import Strategy, model_buffers
from .catalog import StreamingOptions
from .compensation import alpha_merge, eager_correct
from .debug import check_same_choice, debug_enabled
from .fragment_timetable import FragmentTimetable
from .fragments import FragmentImbalanceWarning, imbalance, layout, partition
from .inflight import InFlight
from .options import anchor_device
from .outer import Anchor


class Streaming(Strategy):
    name = "streaming"
    Options, Timetable = StreamingOptions, FragmentTimetable

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
        o = self.opts
        self.H, self.P = o.sync_every, o.fragments
        self.codec = get_codec(o.codec)
        default = type(o)().fragments
        blocks = len(layout(self.module).blocks)
        if self.P == default and self.P > blocks:  # a newcomer's 2-layer model: say the 4 was a default
            raise ConfigError(
                f"{self.name} cuts the model into fragments={default} by default, and this model has {blocks} "
                f"blocks (stages): pass fragments={blocks} or fewer (--fragments {blocks} on the command line)"
            )
        self.fragments = partition(self.module, self.P, o.partition)  # before any collective
        if self.rank == 0 and (line := imbalance(self.fragments)) is not None:
            warnings.warn(line, FragmentImbalanceWarning, stacklevel=2)
        self.broadcast_initial_state()
        buffers = model_buffers(self.module)
        self.anchors = [
            Anchor(
                f.tensors,
                lr=o.outer_lr,
                momentum=o.outer_momentum,
                nesterov=True,
                buffers=buffers,
                device=anchor_device(o.outer_state_device),
                dtype=torch.float32,
            )  # bf16: FP32 θ̃, Δ
            for f in self.fragments
        ]
        for anchor in self.anchors if self.tensors_movable else ():  # each fragment's tensors move into one
            home = anchor.value.to(anchor.flat.device, anchor.flat.dtype, copy=True)  # flat buffer (as Periodic's
            anchor.flat.adopt(home)  # home) of the model's own dtype and device: Δ and a merge are one op each
        self.debug = debug_enabled()
        self.residuals: list[torch.Tensor | None] = [None] * self.P  # error feedback, per fragment
        self.computed_at = [0] * self.P  # steps computed when each fragment last exchanged (`pace`)

    # ---- the algorithm: what the timetable asks for, step by step ------------------------------
    def after_inner_step(self) -> None:
        self.timetable.in_flight.relaunch_restored(self.relaunch)
        self.timetable.step(self.t, self)  # merges due, the slot's sync start, τ = 0 merges

    def slot(self, t: int, choice: tuple[int, str] | None) -> None:
        """`WANSYNC_DEBUG=1`: every rank must have chosen alike (a mismatch would deadlock)."""
        if self.debug:
            check_same_choice(t, -1 if choice is None else choice[0], self.comm, self.group)

    def start(self, x: InFlight) -> None:
        """Sync start at t_p: Δ_{m,p} = θ̃_p − θ_{m,p}(t_p); launch the async mean of Δ_{m,p}."""
        anchor, merge = self.anchors[x.fragment], self.timetable.merge
        x.theta_start = anchor.local() if merge in ("taylor", "damped") else None  # θ(t_p): CoCoDC's merges
        x.delta, dropped = self.with_feedback(x.fragment, anchor.pseudo_gradient(x.theta_start))
        x.weight = self.steps_weight(x.fragment)
        x.handle = self.exchange.mean(
            x.delta,
            "pseudo_grads",
            self.codec,
            async_op=True,
            collective=self.opts.codec_collective,
            residual=dropped,
            weight=x.weight,
            origin=0.0,
        )
        if merge == "eager":
            self.eager_step(x)
        self.after_launch(x)

    def eager_step(self, x: InFlight) -> None:
        """Eager updates at the start, while the mean travels: θ_{m,p} ← θ̂_{m,p} = OuterOpt(θ̃_p, Δ_{m,p}/M),
        a look-ahead at this merge's outer learning rate; θ̂ as the model holds it (rounded to a bf16
        model's dtype) is kept, as the sync's θ_start, for the correction."""
        anchor = self.anchors[x.fragment]
        workers = self.exchange.participants or self.exchange.world_size
        ahead = anchor.lookahead(x.delta / workers, lr=self.outer_lr_for(x))
        if anchor.flat.dtype != ahead.dtype:
            ahead = ahead.to(anchor.flat.dtype).to(ahead.dtype)
        anchor.flat.scatter(ahead)
        x.theta_start = ahead

    def with_feedback(self, p: int, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Error feedback (`error_feedback`): Δ_{m,p} plus what the codec dropped of fragment p's last
        contribution, and the tensor the exchange writes what it drops now into (the exchange then
        sends exactly `delta`, which an exchange relaunched after a resume sends again)."""
        if not self.opts.error_feedback:
            return delta, None
        residual = self.residuals[p]
        if residual is None:
            residual = self.residuals[p] = torch.zeros_like(delta)
        delta.add_(residual)
        return delta, residual.zero_()

    def halfway(self, x: InFlight, t: int) -> None:
        """A two-phase mean's second phase, started now (`MeanHandle.advance`)."""
        x.handle.advance()

    def merge(self, x: InFlight, t: int, exact: bool) -> None:
        """τ steps later: Δ̄_p = wait(); θ̃_p ← OuterOpt(θ̃_p, Δ̄_p); then merge into θ_{m,p}."""
        mean = x.handle.wait()
        p, anchor, schedule = x.fragment, self.anchors[x.fragment], self.timetable.schedule
        before = anchor.value.clone() if schedule.uses_rates else None
        takes_anchor = exact and self.timetable.merge == "alpha"  # θ_{m,p} ← θ̃_p: no local values needed,
        anchor.outer_step(mean, lr=self.outer_lr_for(x), load=takes_anchor)  # loaded in the step's pass
        if before is not None:
            change = self.exchange.worker_norm(float(torch.linalg.vector_norm(before.sub_(anchor.value))))
            schedule.record_merge(p, change, x.interval)  # R_p of the whole fragment, alike on every rank
        if takes_anchor:
            info: dict[str, Any] = {"merge": "alpha", "alpha": 0.0}
        else:
            new, info = self.merge_values(x, anchor.local(), anchor.value, t - x.start)
            anchor.flat.scatter(new)
        if x.handle.participants is not None:  # fault-tolerant: this exchange's, not the last quorum's
            info["participants"] = x.handle.participants
        self.emit(
            "sync",
            kind="fragment",
            fragment=p,
            started=x.start,
            overlap=t - x.start,
            reason=x.reason,
            bytes=x.handle.wire_bytes,
            payload_bytes=x.handle.payload_bytes,
            codec=self.codec.name,
            syncs_per_period=schedule.n,
            waited_s=x.handle.waited_s,
            **info,
        )

    def relaunch(self, x: InFlight) -> None:
        """Launch a restored exchange again (its bytes are already on the restored ledger)."""
        x.handle = self.exchange.mean(
            x.delta,
            "pseudo_grads",
            self.codec,
            async_op=True,
            replay=True,
            collective=self.opts.codec_collective,
            weight=x.weight,
            origin=0.0,
        )

    def steps_weight(self, p: int) -> float | None:
        """What fragment p's pseudo-gradient weighs: the steps this worker computed since the fragment's
        last exchange (`strategies.pace`; None under slow_policy wait: unweighted)."""
        weight = self.pace.weight(self.computed_at[p])
        self.computed_at[p] = self.pace.computed
        return weight

    # ---- hooks for CoCoDC ----------------------------------------------------------------------
    def merge_values(
        self, x: InFlight, local: torch.Tensor, anchor: torch.Tensor, elapsed: int
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The new local fragment after the outer step, and telemetry fields."""
        if self.timetable.merge == "eager":
            assert x.theta_start is not None
            return eager_correct(local, x.theta_start, anchor, elapsed), {"merge": "eager"}
        return alpha_merge(local, anchor, self.opts.alpha), {"merge": "alpha", "alpha": self.opts.alpha}

    def outer_lr_for(self, x: InFlight) -> float | None:
        """The outer learning rate for this merge (None: the optimizer's own)."""
        return None

    def after_launch(self, x: InFlight) -> None:
        """Called right after a sync is launched (CoCoDC measures T_s here)."""

    # ---- the end -------------------------------------------------------------------------------
    def finish(self) -> None:
        """Merge what is in flight, then one blocking outer sync per fragment not already at θ̃_p."""
        self.timetable.in_flight.relaunch_restored(self.relaunch)
        self.timetable.finish(self.t, self)

    def final_sync(self, p: int, t: int) -> None:
        """Δ̄_p = mean(θ̃_p − θ_{m,p}); θ̃_p ← OuterOpt(θ̃_p, Δ̄_p); θ_{m,p} ← θ̃_p (DiLoCo's boundary)."""
        anchor = self.anchors[p]
        delta, dropped = self.with_feedback(p, anchor.pseudo_gradient())
        sent = self.exchange.mean(
            delta,
            "pseudo_grads",
            self.codec,
            collective=self.opts.codec_collective,
            residual=dropped,
            weight=self.steps_weight(p),
            origin=0.0,
        )
        anchor.outer_step(sent.wait(), load=True)
        self.emit(
            "sync",
            kind="final",
            fragment=p,
            started=t,
            overlap=0,
            bytes=sent.wire_bytes,
            payload_bytes=sent.payload_bytes,
            codec=self.codec.name,
            syncs_per_period=self.timetable.schedule.n,
        )

    # ---- resumable state -----------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {
            "anchors": [a.state_dict() for a in self.anchors],
            **self.timetable.state_dict(),
            "residuals": [None if r is None else r.clone() for r in self.residuals],
            **({"computed_at": list(self.computed_at)} if self.pace.active else {}),
        }

    def heal_state(self) -> dict[str, Any]:
        """Fault-tolerant exchanges are complete when issued, so the exchanges in flight travel with
        their means: the healed worker merges them with its peers instead of relaunching them."""
        state = super().heal_state()
        for entry, x in zip(state["in_flight"], self.timetable.in_flight):
            entry["mean"] = x.handle.wait().clone()
        return state

    def load_heal_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state)
        for entry, x in zip(state["in_flight"], self.timetable.in_flight):
            x.handle = MeanHandle.complete(self.comm, "pseudo_grads", entry["mean"])

    def load_extra_state(self, state: dict[str, Any]) -> None:
        for a, s in zip(self.anchors, state["anchors"], strict=True):
            a.load_state_dict(s)
        self.timetable.load_state_dict(state)
        self.residuals = [None if r is None else r.clone() for r in state.get("residuals", [None] * self.P)]
        self.computed_at = [int(c) for c in state.get("computed_at", [0] * self.P)]
