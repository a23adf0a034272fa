"""LocalSGD is torch's `PeriodicModelAverager`, bit for bit: on 3 gloo ranks (where the order of
dividing and summing shows in the last bit) both divide each worker's parameters by M and then sum
them, and the drift telemetry riding on the exchange changes no bit."""

from __future__ import annotations

import warnings

import pytest
import torch

from wansync.runner.localgroup import run_ranks

pytestmark = pytest.mark.timeout(120)

H, STEPS = 2, 6


def _trained(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    import wansync as ws
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    out = {}
    for kind in ("torch", "drift off", "drift on"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Tanh(), torch.nn.Linear(300, 7))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if kind == "torch":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                averager = PeriodicModelAverager(period=H, warmup_steps=1)  # averages after steps 2, 4, 6
        else:
            sync = ws.strategy("local_sgd", model, opt, sync_every=H, drift_telemetry=kind == "drift on")
        gen = torch.Generator().manual_seed(rank + 1)
        for _ in range(STEPS):
            (model(torch.randn(16, 64, generator=gen)).pow(2).mean() * (rank + 1)).backward()
            if kind == "torch":
                opt.step()
                averager.average_parameters(model.parameters())
                opt.zero_grad()
            else:
                sync.step()
                sync.zero_grad()
        out[kind] = [p.detach().clone() for p in model.parameters()]
    return out


def test_local_sgd_matches_torchs_periodic_model_averager_bit_for_bit_on_three_ranks():
    results = run_ranks(_trained, 3)
    for r in results:
        for kind in ("drift off", "drift on"):
            assert all(torch.equal(a, b) for a, b in zip(r["torch"], r[kind], strict=True)), kind
    assert all(torch.equal(a, b) for a, b in zip(results[0]["drift on"], results[2]["drift on"]))
