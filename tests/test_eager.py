"""Eager updates (Kale, Douillard, Donchev 2025, arXiv:2502.12996) as the `eager` merge of Streaming
DiLoCo and CoCoDC: the look-ahead and the correction in isolation, then on real gloo groups
the rule written out by hand, the identities (one worker, no overlap, CoCoDC's round robin), every
rank's anchors, a resume with an exchange in flight, and the planner's schedule."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from wansync.errors import ConfigError
from wansync.planner import of_params, predict, setting
from wansync.net.wan import PRESETS
from wansync.runner.localgroup import run_ranks
from wansync.strategies import make_options, timetable
from wansync.strategies.base import sync_tensors
from wansync.strategies.compensation import eager_correct, lands_on_anchor
from wansync.strategies.outer import Anchor
from strategy_harness import flat_access, flat_params, rank_batch
from test_streaming import deep_model, resume, train

pytestmark = pytest.mark.timeout(180)


# ---- the pure parts ------------------------------------------------------------------------------
def _anchor_with_momentum() -> Anchor:
    torch.manual_seed(0)
    tensors = [nn.Parameter(torch.randn(5, 3)), torch.randn(4)]  # a parameter and a buffer
    anchor = Anchor(tensors, lr=0.7, momentum=0.9, nesterov=True)
    anchor.outer_step(torch.randn(19))  # a momentum buffer to look ahead from
    return anchor


def test_the_look_ahead_is_the_outer_step_bit_for_bit_and_changes_no_state():
    anchor, grad = _anchor_with_momentum(), torch.randn(19)
    value, buf = anchor.value.clone(), anchor.optimizer.state[anchor.value]["momentum_buffer"].clone()
    ahead = anchor.lookahead(grad, lr=0.3)
    assert torch.equal(anchor.value, value)
    assert torch.equal(anchor.optimizer.state[anchor.value]["momentum_buffer"], buf)
    anchor.outer_step(grad.clone(), lr=0.3)
    assert torch.equal(ahead, anchor.value)
    fresh = Anchor([torch.nn.Parameter(torch.ones(3))], lr=0.7, momentum=0.9, nesterov=True)  # no buffer yet
    g = torch.tensor([0.5, -1.0, 2.0])
    ahead = fresh.lookahead(g)
    fresh.outer_step(g.clone())
    assert torch.equal(ahead, fresh.value)


def test_the_correction_swaps_the_proxy_for_the_true_step_and_keeps_the_steps_since():
    theta_now, eager, anchor = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.5]), torch.tensor([0.25, 1.0])
    assert torch.equal(eager_correct(theta_now.clone(), eager, anchor, 3), torch.tensor([0.75, 2.5]))
    assert torch.equal(eager_correct(theta_now.clone(), eager, anchor, 0), anchor)  # nothing trained on θ̂
    tiny = torch.tensor([1e-8, -3e-9])  # θ̂ = θ̃_p: θ(t_l)'s exact bits
    assert torch.equal(eager_correct(tiny.clone(), torch.ones(2), torch.ones(2), 2), tiny)
    assert lands_on_anchor("eager", 0.5, 0) and not lands_on_anchor("eager", 0.0, 1)


def test_eager_is_one_knob_of_both_strategies_that_replaces_their_merge():
    assert timetable("streaming", {}).merge == "alpha" and timetable("streaming", {"eager": True}).merge == "eager"
    assert timetable("cocodc", {"compensation": "taylor", "eager": True}).merge == "eager"
    assert timetable("cocodc", {"compensation": "taylor"}).merge == "taylor"
    with pytest.raises(ConfigError, match="^eager must be true or false, got 'yes'$"):
        make_options("streaming", eager="yes")


# ---- on real gloo groups -------------------------------------------------------------------------
def direct_eager(rank: int, world: int, H: int, tau: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """Eager updates on one fragment written out with torch's own SGD: at a start, Δ = θ̃ − θ_m and
    θ_m ← θ̂ = SGD(θ̃, Δ/M) on a copy of the outer state; τ steps later θ̃ ← SGD(θ̃, mean Δ) and
    θ_m ← θ_m + (θ̃ − θ̂); at the end a blocking sync (θ_m ← θ̃)."""
    model = deep_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tensors = sync_tensors(model)

    local, load = flat_access(tensors)

    def sgd_step(value: torch.Tensor, state: dict, grad: torch.Tensor) -> None:
        outer = torch.optim.SGD([value], lr=0.7, momentum=0.9, nesterov=True)
        if "momentum_buffer" in state:
            outer.state[value]["momentum_buffer"] = state["momentum_buffer"]
        value.grad = grad
        outer.step()
        state["momentum_buffer"] = outer.state[value]["momentum_buffer"]

    def mean(delta: torch.Tensor) -> torch.Tensor:
        out = delta.clone()
        dist.all_reduce(out)
        return out.div_(world)

    anchor, state = torch.nn.Parameter(local().clone()), {}
    in_flight: tuple[int, torch.Tensor, torch.Tensor] | None = None
    snapshots = []
    for step in range(steps):
        x, y = rank_batch(rank, step, seed)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        t = step + 1
        if in_flight is not None and t == in_flight[0] + tau:
            _, avg, ahead = in_flight
            with torch.no_grad():
                sgd_step(anchor, state, avg)
                load(local() + (anchor.detach() - ahead))
            in_flight = None
        if t % H == 0:
            delta = anchor.detach() - local()
            ahead = torch.nn.Parameter(anchor.detach().clone())
            copied = {k: v.clone() for k, v in state.items()}
            with torch.no_grad():
                sgd_step(ahead, copied, delta / world)
            load(ahead.detach())
            in_flight = (t, mean(delta), ahead.detach().clone())
        snapshots.append(flat_params(model))
    assert in_flight is None, "end the run outside an overlap"
    with torch.no_grad():
        sgd_step(anchor, state, mean(anchor.detach() - local()))
        load(anchor.detach())
    return {"params": snapshots, "final": flat_params(model)}


EAGER = dict(eager=True)
CKPT = dict(sync_every=6, fragments=2, overlap=2, **EAGER)  # fragment 1 in flight at step 7: started 6, merges 8
ROUND_ROBIN = dict(sync_every=8, fragments=2, overlap=2, syncs_per_period=4, **EAGER)


def eager_runs(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank a worker of its own: M = 1
    one = dict(sync_every=4, fragments=1, group=solo)
    out["solo_eager"] = train(rank, "streaming", dict(one, overlap=2, **EAGER), 13)
    out["solo_plain"] = train(rank, "streaming", dict(one, overlap=0, alpha=0.0), 13)
    no_overlap = dict(sync_every=6, fragments=2, overlap=0)
    out["tau0_eager"] = train(rank, "streaming", dict(no_overlap, **EAGER), 14)
    out["tau0_plain"] = train(rank, "streaming", dict(no_overlap, alpha=0.0), 14)
    out["direct"] = direct_eager(rank, world, H=4, tau=2, steps=15)
    out["strategy"] = train(rank, "streaming", dict(sync_every=4, fragments=1, overlap=2, **EAGER), 15)
    out["checkpointed"] = train(rank, "streaming", CKPT, 14, checkpoint_at=7)
    out["resumed"] = resume(rank, "streaming", CKPT, out["checkpointed"]["saved"], 7, 14)
    out["cocodc"] = train(rank, "cocodc", dict(ROUND_ROBIN, schedule="round_robin"), 13)
    out["streaming_n4"] = train(rank, "streaming", ROUND_ROBIN, 13)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(eager_runs, 2)


def _equal_runs(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert len(a["params"]) == len(b["params"])
    for step, (x, y) in enumerate(zip(a["params"], b["params"])):
        assert torch.equal(x, y), f"step {step + 1}"
    assert torch.equal(a["final"], b["final"])


def test_eager_on_real_ranks_is_the_rule_written_out_with_torchs_sgd(runs):
    for r in runs:
        _equal_runs(r["strategy"], r["direct"])
    a, b = runs
    assert not torch.equal(a["strategy"]["params"][4], b["strategy"]["params"][4])  # each its own proxy at a start
    assert torch.equal(a["strategy"]["final"], b["strategy"]["final"])


def test_with_one_worker_eager_at_overlap_2_is_the_outer_step_without_delay_bit_for_bit(runs):
    for r in runs:  # overlap 0 with alpha 0 and one fragment: DiLoCo (test_streaming's identity)
        _equal_runs(r["solo_eager"], r["solo_plain"])
        assert [e["merge"] for e in r["solo_eager"]["events"] if e.get("kind") == "fragment"] == ["eager"] * 3


def test_with_no_overlap_eager_is_the_alpha_merge_with_alpha_0_bit_for_bit(runs):
    for r in runs:
        _equal_runs(r["tau0_eager"], r["tau0_plain"])


def test_cocodc_with_eager_and_round_robin_is_streaming_eager_with_n_syncs(runs):
    for r in runs:
        _equal_runs(r["cocodc"], r["streaming_n4"])


def test_every_rank_holds_the_same_anchors_and_its_own_proxy_in_flight(runs):
    a, b = (torch.load(io.BytesIO(r["checkpointed"]["saved"]), weights_only=False)["sync"] for r in runs)
    for x, y in zip(a["anchors"], b["anchors"], strict=True):
        assert torch.equal(x["value"], y["value"])
        mx, my = (s["optimizer"]["state"].get(0, {}).get("momentum_buffer") for s in (x, y))
        assert (mx is None and my is None) or torch.equal(mx, my)
    assert a["anchors"][0]["optimizer"]["state"], "fragment 0 has merged once: its outer momentum is compared"
    (fa,), (fb,) = a["in_flight"], b["in_flight"]
    assert (fa["fragment"], fa["start"], fa["merge_at"]) == (1, 6, 8)
    assert fa["theta_start"] is not None and not torch.equal(fa["theta_start"], fb["theta_start"])  # θ̂: per worker


def test_a_checkpoint_with_an_exchange_in_flight_resumes_eager_bit_exactly(runs):
    for r in runs:
        full, again = r["checkpointed"], r["resumed"]
        assert len(again["params"]) == 7
        for x, y in zip(full["params"][7:], again["params"]):
            assert torch.equal(x, y)
        assert torch.equal(full["final"], again["final"])


# ---- the planner -------------------------------------------------------------------------------
def test_the_planner_predicts_eager_with_the_same_transfers_as_the_alpha_merge():
    base = dict(size=of_params(1e8), workers=4, topology=PRESETS["cross-region"], step_s=0.3, ranks_per_worker=1)
    opts = dict(sync_every=40, fragments=4, overlap=5)
    alpha, eager = (predict(setting("streaming", dict(opts, eager=e), **base)) for e in (False, True))
    assert (eager.bytes_per_step, eager.sent_per_step, eager.wall_per_1000_s, eager.exposed_pct) == (
        alpha.bytes_per_step,
        alpha.sent_per_step,
        alpha.wall_per_1000_s,
        alpha.exposed_pct,
    )
    assert eager.bytes_per_step > 0
    assert eager.memory["outer_state"] > alpha.memory["outer_state"]  # θ̂ of each fragment in flight


def test_wansync_plan_takes_eager(capsys):
    from wansync.cli import main

    printed = {}
    for merge in ("--no-eager", "--eager"):
        with pytest.raises(SystemExit) as done:
            main(
                [
                    "plan",
                    "--model",
                    "tiny",
                    "--workers",
                    "4",
                    "--wan",
                    "cross-region",
                    "--strategy",
                    "streaming",
                    "--sync-every",
                    "40",
                    "--overlap",
                    "5",
                    merge,
                    "--step-time",
                    "0.3",
                ]
            )
        assert done.value.code == 0
        printed[merge] = [
            line
            for line in capsys.readouterr().out.splitlines()
            if line.startswith(("wall clock", "exposed communication", "bytes per worker"))
        ]
    assert len(printed["--eager"]) == 3 and printed["--eager"] == printed["--no-eager"]
