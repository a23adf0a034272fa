"""The syncer's merge: contributions in, versions out (asynchronous DiLoCo, `async_diloco.py`).

The syncer holds θ̃ and its version v. A learner's contribution carries the version it started its
round from (its base), the tokens and steps it covers, and what it sent: its parameters θ_m (a
lossless exchange, as lock-step DiLoCo sends them) or θ_m − θ̃_base decoded from a codec. Its
pseudo-gradient is Δ_m = θ̃_base − θ_m, against the version it started from (Liu et al. 2024, Alg. 1);
the syncer keeps the versions a contribution may still be based on (`max_staleness` + 1 of them).

When to merge (Decoupled DiLoCo, arXiv:2604.21428): once a quorum q of contributions is in, the
syncer waits a grace window for more, then merges what arrived; it never waits for a learner that is
not connected (the quorum is min(q, learners alive)), and it merges at once when every learner alive
has arrived. The merge weights each contribution by its tokens: w_m = tokens_m / Σ tokens. The paper
weights by tokens × tokens per step; with every learner on the same batch size that is the same
weighting, and ours needs no per-step figure. The grace window is a fixed number of seconds, not the
paper's adaptive one: its inputs (a learner's step time, the merge's time) are what `plan` predicts,
so the user sets it from the plan.

A contribution whose base is more than `max_staleness` versions old is dropped (the learner is told,
and says so in one line). The others are merged under the staleness rule (`staleness.py`).

Lock-step DiLoCo is the special case: every learner at the same speed, a quorum of all (or an
unbounded grace window) and no correction merge every learner's fresh θ_m once per round; that merge
takes the same path as DiLoCo's boundary (`Anchor.step_to_average` on the weighted mean of θ_m), so
the two runs are bit for bit the same (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .outer import Anchor
from .staleness import DelayedNesterov, default_period, polynomial_weight


@dataclass
class Contribution:
    """One learner's round as the syncer received it."""

    learner: int
    base: int
    tokens: int
    steps: int
    values: torch.Tensor  # flat, θ̃'s dtype: θ_m, or θ_m − θ̃_base when `relative`
    relative: bool = False
    arrived: float = 0.0  # the syncer's monotonic clock


@dataclass
class Merged:
    """What one merge did: the version it published and who was in it."""

    version: int
    learners: list[int]
    staleness: list[int]
    tokens: int
    steps: int


@dataclass
class Settings:
    learners: int
    quorum: int
    grace_s: float  # math.inf: wait for every learner alive
    max_staleness: int
    rule: str
    outer_lr: float
    outer_momentum: float
    dn_period: int = 0  # 0: `staleness.default_period`


@dataclass
class Tally:
    """Goodput's numerator and denominator from the syncer's side, and the merges' staleness."""

    merged_tokens: int = 0
    dropped_tokens: int = 0
    merged_steps: int = 0
    staleness: list[int] = field(default_factory=list)


