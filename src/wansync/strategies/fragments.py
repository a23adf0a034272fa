"""Fragments and their sync schedule: shared by Streaming DiLoCo (Douillard et al. 2025,
arXiv:2501.18512) and CoCoDC (Zhu et al. 2025, arXiv:2504.17672).

**Partition.** A model is cut into *stages*: `model.stages()` when the model defines it (the LM:
`[embed, block0, ..., blockN-1, final norm]`; the vision models: stem/embedding, blocks, head), else
its top-level children. Stages that own no tensor (activations, pooling) are dropped; a tensor
reachable from several stages (a tied weight) belongs to the first; tensors of the root module that
no stage covers join the last stage. With three or more stages the first stage is the *input end*
(embeddings; for the tied LM also the output head) and the last the *output end* (final norm / head);
the stages between are the *blocks*. With fewer than three stages every stage is a block.

`P` fragments are cut over the blocks (so `P` may not exceed the number of blocks):

- `strided` (default): fragment `p` holds blocks `p, p+P, p+2P, ...`;
- `sequential`: fragment `p` holds a contiguous run of blocks (sizes differ by at most one, the
  earlier fragments take the extra);

then the input end is prepended to fragment 0 and the output end appended to fragment `P-1`
(embeddings/head go to the first/last fragment, as in Streaming DiLoCo). Each fragment exchanges
its parameters plus the floating-point persistent buffers of its stages (BatchNorm statistics), as
one flat buffer.

**Schedule.** `N` fragment syncs per period of `H` steps, in *slots*: slot `k = 1, 2, ...` is at step
`⌊k·H/N⌋`. With `N = P` and round robin (fragment `(k-1) mod P` at slot `k`) fragment `p` starts at
the steps `t ≥ 1` with `(t − o_p) mod H == 0`, `o_p = ⌊(p+1)·H/P⌋ mod H`: exactly Streaming
DiLoCo's staggered offsets. CoCoDC's adaptive choice picks, at each slot, any fragment unsynced
for ≥ `H` steps (oldest first), else `argmax_p R_p` with `R_p = ‖Δθ̃_p‖₂ / I_p` (`Δθ̃_p`: change of the
global fragment at its last merge, `I_p`: steps between that sync's start and the previous one; a
fragment never merged has `R_p = +inf`, so the first slots visit every fragment once; ties: lowest
`p`). The fragment just merged has the largest R_p (its I_p is the smallest), so when N approaches H
plain `adaptive` locks in (0 0 0 0 0 1 2 3: fragment 0 every slot until the staleness rule forces
the others); `adaptive_fair` makes the same choice among the fragments that have not started a sync
in the current round (a round ends when every fragment has had a turn), so no fragment syncs twice
before every other fragment synced once. "Unsynced" counts from the start of the fragment's last sync (start 0 for none yet). A fragment
whose exchange is still in flight is never chosen again; when the round-robin fragment (or, in
adaptive mode, every fragment; in adaptive_fair mode, every fragment still due in the round) is in
flight, the slot is skipped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .base import sync_tensors

PARTITIONS = ("strided", "sequential")
SCHEDULES = ("adaptive", "adaptive_fair", "round_robin")


# ---- partition ---------------------------------------------------------------------------------
@dataclass
class Stage:
    name: str
    tensors: list[torch.Tensor]


@dataclass
class Fragment:
    index: int
    stages: list[str]
    tensors: list[torch.Tensor] = field(repr=False)

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.tensors)


def model_stages(model: nn.Module) -> list[Stage]:
    """The model's stages in forward order, each with the tensors it owns (see module docstring)."""
    if hasattr(model, "stages") and callable(model.stages):
        modules = list(model.stages())
        lookup = {id(m): n for n, m in model.named_modules()}
        names = [lookup.get(id(m)) or f"stage{i}" for i, m in enumerate(modules)]
    else:
        named = list(model.named_children())
        modules, names = [m for _, m in named], [n for n, _ in named]
    seen: set[int] = set()
    stages: list[Stage] = []
    for name, module in zip(names, modules):
        own = [t for t in sync_tensors(module) if id(t) not in seen]
        seen.update(id(t) for t in own)
        if own:
            stages.append(Stage(name, own))
    rest = [t for t in sync_tensors(model) if id(t) not in seen]
    if rest:
        if stages:
            stages[-1].tensors.extend(rest)
        else:
            stages.append(Stage("root", rest))
    if not stages:
        raise ConfigError("the model has no parameters to partition into fragments")
    return stages


def split_blocks(n_blocks: int, fragments: int, mode: str) -> list[list[int]]:
    """Block indices of each fragment: strided (p, p+P, ...) or sequential (contiguous runs)."""
    if mode == "strided":
        return [list(range(p, n_blocks, fragments)) for p in range(fragments)]
    if mode == "sequential":
        base, extra = divmod(n_blocks, fragments)
        out, start = [], 0
        for p in range(fragments):
            size = base + (1 if p < extra else 0)
            out.append(list(range(start, start + size)))
            start += size
        return out
    raise ConfigError(f"partition must be one of {', '.join(PARTITIONS)}, got {mode!r}")


