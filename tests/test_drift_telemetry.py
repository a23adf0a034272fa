"""Drift telemetry rides on the parameter exchange: on a real 2-rank gloo group, the drift each
boundary reports equals the drift computed with separate all-reduces in float64, and turning the
telemetry on adds no collective and no buffer."""

from __future__ import annotations

from typing import Any

import math

import pytest
import torch
import torch.distributed as dist

from wansync.runner.localgroup import run_ranks

pytestmark = pytest.mark.timeout(120)

H, STEPS, LR = 2, 7, 0.1


def _model(rank: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _reference_drift(theta_m: torch.Tensor) -> float:
    """sqrt(mean_m ‖θ_m − θ̄‖²) / ‖θ̄‖ in float64, with collectives of its own."""
    theta_m = theta_m.double()
    avg = theta_m.clone()
    dist.all_reduce(avg)
    avg /= dist.get_world_size()
    d = (theta_m - avg).square().sum().reshape(1)
    dist.all_reduce(d)
    return math.sqrt(float(d[0]) / dist.get_world_size()) / float(torch.linalg.vector_norm(avg))


def _wide(rank: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 512), torch.nn.Tanh(), torch.nn.Linear(512, 128), torch.nn.Linear(128, 1)
    )


def _train(rank: int, name: str, drift: bool, wide: bool = False) -> dict[str, Any]:
    import wansync as ws

    model = _wide(rank) if wide else _model(rank)
    lr = 1e-3 if wide else LR
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sync = ws.strategy(
        name,
        model,
        opt,
        sync_every=H,
        drift_telemetry=drift,
        **({"outer_lr": 0.7, "outer_momentum": 0.9} if name == "diloco" else {}),
    )
    records: list[dict[str, Any]] = []
    sync.on_event(records.append)
    gen = torch.Generator().manual_seed(rank + 1)
    reference = []
    for t in range(1, STEPS + 1):
        x = torch.randn(16, 8, generator=gen)
        loss = (sync.model(x) - x.sum(1, keepdim=True) * (rank + 1)).pow(2).mean()
        loss.backward()
        if t % H == 0 or t == STEPS:  # a boundary (or finish's), after this inner step
            theta_m = torch.cat([p.detach().reshape(-1) - lr * p.grad.reshape(-1) for p in model.parameters()])
            reference.append(_reference_drift(theta_m))
        sync.step()
        sync.zero_grad()
    before_finish = sync.comm.snapshot()
    sync.finish()
    return {
        "records": records,
        "reference": reference,
        "before_finish": before_finish,
        "after_finish": sync.comm.snapshot(),
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _both(rank: int, world: int) -> dict[str, Any]:
    runs = {(name, drift): _train(rank, name, drift) for name in ("local_sgd", "diloco") for drift in (True, False)}
    return {**runs, "wide": _train(rank, "local_sgd", True, wide=True)}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(_both, 2)


def _calls(snapshot: dict[str, dict[str, Any]]) -> int:
    return sum(v["calls"] for v in snapshot.values())


@pytest.mark.parametrize("name", ["local_sgd", "diloco"])
def test_piggybacked_drift_equals_a_separate_all_reduce(runs, name):
    for r in runs:
        run = r[(name, True)]
        reported = [e["drift"] for e in run["records"] if e["type"] == "sync"]
        assert len(reported) == len(run["reference"]) == 4  # t = 2, 4, 6 and finish's 7
        assert reported == pytest.approx(run["reference"], rel=1e-6)
        assert all(0 < d < 1 for d in reported)


def test_a_small_drift_on_a_wider_model_is_measured_to_its_float64_value(runs):
    """At drift ~5e-4 the parallel-axis identity subtracts two norms equal to ~3e-7 of theirs, on a
    model whose norm is mostly 4096 first-layer weights: the drift still matches the float64
    reference to 1 % (the float32 rounding of θ̄ itself is the limit: 0.4 % here; summed in float32
    rows without re-summing the largest in float64, the norms put it 15 % off)."""
    for r in runs:
        run = r["wide"]
        reported = [e["drift"] for e in run["records"] if e["type"] == "sync"]
        assert all(1e-5 < d < 1e-2 for d in run["reference"]), run["reference"]
        assert reported == pytest.approx(run["reference"], rel=1e-2)


@pytest.mark.parametrize("name", ["local_sgd", "diloco"])
def test_telemetry_adds_no_collective_and_one_element_per_boundary(runs, name):
    for r in runs:
        on, off = r[(name, True)], r[(name, False)]
        for snap in ("before_finish", "after_finish"):
            assert _calls(on[snap]) == _calls(off[snap])
            for key in ("calls", "bytes"):
                assert on[snap]["params"][key] == off[snap]["params"][key]
        telemetry = on["after_finish"]["telemetry"]
        assert (telemetry["calls"], telemetry["bytes"], telemetry["waited_s"]) == (0, 4 * 4, 0.0)  # 4 B a boundary
        assert "telemetry" not in off["after_finish"] or off["after_finish"]["telemetry"]["bytes"] == 0
        assert all("drift" not in e for e in off["records"])


@pytest.mark.parametrize("name", ["local_sgd", "diloco"])
def test_telemetry_changes_no_parameter_bit(runs, name):
    for r in runs:
        for a, b in zip(r[(name, True)]["params"], r[(name, False)]["params"], strict=True):
            assert torch.equal(a, b)


def _storages_across_boundaries(rank: int, world: int) -> dict[str, Any]:
    """Where the model's tensors live, boundary after boundary."""
    import wansync as ws

    out: dict[str, Any] = {}
    for name, drift in (("local_sgd", True), ("local_sgd", False), ("diloco", True)):
        model = _model(rank)
        sync = ws.strategy(name, model, torch.optim.SGD(model.parameters(), lr=LR), sync_every=1, drift_telemetry=drift)
        seen = []
        for _ in range(4):
            model(torch.randn(4, 8)).sum().backward()
            sync.step()
            sync.zero_grad()
            packed = sync.flat.packed()
            seen.append(
                (packed is not None and packed.data_ptr(), packed is not None and packed.untyped_storage().nbytes())
            )
        out[(name, drift)] = seen
    return out


def test_a_boundary_averages_in_the_models_own_buffer_without_fresh_memory():
    """From the first boundary on, the model lives in one flat buffer (its values, and with drift
    telemetry one more element) that every boundary all-reduces in place: no second buffer."""
    seen = run_ranks(_storages_across_boundaries, 2)[0]
    numel = sum(p.numel() for p in _model(0).parameters())
    for (name, drift), boundaries in seen.items():
        assert len({ptr for ptr, _ in boundaries}) == 1 and boundaries[0][0], (name, drift)
        assert {nbytes for _, nbytes in boundaries} == {4 * (numel + drift)}, (name, drift)


def _channels_last_local_sgd(rank: int, world: int) -> dict[str, Any]:
    """A model with a channels-last weight (non-contiguous: it cannot move into a flat buffer)."""
    import wansync as ws

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(16, 1))
    model[0].weight.data = model[0].weight.data.contiguous(memory_format=torch.channels_last)
    sync = ws.strategy("local_sgd", model, torch.optim.SGD(model.parameters(), lr=LR), sync_every=1)
    gen = torch.Generator().manual_seed(rank + 1)
    model(torch.randn(2, 3, 4, 4, generator=gen)).sum().backward()
    sync.step()
    return {
        "home": sync.home() is not None,
        "params": [p.detach().clone() for p in model.parameters()],
        "channels_last": model[0].weight.is_contiguous(memory_format=torch.channels_last),
        "contiguous": model[0].weight.is_contiguous(),
    }


