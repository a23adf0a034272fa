"""Fragments and their sync schedule: shared by Streaming DiLoCo (Douillard et al. 2025,
arXiv:2501.18512) and CoCoDC (Zhu et al. 2025, arXiv:2504.17672).

**Partition.** A model (looked at through torch.compile's, DDP's and FSDP1's wrappers:
`blocks.unwrap`) is cut into *stages*, the input end (stages before the blocks), the *blocks*, and
the output end (stages after them), found in this order:

1. `model.stages()` when the model defines it, the override (the LM: `[embed, block0, ...,
   blockN-1, final norm]`; the vision models: stem/embedding, blocks, head): with three or more
   stages the first is the input end (for the tied LM also the output head) and the last the output
   end; with fewer every stage is a block.
2. else the model's repeated blocks (`blocks.py`: the largest `ModuleList`/`nn.Sequential` of
   same-type blocks anywhere in the tree, as Hugging Face's `model.layers`). Every module outside
   them that owns tensors is a stage of the input end when the module tree reaches it before the
   blocks (embeddings, a ViT's position embedding), else of the output end (final norm, head).
3. else its top-level children, as in 1.

Stages that own no tensor are dropped; a tensor reachable from several stages (a tied weight, as
`tie_word_embeddings`' head) belongs to the first, so it is counted and exchanged once; tensors of
the root module that no stage covers join the last stage.

`P` fragments are cut over the blocks (so `P` may not exceed the number of blocks):

- `strided` (default): fragment `p` holds blocks `p, p+P, p+2P, ...`;
- `sequential`: fragment `p` holds a contiguous run of blocks. For blocks found in the tree (2.) the
  runs are balanced by bytes, the ends counted with the first and last block: the largest fragment
  as small as possible, then the smallest as large as possible (`balanced_runs`). For `stages()` and
  top-level children the runs are balanced by count (sizes differ by at most one, the earlier
  fragments take the extra), as they always were;

then the input end is prepended to fragment 0 and the output end appended to fragment `P-1`
(embeddings/head go to the first/last fragment, as in Streaming DiLoCo). Each fragment exchanges
its parameters plus the floating-point persistent buffers of its stages (BatchNorm statistics), as
one flat buffer; every tensor of the model must have one dtype, float32, bfloat16 or float16 (the
anchors and the exchange keep float32 for the lower ones: `Streaming`). `imbalance` is the one-line
warning when the largest fragment holds more than `MAX_IMBALANCE` times the bytes of the smallest.

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
from ..units import human_bytes
from .base import local_shard, sync_tensors
from .blocks import repeated_blocks, unwrap, whole_bytes
from .catalog import PARTITIONS, SCHEDULES


# ---- partition ---------------------------------------------------------------------------------
MAX_IMBALANCE = 2.0  # the largest fragment's bytes over the smallest's beyond which `imbalance` warns
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Stage:
    name: str
    tensors: list[torch.Tensor]
    nbytes: int = 0  # the tensors' bytes, counted whole (`blocks.whole_bytes`)


@dataclass
class Layout:
    """A model's stages: the input end, the blocks fragments are cut over, the output end, and
    where the blocks came from (`source`: "stages()", "blocks <container>", "children")."""

    before: list[Stage]
    blocks: list[Stage]
    after: list[Stage]
    source: str

    @property
    def stages(self) -> list[Stage]:
        return [*self.before, *self.blocks, *self.after]


@dataclass
class Fragment:
    index: int
    stages: list[str]
    tensors: list[torch.Tensor] = field(repr=False)
    nbytes: int = 0  # the model's bytes it covers, counted whole (a sharded parameter in full)

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.tensors)


def model_stages(model: nn.Module) -> list[Stage]:
    """The model's stages in forward order, each with the tensors it owns (see module docstring)."""
    return layout(model).stages


