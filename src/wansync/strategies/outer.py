"""Anchors and outer optimizers: the one implementation SlowMo, CPDP, DiLoCo, Streaming DiLoCo
and CoCoDC share.

An `Anchor` holds the global parameters θ̃ of a set of tensors (the whole model, or one
fragment) as one flat buffer, and an outer `torch.optim.SGD` over it. The outer gradient is
the averaged pseudo-gradient Δ̄ = mean(θ̃ − θ_m) (DiLoCo sign: a descent direction).

- DiLoCo / Streaming: `outer_step(Δ̄)` with SGD(lr, momentum, Nesterov).
- SlowMo (Wang et al. 2020, arXiv:1910.00643): u ← β·u + Δ̄/η ; θ̃ ← θ̃ − α·η·u is exactly SGD with momentum β (no
  dampening) at lr α·η on the gradient Δ̄/η, so `slowmo_step(θ̄, η, α)` reuses the same optimizer
  and stays right when η changes between boundaries. At η = 0 (a schedule's warmup from 0 or its
  end at 0) the update is its limit, θ̃ ← θ̃ − α·Δ̄ (α·η·β·u vanishes), and u is kept: its increment
  Δ̄/η has none (`slowmo_limit`).
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

from ..comm.norms import all_finite
from ..comm.flat import FlatTensors
from ..errors import NonFiniteError


# values per block of the outer step on CPU (`Anchor._sgd`): its four buffers (θ̃, Δ̄, the momentum,
# the model) take 1 MiB of float32, inside a core's L2; each value takes the same kernel path, and
# gets the same bits, as in one op over the whole buffer
BLOCK = 1 << 16


def block_for(t: torch.Tensor) -> int:
    """The outer step's block for buffers like `t`: `BLOCK` on CPU; on an accelerator the whole
    buffer (a kernel launch per op and block would cost more than the cache it saves)."""
    return BLOCK if t.device.type == "cpu" else max(t.numel(), 1)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype outer state of `dtype` tensors accumulates in: float32 for the 16-bit floats
    (an outer step smaller than their rounding would be lost), else their own."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class Anchor:
    """θ̃ of `tensors` and its outer optimizer.

    Args:
        tensors: the model's tensors it anchors (local shards when the worker is sharded).
        lr, momentum, nesterov: the outer SGD's.
        buffers: which of `tensors` are buffers, not optimized (default: those that are not Parameters).
        device: where θ̃ and the outer momentum live and the outer step runs (None: with the model;
            "cpu": host memory, pinned when the model is on an accelerator, as INTELLECT-1 and
            torchft keep the outer state off the GPU).
        dtype: θ̃'s, the pseudo-gradients' and the outer momentum's (None: the tensors', float32 over
            bfloat16 or float16 ones). float32 over lower-precision tensors accumulates in float32:
            θ̃ keeps what one rounded step would lose, and the model receives it rounded (Streaming
            DiLoCo's FP32 accumulation; DiLoCo and SlowMo on a bf16 model likewise).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        lr: float,
        momentum: float,
        nesterov: bool = False,
        buffers: Sequence[torch.Tensor] | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        self.flat = FlatTensors(tensors)
        self.device = torch.device(device) if device is not None else self.flat.device
        self.dtype = dtype if dtype is not None else accumulation_dtype(self.flat.dtype)
        self.value = self.flat.gather().to(self.device, self.dtype)  # θ̃, identical on every rank
        if self.device != self.flat.device and self.device.type == "cpu" and self.flat.device.type != "cpu":
            self.value = self.value.pin_memory()
        # Buffers (BatchNorm statistics) are not optimized: the outer step gives them the plain
        # average θ̃ − Δ̄ = θ̄. Momentum or SlowMo's 1/η scaling on a running variance would
        # overshoot it below zero when the learning rate changes.
        is_buffer = (
            (lambda t: not isinstance(t, torch.nn.Parameter))
            if buffers is None
            else (lambda t, ids={id(b) for b in buffers}: id(t) in ids)
        )
        self.plain: list[tuple[int, int]] = []
        offset = 0
        for t in self.flat.tensors:
            if is_buffer(t):
                self.plain.append((offset, offset + t.numel()))
            offset += t.numel()
        self.optimizer = torch.optim.SGD([self.value], lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)

    def local(self) -> torch.Tensor:
        """θ_m of these tensors, as a new flat buffer beside θ̃ (in θ̃'s dtype)."""
        return self.flat.gather().to(self.device, self.dtype)

    def pseudo_gradient(self, local: torch.Tensor | None = None) -> torch.Tensor:
        """Δ_m = θ̃ − θ_m (a new flat buffer), in one pass over the model's tensors where they lie
        (no gathered copy of θ_m first), or from `local`, θ_m already gathered."""
        if local is not None:
            return self.value - local
        if self.device != self.flat.device:
            return self.value - self.local()
        packed = self.flat.packed()
        if packed is not None:
            return torch.sub(self.value, packed.detach())
        delta = torch.empty_like(self.value)
        with torch.no_grad():
            for anchor, t, out in zip(self.flat.views(self.value), self.flat.tensors, self.flat.views(delta)):
                torch.sub(anchor, t, out=out)
        return delta

    def outer_step(self, mean_delta: torch.Tensor, lr: float | None = None, *, load: bool = False) -> None:
        """θ̃ ← OuterOpt(θ̃, grad = Δ̄) (at learning rate `lr` from now on, when given); overwrites
        `mean_delta`. `load`: θ_m ← θ̃ too, in the same pass (`load_into_model`)."""
        self._step(mean_delta, lr, load=load)

    def step_to_average(self, avg: torch.Tensor, lr: float | None = None, *, load: bool = False) -> None:
        """The outer step on Δ̄ = θ̃ − θ̄ from the workers' average θ̄ (`avg`, overwritten: Δ̄ is
        formed in its buffer, block by block in the same pass as the step)."""
        self._step(avg, lr, average=True, load=load)

    def _step(
        self,
        source: torch.Tensor,
        lr: float | None = None,
        *,
        average: bool = False,
        divide: float | None = None,
        load: bool = False,
    ) -> None:
        """The outer SGD step on Δ̄ (`source`, or θ̃ − source when `average`, then divided by
        `divide`), the buffers given the plain average, θ̃ loaded into the model when `load`, and
        θ̃ checked finite."""
        if lr is not None:
            self.optimizer.param_groups[0]["lr"] = lr
        source = source.to(self.device)  # a mean that arrived where the model is
        plain = [(a, b, source[a:b].clone() if average else self.value[a:b] - source[a:b]) for a, b in self.plain]
        model = self.flat.packed() if load and self.device == self.flat.device else None
        try:
            with torch.no_grad():
                finite = self._sgd(source, average, divide, model)
        except RuntimeError as e:  # a learning rate beyond the tensor's float range
            if "overflow" not in str(e):
                raise
            raise NonFiniteError(
                f"the outer step would make the global model non-finite: learning rate {self.optimizer.param_groups[0]['lr']:g} "
                f"is beyond the range of {self.value.dtype}"
            ) from None
        with torch.no_grad():
            for a, b, avg in plain:
                self.value[a:b] = avg
                if model is not None:
                    model[a:b] = avg
        if load and model is None:
            self.load_into_model()
        if not finite:
            self.check_finite()

    def _sgd(self, source: torch.Tensor, average: bool, divide: float | None, model: torch.Tensor | None) -> bool:
        """torch.optim.SGD's step on θ̃ (no weight decay, no dampening), bit for bit, in blocks of
        `block_for(θ̃)` values: every op of the step (forming Δ̄, the momentum, the Nesterov look-ahead, the
        update, the copy into the model) runs on one block while it is in cache, so each buffer is
        read from memory once per step instead of once per op. The look-ahead is formed in `source`
        (a buffer the caller gives up): torch's step allocates a P-sized temporary for it, and fresh
        memory costs a page fault per 4 KiB, more than the arithmetic. The momentum lives in the
        optimizer's state, so its state_dict is torch's. Returns whether θ̃'s sum is finite (then
        every value is: `all_finite`)."""
        group = self.optimizer.param_groups[0]
        lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
        state = self.optimizer.state[self.value] if momentum else {}
        buf = state.get("momentum_buffer")
        first = momentum and buf is None
        if first:
            buf = state["momentum_buffer"] = torch.empty_like(self.value)
        sums, block = [], block_for(self.value)
        for a in range(0, self.value.numel(), block):
            value, grad = self.value[a : a + block], source[a : a + block]
            if average:
                torch.sub(value, grad, out=grad)
            if divide is not None:
                grad.div_(divide)
            if momentum:
                m = buf[a : a + block]
                if first:
                    m.copy_(grad)
                else:
                    m.mul_(momentum).add_(grad)
                grad = grad.add_(m, alpha=momentum) if nesterov else m
            value.add_(grad, alpha=-lr)
            if model is not None:
                model[a : a + block].copy_(value)
            sums.append(value.sum())
        return bool(torch.isfinite(torch.stack(sums).sum())) if sums else True

    def lookahead(self, grad: torch.Tensor, lr: float | None = None) -> torch.Tensor:
        """θ̃ after `outer_step(grad, lr)` (None: the current learning rate), as a new buffer, leaving θ̃ and the
        outer momentum as they are (eager updates' proxy step, `compensation.eager_correct`). The same
        ops as `_sgd`, so a later `outer_step` on the same gradient gives the same bits; `grad` is
        left as it is."""
        group = self.optimizer.param_groups[0]
        lr, momentum, nesterov = group["lr"] if lr is None else lr, group["momentum"], group["nesterov"]
        g = grad.to(self.device, self.dtype, copy=True)
        if momentum:
            buf = self.optimizer.state[self.value].get("momentum_buffer")
            m = g.clone() if buf is None else buf.mul(momentum).add_(g)
            g = g.add_(m, alpha=momentum) if nesterov else m
        ahead = self.value.add(g, alpha=-lr)
        for a, b in self.plain:  # buffers: the plain average, as in `_step`
            ahead[a:b] = self.value[a:b] - grad[a:b].to(self.device, self.dtype)
        return ahead

    def check_finite(self) -> None:
        """The global parameters are identical on every rank, so every rank raises together: a
        finite mean can still overflow in the outer step (an outer learning rate of 1e300)."""
        if not all_finite(self.value):
            raise NonFiniteError(
                "the outer step made the global model non-finite (the outer learning rate " "or momentum is too large)"
            )

    def slowmo_step(self, avg: torch.Tensor, inner_lr: float, slow_lr: float, *, load: bool = False) -> None:
        """From the workers' average θ̄ (`avg`, overwritten): u ← β·u + (θ̃ − θ̄)/η ; θ̃ ← θ̃ − α·η·u
        (β is the optimizer's momentum; buffers: θ̃ ← θ̄)."""
        self._step(avg, lr=slow_lr * inner_lr, average=True, divide=inner_lr, load=load)

    def slowmo_limit(self, avg: torch.Tensor, slow_lr: float, *, load: bool = False) -> None:
        """`slowmo_step` as η → 0, from the workers' average θ̄ (`avg`): θ̃ ← θ̃ − α·(θ̃ − θ̄), exactly
        θ̄ at α = 1 (plain averaging); u untouched (buffers: θ̃ ← θ̄)."""
        source = avg.to(device=self.device, dtype=self.value.dtype)
        with torch.no_grad():
            self.value.lerp_(source, slow_lr)  # θ̃ + α·(θ̄ − θ̃); weight 1 returns θ̄ itself
            for a, b in self.plain:
                self.value[a:b] = source[a:b]
        if load:
            self.load_into_model()
        self.check_finite()

    def load_into_model(self) -> None:
        """θ_m ← θ̃."""
        self.flat.scatter(self.value)

    def state_dict(self) -> dict[str, Any]:
        # a copy: the optimizer updates its momentum buffer in place
        return {"value": self.value.detach().clone(), "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.value.copy_(state["value"])
        self.optimizer.load_state_dict(state["optimizer"])