def test_a_tensor_that_cannot_move_is_gathered_and_written_back_keeping_its_layout():
    r0, r1 = run_ranks(_channels_last_local_sgd, 2)
    assert not r0["home"] and r0["channels_last"] and not r0["contiguous"]
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))  # averaged all the same


def _resumed_from_an_old_checkpoint(rank: int, world: int) -> dict[str, Any]:
    import wansync as ws

    model = _model(rank)
    sync = ws.strategy("local_sgd", model, torch.optim.SGD(model.parameters(), lr=LR), sync_every=1)
    state = sync.state_dict()
    state.pop("drift_ref")
    state["drift_side"] = [0.25, 5.0, 4]  # as saved by the side band of before
    sync.load_state_dict(state)
    none_yet = sync._ref_sq is None
    records: list[dict[str, Any]] = []
    sync.on_event(records.append)
    gen = torch.Generator().manual_seed(rank + 1)
    x = torch.randn(16, 8, generator=gen)
    (sync.model(x) - x.sum(1, keepdim=True) * (rank + 1)).pow(2).mean().backward()
    theta_m = torch.cat([p.detach().reshape(-1) - LR * p.grad.reshape(-1) for p in model.parameters()])
    reference = _reference_drift(theta_m)
    sync.step()
    return {
        "none_yet": none_yet,
        "reference": reference,
        "after": sync._ref_sq is not None,
        "drift": [e["drift"] for e in records if e["type"] == "sync"],
    }


def test_a_checkpoint_from_before_the_reference_resumes_and_measures_the_next_boundary():
    """Older checkpoints carry no reference ‖θ̄‖²: the next boundary subtracts 0 instead (its side
    band rounds the whole norm, ~1e-7 of it), reports its drift, and sets the reference."""
    r = run_ranks(_resumed_from_an_old_checkpoint, 2)[0]
    assert r["none_yet"] and r["after"]
    assert r["drift"] == [pytest.approx(r["reference"], rel=1e-3)]
