"""Post-local SGD (Lin et al. 2020, arXiv:1808.07217): DDP for the first `switch_step` steps,
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

from torch import nn

from .catalog import PostLocalSGDOptions
from .grad_sync import gradient_phase
from .local_sgd import LocalSGD
from .periodic import PeriodicTimetable


class PostLocalSGDTimetable(PeriodicTimetable):
    """DDP steps up to `switch_step`, then LocalSGD's boundaries counted from the switch."""

    def ddp_step(self, t: int) -> bool:
        return t <= self.opts.switch_step

    def is_boundary(self, t: int) -> bool:
        return not self.ddp_step(t) and (t - self.opts.switch_step) % self.opts.sync_every == 0

    def final_sync(self, t: int) -> bool:
        return not self.ddp_step(t) and super().final_sync(t)  # replicas are identical in the DDP phase


class PostLocalSGD(LocalSGD):
    name = "post_local_sgd"
    Options, Timetable = PostLocalSGDOptions, PostLocalSGDTimetable

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
        self.grad_sync = gradient_phase(model, self.group, self.comm, self.replicas)
        self.grad_sync.arm(self.timetable.ddp_step(self.t + 1))

    @property
    def model(self) -> nn.Module:
        return self.grad_sync.module if self.timetable.ddp_step(self.t + 1) else super().model

    def after_inner_step(self) -> None:
        if not self.grad_sync.book():  # a DDP step: the reducer all-reduced in backward
            super().after_inner_step()  # LocalSGD's boundary every H steps
        elif self.needs_reference and not self.timetable.ddp_step(self.t + 1):
            self.keep_reference()  # the switch: a lossy or robust exchange measures change from here
        self.grad_sync.arm(self.timetable.ddp_step(self.t + 1))

    def load_extra_state(self, state) -> None:
        super().load_extra_state(state)
        self.grad_sync.arm(self.timetable.ddp_step(self.t + 1))