def partition(model: nn.Module, fragments: int, mode: str = "strided") -> list[Fragment]:
    """Cut the model into `fragments` fragments (see the module docstring)."""
    stages = model_stages(model)
    if len(stages) >= 3:
        first, blocks, last = stages[0], stages[1:-1], stages[-1]
    else:
        first, blocks, last = None, stages, None
    if not 1 <= fragments <= len(blocks):
        raise ConfigError(f"fragments must be between 1 and the model's {len(blocks)} blocks (stages), "
                          f"got {fragments}")
    out = []
    for p, idx in enumerate(split_blocks(len(blocks), fragments, mode)):
        members = [blocks[i] for i in idx]
        if p == 0 and first is not None:
            members.insert(0, first)
        if p == fragments - 1 and last is not None:
            members.append(last)
        out.append(Fragment(p, [s.name for s in members], [t for s in members for t in s.tensors]))
    dtypes = {t.dtype for f in out for t in f.tensors}
    if dtypes != {torch.float32}:
        raise ConfigError(f"fragment exchange needs float32 parameters, got {sorted(map(str, dtypes))}")
    return out


# ---- schedule ----------------------------------------------------------------------------------
def offsets(sync_every: int, fragments: int) -> list[int]:
    """Streaming DiLoCo's staggered offsets o_p = ⌊(p+1)·H/P⌋ mod H."""
    return [((p + 1) * sync_every // fragments) % sync_every for p in range(fragments)]


def slot_index(t: int, sync_every: int, n: int) -> int | None:
    """k when step t is slot k (t = ⌊k·H/N⌋, k ≥ 1), else None."""
    if t < 1:
        return None
    k = -(-t * n // sync_every)            # ceil(t·N/H): the only candidate
    return k if k * sync_every // n == t else None


class Schedule:
    """Which fragment starts a sync at which step; globally identical state on every rank."""

    def __init__(self, sync_every: int, fragments: int, n: int, mode: str = "round_robin"):
        if mode not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {mode!r}")
        self.H, self.P, self.mode = sync_every, fragments, mode
        self.n = self.set_n(n)
        self.rr_next = 0
        self.last_start = [0] * fragments          # step of each fragment's last sync start (0: none yet)
        self.rate: list[float] = [math.inf] * fragments   # R_p; +inf until its first merge
        self.turned = [False] * fragments           # adaptive_fair: started a sync in this round

    def set_n(self, n: int) -> int:
        if not self.P <= n <= self.H:
            raise ConfigError(f"syncs per period must be between fragments ({self.P}) and sync_every "
                              f"({self.H}), got {n}")
        self.n = int(n)
        return self.n

    def is_slot(self, t: int) -> bool:
        return slot_index(t, self.H, self.n) is not None

    def choose(self, t: int, in_flight: set[int] | frozenset[int] = frozenset()) -> tuple[int, str] | None:
        """(fragment, reason) for the slot at step t, or None when the slot is skipped.

        Round robin advances only when a sync starts. Reasons: round_robin, stale, rate.
        """
        if self.mode == "round_robin":
            p = self.rr_next
            if p in in_flight:
                return None
            self.rr_next = (p + 1) % self.P
            return p, "round_robin"
        fair = self.mode == "adaptive_fair"
        free = [p for p in range(self.P) if p not in in_flight and not (fair and self.turned[p])]
        if not free:
            return None
        stale = [p for p in free if t - self.last_start[p] >= self.H]
        if stale:
            return min(stale, key=lambda p: (self.last_start[p], p)), "stale"
        return max(free, key=lambda p: (self.rate[p], -p)), "rate"

    def record_start(self, p: int, t: int) -> int:
        """Note that fragment p starts a sync at t; returns I_p (steps since its previous start)."""
        interval = max(1, t - self.last_start[p])
        self.last_start[p] = t
        self.turned[p] = True
        if all(self.turned):
            self.turned = [False] * self.P
        return interval

    @property
    def uses_rates(self) -> bool:
        """Whether `choose` reads R_p (the adaptive modes); round robin never does."""
        return self.mode != "round_robin"

    def record_merge(self, p: int, anchor_change_norm: float, interval: int) -> None:
        """R_p = ‖Δθ̃_p‖ / I_p from the merge of the sync that covered `interval` steps."""
        self.rate[p] = float(anchor_change_norm) / max(1, interval)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "mode": self.mode, "rr_next": self.rr_next, "last_start": list(self.last_start),
                "rate": list(self.rate), "turned": list(self.turned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_n(int(state["n"]))
        self.rr_next = int(state["rr_next"])
        self.last_start = [int(v) for v in state["last_start"]]
        self.rate = [float(v) for v in state["rate"]]
        self.turned = [bool(v) for v in state.get("turned", [False] * self.P)]    # absent before adaptive_fair
