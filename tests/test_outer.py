"""The shared anchor + outer optimizer (strategies/outer.py)."""
from __future__ import annotations

import pytest
import torch

from wansync.strategies.outer import Anchor


def test_outer_step_is_torch_sgd_on_parameters():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    a = Anchor([p], lr=0.7, momentum=0.9, nesterov=True)
    ref = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for g in (torch.tensor([0.1, 0.2]), torch.tensor([-0.3, 0.05])):
        a.outer_step(g.clone())                      # the outer step overwrites its Δ̄
        ref.grad = g
        opt.step()
    assert torch.equal(a.value, ref.detach())


@pytest.mark.parametrize("momentum,nesterov", [(0.9, True), (0.9, False), (0.0, False)])
def test_the_in_place_outer_step_is_torch_sgd_bit_for_bit_and_keeps_its_state_format(momentum, nesterov):
    """Δ̄ overwritten in place instead of torch's temporary: the same bits, step after step, across
    a learning-rate change, on a length that is not a multiple of any vector width; and the
    momentum in torch's state_dict, so torch's SGD takes over where the anchor stopped."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(100_003, generator=gen)
    a = Anchor([torch.nn.Parameter(start.clone())], lr=0.7, momentum=momentum, nesterov=nesterov)
    ref = torch.nn.Parameter(start.clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=momentum, nesterov=nesterov)
    for step in range(6):
        g = torch.randn(100_003, generator=gen) * 1e-2
        lr = 0.7 if step < 3 else 0.35
        a.outer_step(g.clone(), lr=lr)
        opt.param_groups[0]["lr"] = lr
        ref.grad = g
        opt.step()
        assert torch.equal(a.value, ref.detach()), step
    state = a.state_dict()["optimizer"]
    assert state["param_groups"] == opt.state_dict()["param_groups"]
    if momentum:
        assert torch.equal(state["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"])
    follower = torch.nn.Parameter(a.value.clone())
    follower_opt = torch.optim.SGD([follower], lr=0.35, momentum=momentum, nesterov=nesterov)
    follower_opt.load_state_dict(state)
    g = torch.randn(100_003, generator=gen)
    for param, o in ((follower, follower_opt), (ref, opt)):
        param.grad = g
        o.step()
    assert torch.equal(follower.detach(), ref.detach())


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
