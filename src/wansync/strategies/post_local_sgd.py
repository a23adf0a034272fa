"""Post-local SGD (spec §2 variant; Lin et al. 2020): DDP for the first `switch_step` steps,
LocalSGD after.

Steps 1 … switch_step run under PyTorch's real DDP (per-step gradient all-reduce: parameters
stay identical); from then on workers step locally and average every H (`sync_every`) steps,
counted from the switch: boundaries at t = switch_step + H, switch_step + 2H, …. `sync.model`
is the DDP wrapper while the next step is a DDP step and the plain module after, so local steps
issue no collective at all. (The wrapper's gradient sync is also switched off then, the flag
`no_sync()` toggles, so a loop that kept a reference to the wrapper still steps locally.) `switch_step = 0` is LocalSGD; `switch_step ≥ steps` is DDP.

Default `switch_step = 100`: Lin et al. switch at the first learning-rate decay, which a cosine
schedule does not have; 100 steps covers the trainer's warmup (20) and the fast early phase of the
default 300-step run. Set it explicitly for any serious comparison.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .ddp import wrap_ddp
from .local_sgd import LocalSGD
from .options import at_least, option
from .periodic import PeriodicOptions


@dataclass
class PostLocalSGDOptions(PeriodicOptions):
    """LocalSGD's (H counted after the switch), plus when to switch."""
    switch_step: int = option(100, "DDP for steps 1 ... switch_step, LocalSGD after", at_least(0))


class PostLocalSGD(LocalSGD):
    name = "post_local_sgd"
    Options = PostLocalSGDOptions

    def __init__(self, model, optimizer, options=None, *, group=None):
        super().__init__(model, optimizer, options, group=group)
        self.ddp = wrap_ddp(model, group)
        self.grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self.arm_grad_sync()

    def arm_grad_sync(self) -> None:
        """DDP's gradient all-reduce on for the next step's backward iff it is a DDP step."""
        self.ddp.require_backward_grad_sync = self.in_ddp_phase(self.t + 1)

    def in_ddp_phase(self, t: int) -> bool:
        """Is step t (1-based) a DDP step?"""
        return t <= self.opts.switch_step

    @property
    def model(self) -> nn.Module:
        return self.ddp if self.in_ddp_phase(self.t + 1) else self.module

    def is_boundary(self, t: int) -> bool:
        return not self.in_ddp_phase(t) and (t - self.opts.switch_step) % self.opts.sync_every == 0

    def after_inner_step(self) -> None:
        if self.in_ddp_phase(self.t):
            self.comm.count("grads", self.grad_bytes)     # DDP's reducer all-reduced during backward
        else:
            super().after_inner_step()                   # LocalSGD's boundary every H steps
        self.arm_grad_sync()

    def load_extra_state(self, state) -> None:
        super().load_extra_state(state)
        self.arm_grad_sync()

    def finish(self) -> None:
        if not self.in_ddp_phase(self.t):                # replicas are identical in the DDP phase
            super().finish()