def layout(model: nn.Module) -> Layout:
    """The model cut into its input end, blocks and output end (see the module docstring)."""
    model = unwrap(model)
    if callable(getattr(model, "stages", None)):
        modules = list(model.stages())
        lookup = {id(m): n for n, m in model.named_modules()}
        return _ends_and_blocks(
            model, [(lookup.get(id(m)) or f"stage{i}", m) for i, m in enumerate(modules)], "stages()"
        )
    found = repeated_blocks(model)
    if found is None:
        return _ends_and_blocks(model, list(model.named_children()), "children")
    keep = {id(t) for t in sync_tensors(model)}
    seen: set[int] = set()
    blocks = [s for s in (_stage(model, name, sync_tensors(m), keep, seen) for name, m in found.blocks) if s]
    before: list[Stage] = []
    after: list[Stage] = []
    passed = False
    for name, module in model.named_modules():  # the module tree's order: before the blocks, or after
        if found.holds(name):
            passed = True
            continue
        own = [local_shard(t) for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]]
        stage = _stage(model, name or "root", own, keep, seen)
        if stage:
            (after if passed else before).append(stage)
    rest = _stage(model, "root", sync_tensors(model), keep, seen)  # on no module the walk reached
    if rest:
        after.append(rest)
    return Layout(before, blocks, after, f"blocks {found.container or 'root'}")


def _stage(model: nn.Module, name: str, tensors: list[torch.Tensor], keep: set[int], seen: set[int]) -> Stage | None:
    """A stage of the tensors among `tensors` that are exchanged (`keep`) and no earlier stage owns
    (`seen`, updated), or None when there are none."""
    own = [t for t in tensors if id(t) in keep and id(t) not in seen]
    seen.update(id(t) for t in own)
    return Stage(name, own, whole_bytes(model, own)) if own else None


def _ends_and_blocks(model: nn.Module, named: list[tuple[str, nn.Module]], source: str) -> Layout:
    """Stages of named modules in forward order; with three or more the first and the last are the ends."""
    keep = {id(t) for t in sync_tensors(model)}
    seen: set[int] = set()
    stages = [s for s in (_stage(model, name, sync_tensors(m), keep, seen) for name, m in named) if s]
    rest = [t for t in sync_tensors(model) if id(t) not in seen]
    if rest:
        if stages:
            stages[-1].tensors.extend(rest)
            stages[-1].nbytes += whole_bytes(model, rest)
        else:
            stages.append(Stage("root", rest, whole_bytes(model, rest)))
    if not stages:
        raise ConfigError("the model has no parameters to partition into fragments")
    if len(stages) >= 3:
        return Layout([stages[0]], stages[1:-1], [stages[-1]], source)
    return Layout([], stages, [], source)


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


