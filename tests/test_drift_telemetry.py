"""Drift telemetry rides on the parameter exchange: on a real 2-rank gloo group, the drift each
boundary reports (one boundary late, and the last one from `finish()`) equals the drift computed
with a separate all-reduce, and turning the telemetry on adds no collective to the training steps."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from wansync.localgroup import run_ranks

pytestmark = pytest.mark.timeout(120)

H, STEPS, LR = 2, 7, 0.1


def _model(rank: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _reference_drift(theta_m: torch.Tensor) -> float:
    """mean_m ‖θ_m − θ̄‖ / ‖θ̄‖ with collectives of its own."""
    avg = theta_m.clone()
    dist.all_reduce(avg)
    avg /= dist.get_world_size()
    d = torch.dist(theta_m, avg).double().reshape(1)
    dist.all_reduce(d)
    return float(d[0]) / dist.get_world_size() / float(torch.linalg.vector_norm(avg))


def _train(rank: int, name: str, drift: bool) -> dict[str, Any]:
    import wansync as ws
    model = _model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sync = ws.strategy(name, model, opt, sync_every=H, drift_telemetry=drift,
                       **({"outer_lr": 0.7, "outer_momentum": 0.9} if name == "diloco" else {}))
    records: list[dict[str, Any]] = []
    sync.on_event(records.append)
    gen = torch.Generator().manual_seed(rank + 1)
    reference = []
    for t in range(1, STEPS + 1):
        x = torch.randn(16, 8, generator=gen)
        loss = (sync.model(x) - x.sum(1, keepdim=True) * (rank + 1)).pow(2).mean()
        loss.backward()
        if t % H == 0 or t == STEPS:              # a boundary (or finish's), after this inner step
            theta_m = torch.cat([p.detach().reshape(-1) - LR * p.grad.reshape(-1) for p in model.parameters()])
            reference.append(_reference_drift(theta_m))
        sync.step()
        sync.zero_grad()
    before_finish = sync.comm.snapshot()
    sync.finish()
    return {"records": records, "reference": reference, "before_finish": before_finish,
            "after_finish": sync.comm.snapshot(), "params": [p.detach().clone() for p in model.parameters()]}


def _both(rank: int, world: int) -> dict[str, Any]:
    return {(name, drift): _train(rank, name, drift) for name in ("local_sgd", "diloco") for drift in (True, False)}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(_both, 2)


def _calls(snapshot: dict[str, dict[str, Any]]) -> int:
    return sum(v["calls"] for v in snapshot.values())


@pytest.mark.parametrize("name", ["local_sgd", "diloco"])
def test_piggybacked_drift_equals_a_separate_all_reduce(runs, name):
    for r in runs:
        run = r[(name, True)]
        syncs = [e for e in run["records"] if e["type"] == "sync"]
        reported = [e["drift_prev"] for e in syncs[1:]] + [e["drift"] for e in run["records"] if e["type"] == "drift"]
        assert "drift_prev" not in syncs[0]                      # nothing before the first boundary
        assert len(reported) == len(run["reference"]) == len(syncs) == 4      # t = 2, 4, 6 and finish's 7
        assert reported == pytest.approx(run["reference"], abs=1e-6)
        assert all(0 < d < 1 for d in reported)
        assert run["records"][-1] == {"type": "drift", "step": STEPS, "strategy": name, "boundary": STEPS,
                                      "drift": reported[-1]}


@pytest.mark.parametrize("name", ["local_sgd", "diloco"])
def test_telemetry_adds_no_collective_to_training_and_one_scalar_to_finish(runs, name):
    for r in runs:
        on, off = r[(name, True)], r[(name, False)]
        assert _calls(on["before_finish"]) == _calls(off["before_finish"])
        for key in ("calls", "bytes"):
            assert on["before_finish"]["params"][key] == off["before_finish"]["params"][key]
        assert on["before_finish"]["telemetry"] == {"calls": 0, "bytes": 12 * 3, "waited_s": 0.0}  # 12 B per boundary
        assert _calls(on["after_finish"]) == _calls(off["after_finish"]) + 1
        assert on["after_finish"]["telemetry"]["calls"] == 1
        assert all("drift" not in e and "drift_prev" not in e for e in off["records"])


@pytest.mark.parametrize("name", ["local_sgd", "diloco"])
def test_telemetry_changes_no_parameter_bit(runs, name):
    for r in runs:
        for a, b in zip(r[(name, True)]["params"], r[(name, False)]["params"], strict=True):
            assert torch.equal(a, b)


def _storages_across_boundaries(rank: int, world: int) -> dict[str, Any]:
    """Where the model's tensors live, boundary after boundary, and the spare buffer kept."""
    import wansync as ws
    from wansync.strategies import periodic
    out: dict[str, Any] = {}
    bound = periodic.PAIRED_DISTANCE_MAX
    for name, drift, long in (("local_sgd", True, False), ("local_sgd", False, False), ("diloco", True, False),
                              ("local_sgd", True, True)):
        periodic.PAIRED_DISTANCE_MAX = 10 if long else bound      # as if the model were longer than the bound
        model = _model(rank)
        sync = ws.strategy(name, model, torch.optim.SGD(model.parameters(), lr=LR), sync_every=1,
                           drift_telemetry=drift)
        seen = []
        for _ in range(4):
            model(torch.randn(4, 8)).sum().backward()
            sync.step()
            sync.zero_grad()
            packed = sync.flat.packed()
            seen.append((packed is not None and packed.data_ptr(),
                         None if sync._spare is None else sync._spare.data_ptr(),
                         packed is not None and packed.untyped_storage().nbytes()))
        out[(name, drift) if not long else "long"] = seen
    periodic.PAIRED_DISTANCE_MAX = bound
    return out


