"""Rank functions for the periodic-strategy tests (SlowMo, CPDP, DiLoCo, post-local SGD).

Spawning a process group is the slow part of a multi-process test, so one group runs a list of
scenarios one after the other (`run_scenarios`) and returns, per scenario and per step, every
rank's parameters, inner-optimizer state, ledger snapshot, and the collectives actually issued:
a wiretap on `torch.distributed`'s Python collectives (our own, and DDP's gradient all-reduce,
which goes through the counting comm hook registered on `sync.model`).
"""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import wansync as ws
from strategy_harness import flat_params, rank_batch, tiny_model

_TAPPED = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)
WIRE: list[tuple[str, int]] = []  # (collective, bytes) issued through torch.distributed


def install_wiretap() -> None:
    """Count every Python-level collective (our ledger's and DDP's comm hook's) in WIRE."""
    if getattr(dist, "_wansync_tapped", False):
        return
    for fname in _TAPPED:
        real = getattr(dist, fname)

        def tapped(*args, _real=real, _name=fname, **kw):
            t = args[0] if args and torch.is_tensor(args[0]) else None
            WIRE.append((_name, t.numel() * t.element_size() if t is not None else 0))
            return _real(*args, **kw)

        setattr(dist, fname, tapped)
    dist._wansync_tapped = True


class HookCounts:
    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0


def counting_hook(state, bucket):  # no annotations: DDP checks them, and this module's are strings
    """torch's default DDP all-reduce, counted."""
    state.calls += 1
    state.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(None, bucket)


class Scalar(nn.Module):
    """One float64 parameter w; rank r's loss at step s is ½(w − c)², c = r + 1 + s/10."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.5], dtype=torch.float64))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((self.w - c) ** 2).sum()


def scalar_target(rank: int, step: int) -> float:
    return rank + 1 + step / 10


def optim_state_flat(opt: torch.optim.Optimizer) -> torch.Tensor:
    ts = [
        v.detach().reshape(-1).double()
        for st in opt.state.values()
        for v in st.values()
        if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0
    ]
    return torch.cat(ts) if ts else torch.zeros(0)


def build(name: str, options: dict[str, Any], kind: str, optimizer: str, lr: float, seed: int):
    model = Scalar() if kind == "scalar" else tiny_model(seed)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    elif optimizer == "sgd_momentum":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, opt, ws.strategy(name, model, opt, **options)


def train(rank: int, model, opt, sync, start: int, stop: int, kind: str, lr_schedule, hook, out) -> None:
    for step in range(start, stop):
        if lr_schedule is not None:
            for g in opt.param_groups:
                g["lr"] = lr_schedule[step]
        wire0 = len(WIRE)
        if kind == "scalar":
            loss = sync.model(torch.tensor([scalar_target(rank, step)], dtype=torch.float64))
        else:
            x, y = rank_batch(rank, step)
            loss = nn.functional.mse_loss(sync.model(x), y)
        loss.backward()
        sync.step()
        sync.zero_grad()
        out["params"].append(flat_params(model))
        out["optim"].append(optim_state_flat(opt))
        out["comm"].append(sync.comm.snapshot())
        out["wire"].append(list(WIRE[wire0:]))
        out["hook"].append((hook.calls, hook.bytes) if hook is not None else None)


def scenario(
    rank: int,
    name: str,
    options: dict[str, Any],
    steps: int,
    *,
    optimizer: str = "sgd",
    lr: float = 0.05,
    lr_schedule: list[float] | None = None,
    kind: str = "tiny",
    hook: bool = False,
    resume_at: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    model, opt, sync = build(name, options, kind, optimizer, lr, seed)
    counts = None
    if hook:
        counts = HookCounts()
        sync.model.register_comm_hook(counts, counting_hook)
    events: list[dict[str, Any]] = []
    sync.on_event(events.append)
    out: dict[str, Any] = {
        "params": [],
        "optim": [],
        "comm": [],
        "wire": [],
        "hook": [],
        "events": events,
        "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "flat_bytes": sync.flat.nbytes if hasattr(sync, "flat") else None,
        "comm0": sync.comm.snapshot(),
    }
    stop = steps if resume_at is None else resume_at
    train(rank, model, opt, sync, 0, stop, kind, lr_schedule, counts, out)
    if resume_at is not None:
        # save (as a checkpoint would: serialized), then a fresh model, optimizer and strategy
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sync": sync.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
        out["saved_keys"] = sorted(saved["sync"])
        del model, opt, sync
        model, opt, sync = build(name, options, kind, optimizer, lr, seed + 1)  # another init
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        sync.load_state_dict(saved["sync"])
        sync.on_event(events.append)
        train(rank, model, opt, sync, resume_at, steps, kind, lr_schedule, None, out)
    sync.finish()
    out["final"] = flat_params(model)
    out["state_t"] = sync.state_dict()["t"]
    return out


def run_scenarios(rank: int, world: int, scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Run every scenario (name -> kwargs of `scenario`) in this process group, in order."""
    install_wiretap()
    results = {}
    for key, kw in scenarios.items():
        kw = copy.deepcopy(kw)
        results[key] = scenario(rank, kw.pop("name"), kw.pop("options"), kw.pop("steps"), **kw)
        dist.barrier()
    return results
