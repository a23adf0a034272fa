"""Streaming DiLoCo (spec §6): fragments with staggered, overlapped outer syncs and an α-merge.

Each fragment `p` (see `fragments.py` for the partition and the schedule) has its own `outer.Anchor`:
the global value θ̃_p and its own outer SGD-Nesterov state (the same class and `outer_step` DiLoCo
uses). At a sync start `t_p` a rank computes `Δ_{m,p} = θ̃_p − θ_{m,p}(t_p)` and launches one
asynchronous mean of that flat buffer (`comm.compressed.compressed_mean`, in the chosen `codec`; the
wire bytes of this rank's payload are booked on the ledger as `pseudo_grads`). Training goes on; τ
inner steps later (`t_l = t_p + τ`) the rank waits (the blocked time is booked as exposed
communication), takes the outer step `θ̃_p ← OuterOpt(θ̃_p, Δ̄_p)` and merges
`θ_{m,p} ← α·θ_{m,p}(t_l) + (1−α)·θ̃_p`. One "sync" event per merge carries the fragment, the start
step, the bytes, the codec and the syncs per period.

Several fragments may be in flight at once (τ may be anything below H); within one step, merges
that are due happen first, then the slot's sync starts (and, with τ = 0, merges at once), so
`fragments=1, overlap=0, alpha=0` is DiLoCo step for step. `syncs_per_period N` (0 = P) gives `N`
round-robin syncs per period instead of `P` (spec §7's matched-frequency ablation).

`finish()` first merges every exchange still in flight (early: with the steps actually elapsed),
then brings every rank to identical parameters with one last blocking outer sync of each fragment
(`Δ̄_p`, outer step, `θ_{m,p} ← θ̃_p`), exactly like DiLoCo's final boundary. A fragment that already
equals its anchor at this step (merged now with α = 0) is skipped, so the DiLoCo identity holds through
`finish()` too.

Checkpoints may be taken at any step: `state_dict()` holds every anchor and outer-optimizer state,
the schedule (round-robin pointer, last starts, R_p), and for each exchange in flight this rank's
pseudo-gradient (and θ(t_p) when the merge needs it). A resumed run relaunches those exchanges at its
first `step()` (or in `finish()`), in their original order, and merges them at their original steps,
so it continues bit for bit. `can_checkpoint()` is therefore always true.

`WANSYNC_DEBUG=1` all-gathers every slot's choice and raises `PeerError` when ranks disagree.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..comm.codecs import CODECS, get_codec
from ..comm.compressed import compressed_mean
from ..errors import NonFiniteError, PeerError, check
from .base import Strategy
from .compensation import alpha_merge
from .fragments import PARTITIONS, Schedule, partition
from .options import Options, at_least, in_range, one_of, option, outer_lr, outer_momentum, sync_every
from .outer import Anchor


def known_codec(name: str, value: str) -> None:
    """An option rule: the codec registry's own one-line error for an unknown codec."""
    get_codec(value)


@dataclass
class StreamingOptions(Options):
    """Fragments, overlap and the merge; the outer optimizer is DiLoCo's, per fragment."""
    sync_every: int = sync_every(100)
    fragments: int = option(4, "number of fragments P", at_least(1))
    overlap: int = option(5, "overlap depth tau: inner steps while a fragment syncs")
    alpha: float = option(0.5, "weight of the local fragment in the merge", in_range(0, 1, high_included=True))
    outer_lr: float = outer_lr()
    outer_momentum: float = outer_momentum()
    codec: str = option("fp32", f"codec for exchanged pseudo-gradients: {'|'.join(CODECS)}", known_codec)
    partition: str = option("strided", f"fragment partition: {'|'.join(PARTITIONS)}", one_of(PARTITIONS))
    syncs_per_period: int = option(0, "fragment syncs per period N (0: one per fragment, N = P)")

    def cross_check(self) -> None:
        super().cross_check()
        h, p = self.sync_every, self.fragments
        check(p <= h, f"fragments ({p}) must be <= sync_every ({h})")
        check(0 <= self.overlap < h, f"overlap (tau) must be in [0, sync_every) = [0, {h}), got {self.overlap}")
        check(self.syncs_per_period == 0 or p <= self.syncs_per_period <= h,
              f"syncs_per_period must be 0 (automatic) or between fragments ({p}) and sync_every "
              f"({h}), got {self.syncs_per_period}")


@dataclass
class InFlight:
    """One fragment exchange between its start and its merge."""
    fragment: int
    start: int
    merge_at: int
    interval: int                        # I_p: steps since the fragment's previous start
    reason: str
    delta: torch.Tensor                  # this rank's pseudo-gradient (kept to redo it after a resume)
    theta_start: torch.Tensor | None     # θ_{m,p}(t_p), when the merge needs it
    valid: bool = True                   # False: this worker's Δ was non-finite and is sent as zeros
    handle: Any = None                   # MeanHandle; None until (re)launched
    count: Any = None                    # (work, tensor) of the valid-worker count (--on-nonfinite skip)
    wire_bytes: int = 0
    waited_s: float = 0.0
    launched_at: float = 0.0             # perf_counter() at launch


