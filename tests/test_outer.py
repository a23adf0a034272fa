"""The shared anchor + outer optimizer (strategies/outer.py)."""

from __future__ import annotations

import pytest
import torch

from wansync.errors import NonFiniteError
from wansync.strategies.outer import BLOCK, Anchor, block_for


def test_outer_step_is_torch_sgd_on_parameters():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    a = Anchor([p], lr=0.7, momentum=0.9, nesterov=True)
    ref = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for g in (torch.tensor([0.1, 0.2]), torch.tensor([-0.3, 0.05])):
        a.outer_step(g.clone())  # the outer step overwrites its Δ̄
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


@pytest.mark.parametrize("momentum,nesterov,divide", [(0.9, True, None), (0.9, False, 0.01), (0.0, False, None)])
def test_a_step_from_the_average_loaded_into_the_model_is_torch_sgd_on_the_pseudo_gradient(momentum, nesterov, divide):
    """`step_to_average` / `slowmo_step` form Δ̄ = θ̃ − θ̄ (over η for SlowMo) block by block, step
    and write θ̃ into the model in the same pass: the bits of torch's SGD on the separately formed
    pseudo-gradient, over several blocks and a ragged tail, with the model (which here holds θ̄,
    as after a boundary) left holding θ̃ and a buffer left holding θ̄ exactly."""
    gen = torch.Generator().manual_seed(1)
    n = 3 * BLOCK + 12_345
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(n, generator=gen))
    model.register_buffer("running", torch.rand(7, generator=gen))
    flat = torch.cat([model.w.detach(), model.running])  # the model moved into one flat buffer
    model.w.data, model.running.data = flat[:n], flat[n:]
    a = Anchor([model.w, model.running], lr=0.7, momentum=momentum, nesterov=nesterov)
    ref = torch.nn.Parameter(a.value[:n].clone())
    opt = torch.optim.SGD([ref], lr=0.7 if divide is None else 0.5 * divide, momentum=momentum, nesterov=nesterov)
    for step in range(3):
        avg = a.value + torch.randn(n + 7, generator=gen) * 1e-2
        flat.copy_(avg)  # the model holds θ̄ after the exchange
        ref.grad = a.value[:n] - avg[:n] if divide is None else (a.value[:n] - avg[:n]) / divide
        opt.step()
        if divide is None:
            a.step_to_average(flat, load=True)
        else:
            a.slowmo_step(flat, divide, 0.5, load=True)
        assert torch.equal(a.value[:n], ref.detach()), step
        assert torch.equal(model.w.detach(), a.value[:n]) and model.w.data_ptr() == flat.data_ptr()
        assert torch.equal(model.running, avg[n:]) and torch.equal(a.value[n:], avg[n:])


def test_the_pseudo_gradient_is_one_pass_over_the_tensors_where_they_lie():
    """Δ_m = θ̃ − θ_m the same bits whether the tensors are separate (one a transposed view),
    packed in one buffer, or gathered by the caller first."""
    gen = torch.Generator().manual_seed(2)
    w, b = torch.nn.Parameter(torch.randn(5, 7, generator=gen)), torch.nn.Parameter(torch.randn(3, generator=gen))
    a = Anchor([w, b], lr=0.7, momentum=0.9)
    with torch.no_grad():
        w.data = torch.randn(7, 5, generator=gen).t()  # non-contiguous
        b.add_(1.0)
    expected = a.value - torch.cat([w.detach().reshape(-1), b.detach()])
    assert torch.equal(a.pseudo_gradient(), expected)
    assert torch.equal(a.pseudo_gradient(a.local()), expected)
    flat = torch.cat([w.detach().reshape(-1), b.detach()])
    w.data, b.data = flat[:35].view(5, 7), flat[35:]  # packed
    assert a.flat.packed() is not None and torch.equal(a.pseudo_gradient(), expected)


def test_the_step_is_blocked_on_cpu_only():
    """On an accelerator a launch per op and block would cost more than the cache it saves."""
    assert block_for(torch.empty(10 * BLOCK)) == BLOCK
    assert block_for(torch.empty(10 * BLOCK, device="meta")) == 10 * BLOCK


def test_an_outer_step_that_overflows_raises_non_finite():
    a = Anchor([torch.nn.Parameter(torch.full((BLOCK + 5,), 3e38))], lr=1.0, momentum=0.0)
    with pytest.raises(NonFiniteError, match="non-finite"):
        a.outer_step(torch.full((BLOCK + 5,), -3e38))


def test_buffers_get_the_plain_average_never_momentum_or_slowmo_scaling():
    """A running variance filtered through momentum and 1/η overshoots below zero (found on a
    CNN under warmup); buffers must take θ̄ exactly."""
    lin, bn = torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(3)
    a = Anchor([*lin.parameters(), bn.running_var], lr=1.0, momentum=0.9)
    for eta, avg_var in ((0.001, 0.9), (0.1, 0.2), (0.01, 0.05)):
        target = a.value.clone()
        target[-3:] = avg_var
        a.slowmo_step(target, eta, 1.0)
        assert torch.allclose(a.value[-3:], torch.full((3,), avg_var))
    assert bool((a.value[-3:] > 0).all())