def balanced_runs(weights: list[int], parts: int) -> list[list[int]]:
    """`parts` contiguous, non-empty runs of the indices of `weights`: the largest run's sum as small
    as possible, then, among those cuts, the smallest run's sum as large as possible (ties: the
    earliest cut). Exact, by dynamic programming over (runs, prefix): O(parts · n²)."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} weights into {parts} non-empty runs")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # largest[p][j]: the smallest possible largest sum of p runs over weights[:j]
    largest = [[inf] * (n + 1) for _ in range(parts + 1)]
    largest[0][0] = 0
    for p in range(1, parts + 1):
        for j in range(p, n + 1):
            largest[p][j] = min(max(largest[p - 1][i], prefix[j] - prefix[i]) for i in range(p - 1, j))
    cap = largest[parts][n]
    # smallest[p][j]: the largest possible smallest sum of p runs over weights[:j], none above cap
    smallest = [[-inf] * (n + 1) for _ in range(parts + 1)]
    smallest[0][0] = inf
    start = [[0] * (n + 1) for _ in range(parts + 1)]
    for p in range(1, parts + 1):
        for j in range(p, n + 1):
            for i in range(p - 1, j):
                run = prefix[j] - prefix[i]
                if run <= cap and smallest[p - 1][i] > -inf and min(smallest[p - 1][i], run) > smallest[p][j]:
                    smallest[p][j], start[p][j] = min(smallest[p - 1][i], run), i
    runs, j = [], n
    for p in range(parts, 0, -1):
        i = start[p][j]
        runs.append(list(range(i, j)))
        j = i
    return runs[::-1]


def partition(model: nn.Module, fragments: int, mode: str = "strided") -> list[Fragment]:
    """Cut the model into `fragments` fragments (see the module docstring)."""
    lay = layout(model)
    blocks = lay.blocks
    if not 1 <= fragments <= len(blocks):
        hint = ""
        if lay.source == "children":
            hint = (
                f": it defines no stages() and has no repeated blocks (a ModuleList or nn.Sequential of "
                f"modules of one type); define model.stages() (docs/strategies.md) or use at most "
                f"{len(blocks)} fragments"
            )
        raise ConfigError(
            f"fragments must be between 1 and the model's {len(blocks)} blocks (stages), " f"got {fragments}{hint}"
        )
    if mode == "sequential" and lay.source.startswith("blocks"):
        weights = [b.nbytes for b in blocks]
        weights[0] += sum(s.nbytes for s in lay.before)
        weights[-1] += sum(s.nbytes for s in lay.after)
        groups = balanced_runs(weights, fragments)
    else:
        groups = split_blocks(len(blocks), fragments, mode)
    out = []
    for p, idx in enumerate(groups):
        members = [blocks[i] for i in idx]
        if p == 0:
            members = [*lay.before, *members]
        if p == fragments - 1:
            members = [*members, *lay.after]
        out.append(
            Fragment(
                p, [s.name for s in members], [t for s in members for t in s.tensors], sum(s.nbytes for s in members)
            )
        )
    dtypes = {t.dtype for f in out for t in f.tensors}
    if len(dtypes) != 1 or not dtypes <= set(DTYPES):
        raise ConfigError(
            f"fragment exchange needs every parameter and buffer in one dtype, "
            f"{' or '.join(str(d).removeprefix('torch.') for d in DTYPES)}; got "
            f"{', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))} "
            f"(cast the model with model.to(dtype))"
        )
    return out


class FragmentImbalanceWarning(UserWarning):
    """The largest fragment holds more than `MAX_IMBALANCE` times the bytes of the smallest."""


def imbalance(fragments: list[Fragment]) -> str | None:
    """The warning line when the largest fragment holds more than `MAX_IMBALANCE` times the bytes
    of the smallest (None when they are within it)."""
    sizes = [f.nbytes for f in fragments]
    big, small = max(sizes), min(sizes)
    if big <= MAX_IMBALANCE * small:
        return None
    ratio = f"{big / small:.3g}x" if small else "infinitely"
    return (
        f"fragments are unbalanced: the largest (fragment {sizes.index(big)}, {human_bytes(big)}) is {ratio} "
        f"the smallest (fragment {sizes.index(small)}, {human_bytes(small)}); each sync of the largest "
        f"costs that much more on the link. Change fragments or partition, or define model.stages() "
        f"(docs/strategies.md)"
    )


# ---- schedule ----------------------------------------------------------------------------------
def offsets(sync_every: int, fragments: int) -> list[int]:
    """Streaming DiLoCo's staggered offsets o_p = ⌊(p+1)·H/P⌋ mod H."""
    return [((p + 1) * sync_every // fragments) % sync_every for p in range(fragments)]


def slot_index(t: int, sync_every: int, n: int) -> int | None:
    """k when step t is slot k (t = ⌊k·H/N⌋, k ≥ 1), else None."""
    if t < 1:
        return None
    k = -(-t * n // sync_every)  # ceil(t·N/H): the only candidate
    return k if k * sync_every // n == t else None


class Schedule:
    """Which fragment starts a sync at which step; globally identical state on every rank."""

    def __init__(self, sync_every: int, fragments: int, n: int, mode: str = "round_robin"):
        if mode not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {mode!r}")
        self.H, self.P, self.mode = sync_every, fragments, mode
        self.n = self.set_n(n)
        self.rr_next = 0
        self.last_start = [0] * fragments  # step of each fragment's last sync start (0: none yet)
        self.rate: list[float] = [math.inf] * fragments  # R_p; +inf until its first merge
        self.turned = [False] * fragments  # adaptive_fair: started a sync in this round

    def set_n(self, n: int) -> int:
        if not self.P <= n <= self.H:
            raise ConfigError(
                f"syncs per period must be between fragments ({self.P}) and sync_every " f"({self.H}), got {n}"
            )
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
        return {
            "n": self.n,
            "mode": self.mode,
            "rr_next": self.rr_next,
            "last_start": list(self.last_start),
            "rate": list(self.rate),
            "turned": list(self.turned),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_n(int(state["n"]))
        self.rr_next = int(state["rr_next"])
        self.last_start = [int(v) for v in state["last_start"]]
        self.rate = [float(v) for v in state["rate"]]
        self.turned = [bool(v) for v in state.get("turned", [False] * self.P)]  # absent before adaptive_fair
