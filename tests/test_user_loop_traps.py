"""The traps a user's own loop fell into, removed (issue 34): an inner learning rate of 0 at a
SlowMo/CPDP boundary, gradient accumulation and what the ledger books for it, restoring state
before or after `ws.strategy()`, frozen parameters, and communication counters across a resume.

Every check runs in one spawned 2-rank gloo group (`_traps`, tiny models); the tests read its
results.
"""

from __future__ import annotations

import contextlib
import io
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import wansync as ws
from strategy_harness import flat_params, rank_batch, tiny_model
from wansync.runner.localgroup import run_ranks

ACCUMULATE = 4
RESTORED = {"diloco": {"sync_every": 4, "outer_lr": 0.7}, "cpdp": {"sync_every": 4}}


def _train(sync: Any, rank: int, start: int, stop: int, schedule: Any = None) -> None:
    for step in range(start, stop):
        x, y = rank_batch(rank, step)
        nn.functional.mse_loss(sync.model(x), y).backward()
        sync.step()
        sync.zero_grad()
        if schedule is not None:
            schedule.step()


# ---- an inner learning rate of 0 at a boundary ---------------------------------------------------
def _lr_zero(rank: int) -> dict[str, Any]:
    """HF-style schedules through torch's LambdaLR, stepped after `sync.step()` as HF's loops do:
    a cosine that reaches 0 at the last step (read by `finish()`), and a warmup from 0 (the first
    step's learning rate is 0) with a boundary at every step."""
    total = 10
    schedules = {
        "cosine": (4, lambda k: 0.5 * (1 + math.cos(math.pi * min(k, total) / total))),
        "warmup": (1, lambda k: min(1.0, k / 4)),
    }
    out = {}
    for name in ("slowmo", "cpdp"):
        for kind, (every, lam) in schedules.items():
            model = tiny_model(0)
            start = flat_params(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lam)
            sync = ws.strategy(name, model, opt, sync_every=every)
            events: list[dict[str, Any]] = []
            sync.on_event(events.append)
            _train(sync, rank, 0, 1, schedule)
            after_first = flat_params(model)
            _train(sync, rank, 1, total, schedule)
            before_finish = flat_params(model)
            sync.finish()
            out[f"{name}/{kind}"] = {
                "start": start,
                "after_first": after_first,
                "before_finish": before_finish,
                "final": flat_params(model),
                "lrs": [(e["step"], e["inner_lr"]) for e in events if e["type"] == "sync"],
            }
    return out


# ---- gradient accumulation under the emulated link -----------------------------------------------
def _accumulation(rank: int) -> dict[str, Any]:
    from wansync import net

    emulator = net.Emulator(net.parse_wan("lan"))
    group = dist.new_group([0, 1], backend=net.install(), pg_options=emulator)
    out = {}
    for name, options in (("ddp", {}), ("cpdp", {"sync_every": 2}), ("local_sgd", {"sync_every": 2})):
        for paused in (False, True):
            model = tiny_model(0)
            sync = ws.strategy(name, model, torch.optim.SGD(model.parameters(), lr=0.05), group=group, **options)
            cursor = emulator.record_count()  # after the construction's broadcasts
            for step in range(4):
                batches = [rank_batch(rank, ACCUMULATE * step + i) for i in range(ACCUMULATE)]
                with sync.no_sync() if paused else contextlib.nullcontext():
                    for x, y in batches[:-1]:
                        (nn.functional.mse_loss(sync.model(x), y) / ACCUMULATE).backward()
                x, y = batches[-1]
                (nn.functional.mse_loss(sync.model(x), y) / ACCUMULATE).backward()
                sync.step()
                sync.zero_grad()
            sync.finish()
            records = [r for r in emulator.records_since(cursor) if r.op == "allreduce"]
            out[f"{name}/{'no_sync' if paused else 'plain'}"] = {
                "link": sum(r.nbytes for r in records),
                "ledger": sync.comm.snapshot(),
                "trainable": sum(p.numel() * p.element_size() for p in model.parameters()),
            }
    return out


