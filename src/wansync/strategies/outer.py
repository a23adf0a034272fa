"""Anchors and outer optimizers: the one implementation SlowMo, CPDP, DiLoCo, Streaming DiLoCo
and CoCoDC share.

An `Anchor` holds the global parameters θ̃ of a set of tensors (the whole model, or one
fragment) as one flat buffer, and an outer `torch.optim.SGD` over it. The outer gradient is
the averaged pseudo-gradient Δ̄ = mean(θ̃ − θ_m) (DiLoCo sign: a descent direction).

- DiLoCo / Streaming: `outer_step(Δ̄)` with SGD(lr, momentum, Nesterov).
- SlowMo (Wang et al. 2020, arXiv:1910.00643): u ← β·u + Δ̄/η ; θ̃ ← θ̃ − α·η·u is exactly SGD with momentum β (no
  dampening) at lr α·η on the gradient Δ̄/η, so `slowmo_step(Δ̄, η, α)` reuses the same optimizer
  and stays right when η changes between boundaries.
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

from ..comm.exchange import all_finite
from ..comm.flat import FlatTensors
from ..errors import NonFiniteError


class Anchor:
    def __init__(self, tensors: Sequence[torch.Tensor], *, lr: float, momentum: float, nesterov: bool = False):
        self.flat = FlatTensors(tensors)
        self.value = self.flat.gather()                    # θ̃, identical on every rank
        # Buffers (BatchNorm statistics) are not optimized: the outer step gives them the plain
        # average θ̃ − Δ̄ = θ̄. Momentum or SlowMo's 1/η scaling on a running variance would
        # overshoot it below zero when the learning rate changes.
        self.plain: list[tuple[int, int]] = []
        offset = 0
        for t in self.flat.tensors:
            if not isinstance(t, torch.nn.Parameter):
                self.plain.append((offset, offset + t.numel()))
            offset += t.numel()
        self.optimizer = torch.optim.SGD([self.value], lr=lr, momentum=momentum,
                                         nesterov=nesterov and momentum > 0)

    def local(self) -> torch.Tensor:
        """θ_m of these tensors, as a new flat buffer."""
        return self.flat.gather()

    def pseudo_gradient(self, local: torch.Tensor | None = None) -> torch.Tensor:
        """Δ_m = θ̃ − θ_m (a new flat buffer)."""
        return self.value - (self.local() if local is None else local)

    def outer_step(self, mean_delta: torch.Tensor, lr: float | None = None) -> None:
        """θ̃ ← OuterOpt(θ̃, grad = Δ̄) (at learning rate `lr` from now on, when given); overwrites
        `mean_delta`."""
        self._step(mean_delta, lr)
        self.check_finite()

    def _step(self, mean_delta: torch.Tensor, lr: float | None = None) -> None:
        if lr is not None:
            self.optimizer.param_groups[0]["lr"] = lr
        averaged = [(a, b, self.value[a:b] - mean_delta[a:b]) for a, b in self.plain]
        try:
            with torch.no_grad():
                self._sgd(mean_delta)
        except RuntimeError as e:                          # a learning rate beyond the tensor's float range
            if "overflow" not in str(e):
                raise
            raise NonFiniteError(f"the outer step would make the global model non-finite: learning rate {self.optimizer.param_groups[0]['lr']:g} "
                                 f"is beyond the range of {self.value.dtype}") from None
        with torch.no_grad():
            for a, b, avg in averaged:
                self.value[a:b] = avg

    def _sgd(self, grad: torch.Tensor) -> None:
        """torch.optim.SGD's step on θ̃ (no weight decay, no dampening), bit for bit, with the
        Nesterov look-ahead formed in `grad` itself: torch's step allocates a P-sized temporary
        for it, and fresh memory costs a page fault per 4 KiB, more than the arithmetic. `grad`
        (Δ̄, a buffer the caller gives up) is overwritten. The momentum lives in the optimizer's
        state, so its state_dict is torch's."""
        group = self.optimizer.param_groups[0]
        lr, momentum = group["lr"], group["momentum"]
        if momentum:
            state = self.optimizer.state[self.value]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = grad.clone()
            else:
                buf.mul_(momentum).add_(grad)
            grad = grad.add_(buf, alpha=momentum) if group["nesterov"] else buf
        self.value.add_(grad, alpha=-lr)

    def check_finite(self) -> None:
        """The global parameters are identical on every rank, so every rank raises together: a
        finite mean can still overflow in the outer step (an outer learning rate of 1e300)."""
        if not all_finite(self.value):
            raise NonFiniteError("the outer step made the global model non-finite (the outer learning rate "
                                 "or momentum is too large)")

    def slowmo_step(self, mean_delta: torch.Tensor, inner_lr: float, slow_lr: float) -> None:
        """u ← β·u + Δ̄/η ; θ̃ ← θ̃ − α·η·u (β is the optimizer's momentum; buffers: θ̃ ← θ̄)."""
        averaged = [(a, b, self.value[a:b] - mean_delta[a:b]) for a, b in self.plain]
        self._step(mean_delta / inner_lr, lr=slow_lr * inner_lr)
        with torch.no_grad():
            for a, b, avg in averaged:
                self.value[a:b] = avg
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
