"""The shared anchor + outer optimizer (strategies/outer.py)."""
from __future__ import annotations

import torch

from wansync.strategies.outer import Anchor


def test_outer_step_is_torch_sgd_on_parameters():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    a = Anchor([p], lr=0.7, momentum=0.9, nesterov=True)
    ref = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for g in (torch.tensor([0.1, 0.2]), torch.tensor([-0.3, 0.05])):
        a.outer_step(g)
        ref.grad = g
        opt.step()
    assert torch.equal(a.value, ref.detach())


def test_buffers_get_the_plain_average_never_momentum_or_slowmo_scaling():
    """A running variance filtered through momentum and 1/η overshoots below zero (found on a
    CNN under warmup); buffers must take θ̄ exactly."""
    lin, bn = torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(3)
    a = Anchor([*lin.parameters(), bn.running_var], lr=1.0, momentum=0.9)
    for eta, avg_var in ((0.001, 0.9), (0.1, 0.2), (0.01, 0.05)):
        target = a.value.clone()
        target[-3:] = avg_var
        delta = a.value - target                     # Δ̄ = θ̃ − θ̄ on the buffer part
        a.slowmo_step(delta, eta, 1.0)
        assert torch.allclose(a.value[-3:], torch.full((3,), avg_var))
    assert bool((a.value[-3:] > 0).all())