class Syncer:
    """θ̃, its version and the contributions waiting for a merge. `tensors`: the model's tensors
    (copied: the syncer's θ̃ is its own); `buffers`: which of them are buffers."""

    def __init__(self, tensors: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], settings: Settings):
        self.settings = settings
        copies = [t.detach().clone() for t in tensors]
        ids = {id(b) for b in buffers}
        copied_buffers = [c for t, c in zip(tensors, copies) if id(t) in ids]
        self.anchor = Anchor(  # on the CPU, whatever the model's device: what it sends and receives lies there
            copies,
            lr=settings.outer_lr,
            momentum=settings.outer_momentum,
            nesterov=True,
            buffers=copied_buffers,
            device="cpu",
        )
        self.version = 0
        self.history: dict[int, torch.Tensor] = {0: self.anchor.value.clone()}
        self.pending: list[Contribution] = []
        self.tally = Tally()
        self.quorum_since: float | None = None
        self.delayed = None
        if settings.rule == "delayed_nesterov":
            period = settings.dn_period or default_period(settings.learners, settings.quorum)
            self.delayed = DelayedNesterov(
                self.anchor.value,
                lr=settings.outer_lr,
                momentum=settings.outer_momentum,
                period=period,
                plain=self.anchor.plain,
            )

    @property
    def value(self) -> torch.Tensor:
        """θ̃ of the current version."""
        return self.anchor.value

    def too_stale(self, base: int) -> bool:
        return self.version - base > self.settings.max_staleness or base not in self.history

    def add(self, c: Contribution) -> bool:
        """Take a contribution for the next merge; False when it is dropped (too stale)."""
        if self.too_stale(c.base):
            self.tally.dropped_tokens += c.tokens
            return False
        self.pending.append(c)  # a learner that took a newer version at once may send again before a merge
        return True

    def due(self, now: float, alive: int) -> bool:
        """Is a merge due at `now` with `alive` learners connected? Every one alive has arrived, or
        the quorum is in and the grace window since it came in has passed."""
        n = len({c.learner for c in self.pending})  # the learners in, for the quorum
        if n == 0:
            return False
        if n >= alive:
            return True
        if n < min(self.settings.quorum, alive):
            self.quorum_since = None
            return False
        if self.quorum_since is None:
            self.quorum_since = now
        return now - self.quorum_since >= self.settings.grace_s

    def wait_s(self, now: float) -> float | None:
        """Seconds until the grace window of a quorum that is in closes (None: no quorum in)."""
        if self.quorum_since is None or math.isinf(self.settings.grace_s):
            return None
        return max(0.0, self.quorum_since + self.settings.grace_s - now)

    def merge(self) -> Merged:
        """Merge every pending contribution into version v + 1 and publish it."""
        taken = sorted(self.pending, key=lambda c: (c.learner, c.base))
        self.pending, self.quorum_since = [], None
        total = sum(c.tokens for c in taken)
        weights = [c.tokens / total if total else 1.0 / len(taken) for c in taken]
        staleness = [self.version - c.base for c in taken]
        fresh = all(s == 0 and not c.relative for s, c in zip(staleness, taken))
        if fresh and self.delayed is None:  # lock-step DiLoCo's boundary, bit for bit
            mean = torch.zeros_like(self.value)
            for w, c in zip(weights, taken):
                mean.add_(c.values.to(mean.dtype), alpha=w)
            self.anchor.step_to_average(mean)
        else:
            g = torch.zeros_like(self.value)
            for w, s, c in zip(weights, staleness, taken):
                scale = w * (polynomial_weight(s) if self.settings.rule == "polynomial" else 1.0)
                delta = -c.values if c.relative else self.history[c.base] - c.values  # Δ_m = θ̃_base − θ_m
                g.add_(delta.to(g.dtype), alpha=scale)
            if self.delayed is not None:
                with torch.no_grad():
                    self.delayed.arrive(g)
                self.anchor.check_finite()
            else:
                self.anchor.outer_step(g)
        self.version += 1
        self.history[self.version] = self.value.clone()
        for old in [v for v in self.history if v < self.version - self.settings.max_staleness]:
            del self.history[old]
        merged = Merged(
            self.version,
            [c.learner for c in taken],
            staleness,
            sum(c.tokens for c in taken),
            sum(c.steps for c in taken),
        )
        self.tally.merged_tokens += merged.tokens
        self.tally.merged_steps += merged.steps
        self.tally.staleness.extend(staleness)
        return merged

    # ---- checkpointed with the run ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "anchor": self.anchor.state_dict(),
            "history": {str(v): t.clone() for v, t in self.history.items()},
            "delayed": self.delayed.state_dict() if self.delayed is not None else None,
            "tally": {
                "merged_tokens": self.tally.merged_tokens,
                "dropped_tokens": self.tally.dropped_tokens,
                "merged_steps": self.tally.merged_steps,
                "staleness": list(self.tally.staleness),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.anchor.load_state_dict(state["anchor"])
        self.history = {int(v): t.clone() for v, t in state["history"].items()}
        if self.delayed is not None and state.get("delayed") is not None:
            self.delayed.load_state_dict(state["delayed"])
        self.tally = Tally(**state["tally"])
        self.pending, self.quorum_since = [], None
