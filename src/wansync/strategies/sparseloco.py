"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, arXiv:2508.15706): DiLoCo's H local steps, then
a sparse, quantized, error-fed pseudo-gradient instead of a dense one through outer Nesterov.

The inner optimizer is the user's (the trainer's default AdamW, as in the paper). Each worker r keeps
an error buffer e_r (zero at the start). At each boundary::

    Δ_r = θ̃ − θ_r                       # this worker's pseudo-gradient
    e_r ← β·e_r + Δ_r                   # error feedback
    s_r = Q(TopK_chunk(e_r))            # per chunk (2-D blocks of matrices), the k largest, 2-bit quantized
    e_r ← e_r − s_r                     # what was not sent waits for the next round
    Δ̄ = Aggregate_r(s_r)                # all-gathered; per index the mean over the workers that sent it
    θ̃ ← θ̃ − α·Δ̄;  θ_r ← θ̃              # no outer momentum: the error feedback stands in for it

The exchange (`comm.exchange` with a `comm.sparse.SparseCodec`) does the middle three lines: it
sends β·e_r + Δ_r's top-k, leaves e_r holding what it did not carry, and returns Δ̄. A model's
float buffers (BatchNorm statistics) are not pseudo-gradients: they are averaged as they are, fp32
(the plain mean every strategy gives them).

Defaults and their sources:
- β = 0.999 (`error_decay`), chunk 64, top-k 32 per 64 × 64 block (density 32/4096 ≈ 0.78 %),
  quantizer range 6σ, mean over the workers that chose an index: the reference code (CCLoco in
  tplr-ai/SparseLoCo, and its `TopKCompressor`).
- 2 bits per value (`bits`): the paper's setting (the reference code's own default is 8-bit bins).
- α = 1 (`outer_lr`): the outer step applies Δ̄ as it is. The reference code adds `lr · Δ` to the
  error buffer and then steps by `lr`, so its learning rate acts twice; at lr 1 that and the
  paper's rule above coincide.
- H = 30 (`sync_every`): the communication interval of this group's MuLoCo study of error-fed
  compressed DiLoCo (arXiv:2505.23725); SparseLoCo's own runs use tens of inner steps. Our choice, to
  be set per run like DiLoCo's H.