# ---- restore before or after construction; counters across the resume -----------------------------
def _restore(rank: int) -> dict[str, Any]:
    out = {}
    for name, options in RESTORED.items():
        model = tiny_model(0)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sync = ws.strategy(name, model, opt, **options)
        _train(sync, rank, 0, 6)  # step 6: between two boundaries
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "strategy": sync.state_dict()}, buf)
        saved_at = flat_params(model)
        _train(sync, rank, 6, 16)
        runs = {"straight": (flat_params(model), sync.comm.snapshot())}
        for order in ("after", "before"):
            ckpt = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
            fresh = tiny_model(1 + rank)  # each rank a different fresh start
            opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
            if order == "before":
                fresh.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["optimizer"])
            resumed = ws.strategy(name, fresh, opt, **options)
            if order == "after":
                fresh.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["optimizer"])
            resumed.load_state_dict(ckpt["strategy"])
            _train(resumed, rank, 6, 16)
            runs[order] = (flat_params(fresh), resumed.comm.snapshot())
        out[name] = {"saved_at": saved_at, **runs}
    return out


# ---- fine-tuning: a frozen base -------------------------------------------------------------------
class FrozenBase(nn.Module):
    """A base (input layer, BatchNorm, two middle layers) frozen but for the middle's first layer,
    three trainable layers on top; BatchNorm's running statistics are buffers every strategy averages."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm = nn.Linear(6, 32), nn.BatchNorm1d(32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.head = nn.Linear(32, 3)
        for module in (self.inp, self.norm, self.blocks[1], self.blocks[3]):
            module.requires_grad_(False)

    def stages(self) -> list[nn.Module]:
        return [self.norm, *self.blocks, self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def _frozen(rank: int) -> dict[str, Any]:
    cases = {
        "diloco": {"sync_every": 2},
        "slowmo": {"sync_every": 2},
        "local_sgd": {"sync_every": 2, "sync_optimizer_state": True},
        "streaming": {"sync_every": 4, "fragments": 2, "overlap": 1},
        "cocodc": {"sync_every": 4, "fragments": 2, "overlap": 1, "syncs_per_period": 2},
        "ddp": {},
    }
    out = {}
    for name, options in cases.items():
        model = FrozenBase()
        frozen_before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters() if not p.requires_grad])
        sync = ws.strategy(
            name, model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01), **options
        )
        events: list[dict[str, Any]] = []
        sync.on_event(events.append)
        _train(sync, rank, 0, 8)
        sync.finish()
        out[name] = {
            "events": [e for e in events if e["type"] == "sync"],
            "ledger": sync.comm.snapshot(),
            "trainable": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
            "frozen": sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad),
            "buffers": sum(b.numel() * b.element_size() for b in model.buffers() if b.is_floating_point()),
            "frozen_before": frozen_before,
            "frozen_after": torch.cat([p.detach().reshape(-1) for p in model.parameters() if not p.requires_grad]),
            "params": flat_params(model),
        }
    return out


# ---- the inner optimizer stepped around the strategy ------------------------------------------------
def _outside(rank: int) -> dict[str, Any]:
    """fp16's loss scaler and a loop's own `optimizer.step()` step the inner optimizer around
    `sync.step()`; one line each, the parameters as they were. A strategy built again on the same
    optimizer takes its guard over: its own steps pass."""
    from wansync.errors import ConfigError

    out: dict[str, Any] = {}
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = ws.strategy("diloco", model, opt, sync_every=2)
    scaler = torch.amp.GradScaler("cpu")
    for name, step in {"scaler": lambda: scaler.step(opt), "loop": opt.step}.items():
        x, y = rank_batch(rank, 0)
        before = flat_params(model).clone()
        (
            scaler.scale(nn.functional.mse_loss(sync.model(x), y))
            if name == "scaler"
            else nn.functional.mse_loss(sync.model(x), y)
        ).backward()
        try:
            step()
            out[name] = "stepped"
        except ConfigError as e:
            out[name] = str(e)
        out[name + "/unchanged"] = torch.equal(before, flat_params(model))
        sync.zero_grad()
    for group in opt.param_groups:  # a step at lr 0 moves nothing: torch's checkpoint helpers take one
        group["lr"] = 0.0
    opt.step()
    for group in opt.param_groups:
        group["lr"] = 0.1
    again = ws.strategy("diloco", model, opt, sync_every=2)
    _train(again, rank, 0, 4)
    out["again"] = again.t
    return out


def _sparse_regime(rank: int) -> list[str]:
    """ws.Run(steps=40) around SparseLoCo at its defaults: the guard that needs the run's length, in
    Python's words, on rank 0 (ws.strategy cannot know the length and says nothing of it)."""
    import warnings

    from wansync.strategies.guards import RegimeWarning

    model = tiny_model(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sync = ws.strategy("sparseloco", model, torch.optim.SGD(model.parameters(), lr=0.1))
        built = len(caught)
        run = ws.Run(sync, steps=40, quiet=True)
        run.close()
    return [str(w.message) for w in caught[built:] if issubclass(w.category, RegimeWarning)] + [f"built:{built}"]


def _traps(rank: int, world: int) -> dict[str, Any]:
    return {
        "lr_zero": _lr_zero(rank),
        "accumulation": _accumulation(rank),
        "restore": _restore(rank),
        "frozen": _frozen(rank),
        "outside": _outside(rank),
        "sparse": _sparse_regime(rank),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_traps, 2, timeout=120)


# ---- the tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["slowmo", "cpdp"])
def test_a_cosine_schedule_to_zero_finishes_with_the_filters_limit_the_plain_average(ranks, name):
    r0, r1 = (r["lr_zero"][f"{name}/cosine"] for r in ranks)
    assert r0["lrs"][-1] == (10, 0.0)  # finish() read the schedule's 0
    assert torch.equal(r0["final"], r1["final"]) and torch.isfinite(r0["final"]).all()
    # η → 0 with α = 1: θ̃ ← θ̄, the workers' plain average
    assert torch.allclose(r0["final"], (r0["before_finish"] + r1["before_finish"]) / 2, rtol=0, atol=1e-7)
    assert not torch.equal(r0["before_finish"], r1["before_finish"])


@pytest.mark.parametrize("name", ["slowmo", "cpdp"])
def test_a_warmup_from_zero_finishes_and_its_first_boundary_moves_nothing(ranks, name):
    r0, r1 = (r["lr_zero"][f"{name}/warmup"] for r in ranks)
    assert r0["lrs"][0] == (1, 0.0) and all(lr > 0 for _, lr in r0["lrs"][1:])
    assert torch.equal(r0["after_first"], r0["start"]) and torch.equal(r1["after_first"], r1["start"])
    assert torch.equal(r0["final"], r1["final"]) and torch.isfinite(r0["final"]).all()
    assert not torch.equal(r0["final"], r0["start"])  # the later boundaries trained


@pytest.mark.parametrize("name", ["ddp", "cpdp", "local_sgd"])
def test_accumulation_the_ledger_books_what_the_emulated_link_carried(ranks, name):
    """x4 accumulation under wan=lan, with and without `sync.no_sync()`: every all-reduce on the
    link is on the ledger (gradients, parameters, the drift side band) within 1 %."""
    for rank in ranks:
        plain, paused = rank["accumulation"][f"{name}/plain"], rank["accumulation"][f"{name}/no_sync"]
        for run in (plain, paused):
            booked = sum(run["ledger"].get(k, {}).get("bytes", 0) for k in ("grads", "params", "telemetry"))
            assert booked == pytest.approx(run["link"], rel=0.01)
        grads = [run["ledger"].get("grads", {"bytes": 0, "calls": 0}) for run in (plain, paused)]
        if name == "local_sgd":  # a plain module: no_sync() is a no-op, no gradient traffic
            assert grads == [{"bytes": 0, "calls": 0}] * 2 and plain["link"] == paused["link"] > 0
            continue
        synced_steps = {"ddp": 4, "cpdp": 2}[name]
        assert grads[1]["calls"] == synced_steps and grads[1]["bytes"] == synced_steps * paused["trainable"]
        assert grads[0]["calls"] == ACCUMULATE * synced_steps and grads[0]["bytes"] == ACCUMULATE * grads[1]["bytes"]


@pytest.mark.parametrize("name", list(RESTORED))
def test_restoring_before_or_after_building_the_strategy_gives_bitwise_the_same_run(ranks, name):
    r0, r1 = (r["restore"][name] for r in ranks)
    assert not torch.equal(r0["saved_at"], r1["saved_at"])  # mid-period: the broadcast had something to overwrite
    for r in (r0, r1):
        assert torch.equal(r["before"][0], r["after"][0])
        assert torch.equal(r["after"][0], r["straight"][0])


@pytest.mark.parametrize("name", list(RESTORED))
def test_comm_counters_continue_across_a_resume_through_the_strategy_state_alone(ranks, name):
    for rank in ranks:
        straight = {k: (v["calls"], v["bytes"], v["sent"]) for k, v in rank["restore"][name]["straight"][1].items()}
        assert straight["params"][0] == 4  # boundaries 4, 8, 12, 16: the first before the save
        for order in ("before", "after"):
            resumed = {k: (v["calls"], v["bytes"], v["sent"]) for k, v in rank["restore"][name][order][1].items()}
            assert resumed == straight


@pytest.mark.parametrize("name", ["diloco", "slowmo", "local_sgd", "streaming", "cocodc", "ddp"])
def test_a_frozen_base_is_not_exchanged_bytes_per_sync_are_the_trainable_parameters_and_buffers(ranks, name):
    r0, r1 = (r["frozen"][name] for r in ranks)
    trainable, buffers = r0["trainable"], r0["buffers"]
    assert r0["frozen"] > trainable and buffers > 0  # a base bigger than what is trained
    ledger, events = r0["ledger"], r0["events"]
    if name == "ddp":
        assert ledger["grads"]["bytes"] == 8 * trainable
    elif name in ("streaming", "cocodc"):
        per_fragment = {e["fragment"]: e["payload_bytes"] for e in events}
        assert len(per_fragment) == 2 and sum(per_fragment.values()) == trainable + buffers
        assert ledger["pseudo_grads"]["bytes"] == sum(e["payload_bytes"] for e in events)
    else:
        assert events and all(e["bytes"] == trainable + buffers for e in events)
        assert ledger["params"]["bytes"] == len(events) * (trainable + buffers)
        if name == "local_sgd":  # AdamW's two moments of the trainable ones
            assert ledger["optim_state"]["bytes"] == len(events) * 2 * trainable
    assert torch.equal(r0["frozen_after"], r0["frozen_before"]) and torch.equal(r1["frozen_after"], r0["frozen_after"])
    assert torch.equal(r0["params"], r1["params"])  # the trainable ones synchronized at the end


def _handed(rank: int, world: int) -> list[str]:
    """ws.strategy given what cannot work: each a one-line ConfigError naming the rule."""
    import torch
    import wansync as ws
    from wansync.errors import ConfigError

    model, other = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    said = []
    for args in [
        (model, "adamw"),
        (model, None),
        ("a model", torch.optim.SGD(model.parameters(), lr=0.1)),
        (model, torch.optim.SGD(other.parameters(), lr=0.1)),
        (model, torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.ones(1))], lr=0.1)),
    ]:
        try:
            ws.strategy("diloco", *args)
            said.append("accepted")
        except ConfigError as e:
            said.append(str(e))
    return said