def test_a_boundary_averages_into_the_models_own_buffers_without_fresh_memory():
    """From the first boundary on, the model lives in one flat buffer. Without telemetry every
    boundary all-reduces it in place; with it, the mean lands in a second buffer that the model
    moves to (the first is consumed measuring the drift), and local_sgd keeps both, side by side in
    one block, taking turns (no fresh memory), while diloco allocates the second at each boundary."""
    seen = run_ranks(_storages_across_boundaries, 2)[0]
    wire_bytes = 4 * (sum(p.numel() for p in _model(0).parameters()) + 3)     # the values and the side band
    off = seen[("local_sgd", False)]
    assert len({home for home, _, _ in off}) == 1 and off[0][0] and {spare for _, spare, _ in off} == {None}
    for key in (("local_sgd", True), "long"):
        on = seen[key]
        homes = [home for home, _, _ in on]
        assert all(homes) and homes[0] != homes[1] and homes[0] == homes[2] and homes[1] == homes[3]
        assert all(spare == other for (_, spare, _), other in zip(on, homes[1:] + [homes[2]]))  # the other one
    # up to the fused distance's bound the two rows of one block; above it two buffers, so that
    # torch.save of the model's state writes the model once
    assert abs(seen[("local_sgd", True)][0][0] - seen[("local_sgd", True)][1][0]) == wire_bytes
    assert {nbytes for _, _, nbytes in seen[("local_sgd", True)]} == {2 * wire_bytes}
    assert {nbytes for _, _, nbytes in seen["long"]} == {wire_bytes}
    assert all(home for home, _, _ in seen[("diloco", True)])
    assert {spare for _, spare, _ in seen[("diloco", True)]} == {None}


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
    return {"home": sync.home() is not None, "params": [p.detach().clone() for p in model.parameters()],
            "channels_last": model[0].weight.is_contiguous(memory_format=torch.channels_last),
            "contiguous": model[0].weight.is_contiguous()}


def test_a_tensor_that_cannot_move_is_gathered_and_written_back_keeping_its_layout():
    r0, r1 = run_ranks(_channels_last_local_sgd, 2)
    assert not r0["home"] and r0["channels_last"] and not r0["contiguous"]
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))     # averaged all the same


def _resumed_from_an_old_checkpoint(rank: int, world: int) -> dict[str, Any]:
    import wansync as ws
    model = _model(rank)
    sync = ws.strategy("local_sgd", model, torch.optim.SGD(model.parameters(), lr=LR), sync_every=H)
    state = sync.state_dict()
    state.pop("drift_side")
    state["drift"] = [0.25, 5.0, 4]                          # [‖θ_m − θ̄‖, ‖θ̄‖, step], as saved before
    sync.load_state_dict(state)
    out = {"step": sync._drift_step, "drift": sync.relative_drift(*sync.drift_side())}
    state["drift"] = [0.0, None, 0]                          # saved before any boundary
    sync.load_state_dict(state)
    return {**out, "none_yet": sync._drift_sq is None}


def test_a_checkpoint_from_before_the_side_band_resumes_with_its_drift_in_flight():
    """Older checkpoints kept [‖θ_m − θ̄‖, ‖θ̄‖, step]; loaded, the side band they imply reports the
    same drift (every worker's ‖θ_m‖² taken as ‖θ̄‖² + d², so mean ‖θ_m‖² − mean d² = ‖θ̄‖²)."""
    r = run_ranks(_resumed_from_an_old_checkpoint, 2)[0]
    assert r["step"] == 4 and r["drift"] == pytest.approx(0.25 / 5.0, rel=1e-9) and r["none_yet"]