- DCT off (`dct`): the reference code's default; on, the chunks are chosen in the 2-D DCT domain
  (DeMo's transform, `comm.dct`), and the residual is kept there too.

Identities (tested on gloo groups): at density 1, 32-bit values and β = 0 this is DiLoCo with outer
SGD at lr α and no momentum; with β = 1 and no quantization, what a worker sent plus its error buffer
is what its pseudo-gradients added up to.

`overlap_rounds`: DiLoCoX's one-step-delay overlap (`strategies.round_overlap`): the all-gather of round
k's s_r travels while round k + 1 trains, and θ̃ ← θ̃ − α·Δ̄(k) is applied at the end of round k + 1, with
Δ_r = s_r − θ_r measured from where this worker's round began. The error buffer is the same one: β·e_r
is taken at each round's end, after the last round's exchange has left its residue there.

A rejoining worker of a fault-tolerant run heals the global state from a peer and starts with a
zero error buffer: a peer's residual is that peer's, and sending it again would count it twice.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.flat import FlatTensors
from .base import Strategy, local_shard, model_buffers
from .catalog import SparseLoCoOptions
from .options import anchor_device, sparse_codec
from .outer import Anchor
from .periodic import PeriodicTimetable
from .round_overlap import RoundOverlap


class SparseLoCo(Strategy):
    name = "sparseloco"
    Options = SparseLoCoOptions
    Timetable = PeriodicTimetable
    exchange_purpose = "pseudo_grads"
    knobs = ("sync_every", "density")

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
        self.broadcast_initial_state()
        params = [local_shard(p) for p in self.module.parameters() if p.requires_grad]
        self._shapes = [p.shape for p in params]
        self.codec = self.wire_codec(self.opts, self._shapes)
        self.anchor = Anchor(
            params, lr=self.opts.outer_lr, momentum=0.0, device=anchor_device(self.opts.outer_state_device)
        )
        self.error = torch.zeros_like(self.anchor.value)  # e_r
        buffers = model_buffers(self.module)
        self.buffers = FlatTensors(buffers) if buffers else None
        self.computed_at = 0  # steps computed at the last round (`pace`)
        self.overlap = RoundOverlap(self.anchor, self.comm) if self.opts.overlap_rounds else None

    @classmethod
    def wire_codec(cls, opts: Any, shapes: Any) -> Any:
        return sparse_codec(opts, shapes, dct=opts.dct)

    def after_inner_step(self) -> None:
        if self.overlap is not None:
            self.overlap.halfway(self.timetable.round_step(self.t), self.opts.sync_every)
        if self.timetable.is_boundary(self.t):
            self.round_boundary()

    def finish(self) -> None:
        if self.overlap is not None:
            partial = self.timetable.final_sync(self.t)  # steps since the last boundary, whose buffers
            self.overlap.finish((lambda delta: self.send(delta, async_op=False).wait()) if partial else None)
            if partial:  # were averaged there
                self.average_buffers()
        elif self.timetable.final_sync(self.t):
            self.boundary()

    def boundary(self) -> None:
        if self.overlap is not None:  # Δ̄ of the last round applied, this one's sent
            self.overlap.boundary(self.send)
        else:
            delta = self.anchor.pseudo_gradient()  # Δ_r = θ̃ − θ_r
            self.send(delta, async_op=False)  # Δ̄ in delta's buffer
            self.anchor.outer_step(delta, load=True)  # θ̃ ← θ̃ − α·Δ̄;  θ_r ← θ̃
        self.average_buffers()
        self.emit(
            "sync",
            kind="outer",
            bytes=self.codec.wire_bytes(),
            codec="sparse",
            kept=self.codec.kept,
            **({"overlapped": True} if self.overlap is not None else {}),
        )

    def retune_exchange(self, knobs: dict[str, Any]) -> None:
        """`density`: the share of each chunk sent from this boundary's exchange on (the error buffer
        keeps what is not sent, whatever the density)."""
        if "density" in knobs:
            self.opts.density = float(knobs["density"])
            self.codec = self.wire_codec(self.opts, self._shapes)

    def send(self, delta: torch.Tensor, async_op: bool = True) -> Any:
        """e_r ← β·e_r + Δ_r; s_r = Q(TopK(e_r)) sent; e_r ← e_r − s_r; Δ̄ = Aggregate_r(s_r) in delta's buffer."""
        self.error.mul_(self.opts.error_decay)  # (+ Δ_r: the exchange adds it)
        weight = self.pace.weight(self.computed_at)  # the steps computed since the last round
        self.computed_at = self.pace.computed  # (`strategies.pace`; None: unweighted)
        return self.exchange.mean(
            delta,
            "pseudo_grads",
            self.codec,
            async_op=async_op,
            inplace=True,
            residual=self.error,
            weight=weight,
            origin=0.0,
        )

    def average_buffers(self) -> None:
        """BatchNorm statistics: their plain mean, at once."""
        if self.buffers is not None:
            buf = self.buffers.gather()
            self.exchange.mean(buf, "params", inplace=True)
            self.buffers.scatter(buf)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"outer_state": [self.error]}  # in place of DiLoCo's outer momentum

    # ---- resumable state: θ̃ and the error buffer (a healed worker's starts at zero) -------------------
    def extra_state(self) -> dict[str, Any]:
        overlap = {"overlap": self.overlap.state_dict()} if self.overlap is not None else {}  # (waits first:
        return {
            "anchor": self.anchor.state_dict(),
            "error": self.error.detach().clone(),  # e_r final then)
            **({"computed_at": self.computed_at} if self.pace.active else {}),
            **overlap,
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.anchor.load_state_dict(state["anchor"])
        self.computed_at = int(state.get("computed_at", 0))
        error = state.get("error")
        self.error.copy_(error if error is not None else torch.zeros_like(self.error))
        if self.overlap is not None:
            self.overlap.load_state_dict(state.get("overlap"))

    def heal_state(self) -> dict[str, Any]:
        """A peer's state without its error buffer: the healed worker's own starts at zero."""
        return {k: v for k, v in super().heal_state().items() if k != "error"}
