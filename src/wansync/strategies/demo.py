"""DeMo, decoupled momentum (Peng, Quesnelle, Kingma 2024, arXiv:2411.19870): no inner optimizer and
one sparse exchange per step, of the part of each worker's momentum that moves fastest.

Each worker r keeps a momentum m_r (zero at the start). Every step::

    m_r ← β·m_r + g_r                   # g_r: this step's local gradient
    q_r = TopK_chunk(DCT_chunk(m_r))    # chunked orthonormal DCT-II, the k largest coefficients per chunk
    m_r ← m_r − IDCT(q_r)               # what is sent leaves the momentum
    Q = IDCT(Aggregate_r(q_r))          # all-gathered; per index the mean over the workers that sent it
    θ ← θ − η·sign(Q)                   # after the decoupled weight decay θ ← (1 − η·λ)·θ

The exchange (`comm.exchange` with a `comm.sparse.SparseCodec`, DCT on) does the middle three lines:
it sends the top-k of β·m_r + g_r in the DCT domain, leaves m_r holding the rest (subtracted in the DCT
domain, so with every coefficient kept m_r is exactly zero), and returns Q. Every worker applies the
same sign step to the same parameters, so the replicas stay bit-identical without ever averaging
them; a model's float buffers (BatchNorm statistics) are averaged as they are every step.

The inner optimizer a strategy is given is a carrier here: its learning rate η (each parameter
group's, so a schedule that sets it works) and its `weight_decay` λ (applied decoupled, as the
reference does) are read, and its step is never taken. DeMo replaces the optimizer's own update, so
anything but a plain `torch.optim.SGD` (no momentum, no Nesterov) is refused: an AdamW's moments or an
SGD's momentum would be silently dropped. The trainer gives it such an SGD (`--optimizer` and
`--momentum` are refused with `--strategy demo`).

Defaults and their sources (the reference code, bloc97/DeMo): β = 0.999 (`momentum_decay`, its
`compression_decay`), chunk 64, top-k 32 per chunk (density 32/4096 for a 64 × 64 block), float32
values (`bits` 32: the paper sends them unquantized; the statistical quantizer is available), mean over
the workers that chose an index (its `scatter_reduce(..., "mean")`). Ours: m ← β·m + g as the paper
writes it; the reference adds η·g, which at a constant η is the same run (sign and top-k are
scale-free) but weights gradients by the learning rate when a schedule moves it.

Identity (tested): with every DCT coefficient kept the residual is zero after every step and the
update is sign descent on the mean gradient.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..comm.flat import FlatTensors
from ..errors import ConfigError
from .base import Strategy, local_shard, model_buffers
from .catalog import DeMoOptions
from .options import sparse_codec
from .timetable import Timetable


def check_carrier(optimizer: torch.optim.Optimizer) -> None:
    """DeMo reads an optimizer's lr and weight decay and takes none of its steps: one that would
    update by a rule of its own is refused."""
    plain = type(optimizer) is torch.optim.SGD and all(
        not g.get("momentum") and not g.get("nesterov") for g in optimizer.param_groups
    )
    if not plain:
        what = type(optimizer).__name__ + ("" if type(optimizer) is not torch.optim.SGD else " with momentum")
        raise ConfigError(
            f"demo replaces the inner optimizer's update (sign descent on its own momentum, "
            f"momentum_decay): give it torch.optim.SGD(params, lr=...) without momentum for its "
            f"learning rate and weight decay, not {what}"
        )


class DeMoTimetable(Timetable):
    """Every step ends with the sparse exchange and its sign step; nothing is left for `finish()`."""

    def is_boundary(self, t: int) -> bool:
        return True


class DeMo(Strategy):
    name = "demo"
    Options = DeMoOptions
    Timetable = DeMoTimetable
    steps_optimizer = False
    exchange_purpose = "momentum"

    def __init__(self, model, optimizer, options=None, **kw):
        check_carrier(optimizer)
        super().__init__(model, optimizer, options, **kw)
        self.broadcast_initial_state()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.flat = FlatTensors([local_shard(p) for p in self.params])
        self.codec = self.wire_codec(self.opts, [local_shard(p).shape for p in self.params])
        self.momentum = torch.zeros(self.flat.numel, dtype=torch.float32, device=self.flat.device)  # m_r
        buffers = model_buffers(self.module)
        self.buffers = FlatTensors(buffers) if buffers else None
        self._skip = False

    @classmethod
    def wire_codec(cls, opts: Any, shapes: Any) -> Any:
        return sparse_codec(opts, shapes, dct=True)

    def inner_step(self, skip: bool) -> None:
        """No inner optimizer step: the update is the sign step after the exchange (`after_inner_step`);
        a dropped update (`skip`) contributes a zero gradient to it."""
        self._skip = skip

    def gradient(self) -> torch.Tensor:
        """g_r as a new flat float32 buffer (zeros where a parameter has no gradient, or all of it when
        this worker's update is dropped)."""
        g = torch.zeros(self.flat.numel, dtype=torch.float32, device=self.flat.device)
        if not self._skip:
            for view, p in zip(self.flat.views(g), self.params):
                if p.grad is not None:
                    view.copy_(local_shard(p.grad))
        return g

    def after_inner_step(self) -> None:
        started = time.perf_counter()
        groups = self.optimizer.param_groups
        self._decay(groups)  # θ ← (1 − η·λ)·θ
        q = self.gradient()
        self.momentum.mul_(self.opts.momentum_decay)  # m_r ← β·m_r (+ g_r: the exchange adds it)
        spent = time.perf_counter() - started
        # q_r = TopK(DCT(m_r)) sent, m_r ← m_r − IDCT(q_r), Q = IDCT(Aggregate_r(q_r)) in q's buffer
        self.exchange.mean(q, "momentum", self.codec, inplace=True, residual=self.momentum, origin=0.0)
        started = time.perf_counter()
        q.sign_()
        with torch.no_grad():
            for view, p, lr in zip(self.flat.views(q), self.flat.tensors, self._lrs(groups)):
                p.add_(view.to(p.dtype), alpha=-lr)  # θ ← θ − η·sign(Q)
        if self.buffers is not None:  # BatchNorm statistics: their plain mean
            buf = self.buffers.gather()
            self.exchange.mean(buf, "params", inplace=True)
            self.buffers.scatter(buf)
        self.last_inner_s += spent + time.perf_counter() - started  # the update itself: compute
        self.emit("sync", kind="step", bytes=self.codec.wire_bytes(), codec="sparse", kept=self.codec.kept)

    def _lrs(self, groups: list[dict[str, Any]]) -> list[float]:
        """Each parameter's group's learning rate."""
        of = {id(p): float(g["lr"]) for g in groups for p in g["params"]}
        return [of[id(p)] for p in self.params]

    def _decay(self, groups: list[dict[str, Any]]) -> None:
        with torch.no_grad():
            for g in groups:
                wd = float(g.get("weight_decay", 0.0))
                if wd:
                    for p in g["params"]:
                        if p.requires_grad:
                            local_shard(p).mul_(1.0 - float(g["lr"]) * wd)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"inner_optimizer": [self.momentum]}  # the optimizer DeMo replaces: its state

    # ---- resumable state: the momentum ----------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {"momentum": self.momentum.detach().clone()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.momentum.copy_(state["momentum"])