def test_an_inner_optimizer_stepped_outside_the_strategy_is_one_line_and_changes_nothing(ranks):
    for rank in ranks:
        out = rank["outside"]
        for name in ("scaler", "loop"):
            assert out[name].startswith("diloco: the inner optimizer was stepped outside sync.step()"), out[name]
            assert "\n" not in out[name] and out[name + "/unchanged"]
        assert out["again"] == 4  # the newest strategy on the optimizer steps it


def test_a_run_too_short_for_a_sparse_exchange_is_warned_about_once_in_pythons_words(ranks):
    [line, built] = ranks[0]["sparse"]
    assert built == "built:0" and line.startswith("sparseloco: density 0.00781 over the 1 round(s) of this 40-step run")
    assert "--" not in line and "raise density to" in line
    assert ranks[1]["sparse"] == ["built:0"]  # rank 0's line only


def test_the_api_refuses_a_model_or_optimizer_that_cannot_work():
    said = run_ranks(_handed, 1)[0]
    assert "the optimizer must be a torch.optim.Optimizer" in said[0] and "'adamw'" in said[0]
    assert "the optimizer must be a torch.optim.Optimizer" in said[1]
    assert "the model must be a torch.nn.Module, got str" in said[2]
    assert "holds 2 tensor(s) that are not this model's parameters" in said[3]
    assert "holds 1 tensor(s) that are not this model's parameters" in said[4]
    assert all("\n" not in s for s in said)
