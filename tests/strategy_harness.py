"""Shared by the strategy tests: a tiny model trained on rank-dependent data in M processes.

Each rank sees different data (so replicas really drift between synchronizations); the run
returns every rank's flat parameters after each step, so tests can compare ranks and
strategies step by step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import wansync as ws


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def deep_model(seed: int = 0) -> nn.Module:
    """Six linear layers: an input end, four blocks and an output end, enough for 4 fragments."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(6, 16), nn.Tanh()]
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 3))


def rank_batch(rank: int, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + 97 * rank + step)
    x = torch.randn(8, 6, generator=g) + rank
    y = torch.randn(8, 3, generator=g)
    return x, y


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def flat_access(tensors: list[torch.Tensor]) -> tuple[Any, Any]:
    """(read, write): `tensors` as one flat vector, for a rule written out by hand."""

    def read() -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in tensors])

    def write(flat: torch.Tensor) -> None:
        with torch.no_grad():
            for t, v in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(v.view_as(t))

    return read, write


def run_strategy(
    rank: int,
    world: int,
    name: str,
    options: dict[str, Any],
    steps: int,
    optimizer: str = "sgd",
    lr: float = 0.05,
    seed: int = 0,
    lr_schedule: list[float] | None = None,
) -> dict[str, Any]:
    model = tiny_model(seed)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    elif optimizer == "sgd_momentum":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sync = ws.strategy(name, model, opt, **options)
    events: list[dict[str, Any]] = []
    sync.on_event(events.append)
    snapshots = []
    for step in range(steps):
        if lr_schedule is not None:
            for g in opt.param_groups:
                g["lr"] = lr_schedule[step]
        x, y = rank_batch(rank, step, seed)
        loss = nn.functional.mse_loss(sync.model(x), y)
        loss.backward()
        sync.step()
        sync.zero_grad()
        snapshots.append(flat_params(model))
    return {
        "params": snapshots,
        "events": events,
        "comm": sync.comm.snapshot(),
        "state": {k: v for k, v in sync.state_dict().items() if k in ("t",)},
    }