class _Done:
    """A finished exchange's result (after the valid-worker rescaling)."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def wait(self) -> torch.Tensor:
        return self.value


def debug_enabled() -> bool:
    return os.environ.get("WANSYNC_DEBUG", "") not in ("", "0", "false", "no")


class Streaming(Strategy):
    name = "streaming"
    Options = StreamingOptions

    def __init__(self, model, optimizer, options=None, *, group=None):
        super().__init__(model, optimizer, options, group=group)
        o = self.opts
        self.H, self.P, self.tau = o.sync_every, o.fragments, o.overlap
        self.codec = get_codec(o.codec)
        self.fragments = partition(self.module, self.P, o.partition)   # before any collective
        self.broadcast_initial_state()
        self.anchors = [Anchor(f.tensors, lr=o.outer_lr, momentum=o.outer_momentum, nesterov=True)
                        for f in self.fragments]
        self.schedule = Schedule(self.H, self.P, o.syncs_per_period or self.P, self.schedule_mode())
        self.in_flight: list[InFlight] = []
        self.exact_at = [0] * self.P     # step at which fragment p was last set to exactly θ̃_p
        self.debug = debug_enabled()
        self._relaunch = False

    # ---- hooks for CoCoDC ----------------------------------------------------------------------
    def schedule_mode(self) -> str:
        return "round_robin"

    def keeps_theta_start(self) -> bool:
        return False

    def merge_values(self, x: InFlight, local: torch.Tensor, anchor: torch.Tensor,
                     elapsed: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """The new local fragment after the outer step, and telemetry fields."""
        return alpha_merge(local, anchor, self.opts.alpha), {"merge": "alpha", "alpha": self.opts.alpha}

    def before_launch(self, x: InFlight) -> None:
        """Called right after a sync is launched (CoCoDC measures T_s here)."""

    def after_slot(self, t: int) -> None:
        """Called at the end of every step's schedule work (CoCoDC decides N here)."""

    # ---- the step ------------------------------------------------------------------------------
    def can_checkpoint(self) -> bool:
        """Always: exchanges in flight are recorded in state_dict() and redone on resume."""
        return True

    def after_inner_step(self) -> None:
        t = self.t
        self._relaunch_restored()
        self._merge_due(t)
        if self.schedule.is_slot(t):
            choice = self.schedule.choose(t, {x.fragment for x in self.in_flight})
            if self.debug:
                self._check_same_choice(t, -1 if choice is None else choice[0])
            if choice is not None:
                self._start(choice[0], choice[1], t)
            self._merge_due(t)            # τ = 0: merge at once
        self.after_slot(t)

    def _start(self, p: int, reason: str, t: int) -> None:
        anchor = self.anchors[p]
        local = anchor.local()
        delta, valid = self._guard(anchor.value - local, p)
        x = InFlight(fragment=p, start=t, merge_at=t + self.tau, interval=self.schedule.record_start(p, t),
                     reason=reason, delta=delta, valid=valid,
                     theta_start=local if self.keeps_theta_start() else None)
        self._launch(x)
        self.in_flight.append(x)
        self.before_launch(x)

    def _guard(self, delta: torch.Tensor, p: int) -> tuple[torch.Tensor, bool]:
        """The ledger's non-finite policy (`--on-nonfinite`) applied to this worker's Δ before it
        leaves: abort raises; skip sends zeros and is left out of the average."""
        policy = self.comm.nonfinite
        if policy is None or bool(torch.isfinite(delta).all()):
            return delta, True
        if policy == "abort":
            raise NonFiniteError(f"non-finite values in this worker's pseudo_grads of fragment {p} before the "
                                 f"exchange (--on-nonfinite abort)")
        self.comm.dropped += 1
        return torch.zeros_like(delta), False

    def _launch(self, x: InFlight, relaunch: bool = False) -> None:
        """Start fragment x's exchange. A relaunch after a resume is not counted again: the
        restored ledger already holds the bytes of the exchange the interrupted run started."""
        x.launched_at = time.perf_counter()
        x.handle = compressed_mean(x.delta, self.codec, group=self.group, async_op=True)
        x.wire_bytes = x.handle.wire_bytes
        if not relaunch:
            self.comm.count("pseudo_grads", x.wire_bytes)
        if self.comm.nonfinite == "skip":                 # how many workers contributed
            n = torch.tensor([1.0 if x.valid else 0.0])
            if not relaunch:
                self.comm.count("nonfinite_guard", 4)
            x.count = (dist.all_reduce(n, op=dist.ReduceOp.SUM, group=self.group, async_op=True), n)

    def wait(self, x: InFlight) -> torch.Tensor:
        t0 = time.perf_counter()
        mean = x.handle.wait()
        if x.count is not None:
            work, n = x.count
            work.wait()
            valid = float(n[0])
            if valid == 0:
                raise NonFiniteError(f"every worker's pseudo_grads of fragment {x.fragment} were non-finite")
            if valid < self.world_size:
                mean = mean * (self.world_size / valid)
            x.count = None
            x.handle = _Done(mean)
        dt = time.perf_counter() - t0
        x.waited_s += dt
        self.comm.waited("pseudo_grads", dt)
        return mean

    def _merge_due(self, t: int) -> None:
        for x in [x for x in self.in_flight if x.merge_at <= t]:
            self._merge(x, t)

    def _merge(self, x: InFlight, t: int) -> None:
        mean = self.wait(x)
        self.in_flight.remove(x)
        p, anchor = x.fragment, self.anchors[x.fragment]
        if not bool(torch.isfinite(mean).all()):
            raise NonFiniteError(f"non-finite pseudo-gradient mean for fragment {p} (sync started at step "
                                 f"{x.start}, merged at step {t})")
        before = anchor.value.clone()
        anchor.outer_step(mean)                           # new anchor first, then the merge
        self.schedule.record_merge(p, float(torch.linalg.vector_norm(anchor.value - before)), x.interval)
        new, info = self.merge_values(x, anchor.local(), anchor.value, t - x.start)
        anchor.flat.scatter(new)
        if torch.equal(new, anchor.value):
            self.exact_at[p] = t
        self.emit("sync", kind="fragment", fragment=p, started=x.start, overlap=t - x.start, reason=x.reason,
                  bytes=x.wire_bytes, payload_bytes=4 * anchor.value.numel(), codec=self.codec.name,
                  syncs_per_period=self.schedule.n, waited_s=x.waited_s, **info)

    def _check_same_choice(self, t: int, choice: int) -> None:
        mine = torch.tensor([choice], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        self.comm.count("debug", 8)
        dist.all_gather(every, mine, group=self.group)
        choices = [int(c[0]) for c in every]
        if len(set(choices)) != 1:
            raise PeerError(f"ranks chose different fragments at step {t}: {choices} (rank order)")

    # ---- the end -------------------------------------------------------------------------------
    def finish(self) -> None:
        """Merge what is in flight, then one blocking outer sync per fragment not already at θ̃_p."""
        self._relaunch_restored()
        t = self.t
        for x in list(self.in_flight):
            self._merge(x, t)
        for p, anchor in enumerate(self.anchors):
            if self.exact_at[p] == t:
                continue
            delta, valid = self._guard(anchor.pseudo_gradient(), p)
            x = InFlight(fragment=p, start=t, merge_at=t, interval=0, reason="final", delta=delta, valid=valid,
                         theta_start=None)
            self._launch(x)
            mean = self.wait(x)
            if not bool(torch.isfinite(mean).all()):
                raise NonFiniteError(f"non-finite pseudo-gradient mean for fragment {p} in the final sync")
            anchor.outer_step(mean)
            anchor.load_into_model()
            self.exact_at[p] = t
            self.emit("sync", kind="final", fragment=p, started=t, overlap=0, bytes=x.wire_bytes,
                      payload_bytes=4 * anchor.value.numel(), codec=self.codec.name,
                      syncs_per_period=self.schedule.n)

    # ---- resumable state -----------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {
            "anchors": [a.state_dict() for a in self.anchors],
            "schedule": self.schedule.state_dict(),
            "exact_at": list(self.exact_at),
            "in_flight": [{"fragment": x.fragment, "start": x.start, "merge_at": x.merge_at,
                           "interval": x.interval, "reason": x.reason, "delta": x.delta.clone(), "valid": x.valid,
                           "theta_start": None if x.theta_start is None else x.theta_start.clone()}
                          for x in self.in_flight],
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        for a, s in zip(self.anchors, state["anchors"], strict=True):
            a.load_state_dict(s)
        self.schedule.load_state_dict(state["schedule"])
        self.exact_at = [int(v) for v in state["exact_at"]]
        self.in_flight = [InFlight(fragment=int(s["fragment"]), start=int(s["start"]), merge_at=int(s["merge_at"]),
                                   interval=int(s["interval"]), reason=str(s["reason"]), delta=s["delta"].clone(),
                                   valid=bool(s["valid"]),
                                   theta_start=None if s["theta_start"] is None else s["theta_start"].clone())
                          for s in state["in_flight"]]
        self._relaunch = bool(self.in_flight)

    def _relaunch_restored(self) -> None:
        """After a resume: redo the exchanges that were in flight, in their original order."""
        if self._relaunch:
            self._relaunch = False
            for x in self.in_flight:
                if x.handle is None:
                    self._launch(x, relaunch=True)
