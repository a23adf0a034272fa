"""Whole-round overlap (`overlap_rounds`, DiLoCoX's one-step delay) on real gloo groups: the rule of
`strategies.round_overlap` written out by hand with torch's own SGD, one worker training as it would
alone, SparseLoCo's identity with DiLoCo carried over, every worker's bits after the run, a checkpoint
with a mean in flight, and the one-line refusals."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from wansync.errors import ConfigError
from wansync.runner.localgroup import run_ranks
from wansync.strategies import make_options
from wansync.strategies.base import sync_tensors
from strategy_harness import flat_access, flat_params, rank_batch
from test_streaming import deep_model, resume, train

pytestmark = pytest.mark.timeout(180)

H, STEPS = 4, 14  # 3 rounds, then 2 steps averaged at the end
OVERLAP = dict(sync_every=H, overlap_rounds=True)


def direct_overlap(rank: int, world: int, lr: float = 0.7, momentum: float = 0.9) -> dict[str, Any]:
    """The docstring's rule with torch only: at a round's end Δ = s − θ_m; θ̃ ← SGD(θ̃, Δ̄ of the round
    before); θ_m ← θ̃ − Δ; s ← θ_m; Δ̄ = mean(Δ) (kept for the next round's end). At the run's end
    the last Δ̄'s step, then the blocking mean of the steps since, θ_m ← θ̃."""
    model = deep_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tensors = sync_tensors(model)

    local, load = flat_access(tensors)

    def mean(delta: torch.Tensor) -> torch.Tensor:
        out = delta.clone()
        dist.all_reduce(out)
        return out.div_(world)

    anchor = torch.nn.Parameter(local().clone())
    outer = torch.optim.SGD([anchor], lr=lr, momentum=momentum, nesterov=momentum > 0)

    def outer_step(avg: torch.Tensor) -> None:
        anchor.grad = avg
        outer.step()

    start, landing, snapshots = anchor.detach().clone(), None, []
    for step in range(STEPS):
        x, y = rank_batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % H == 0:
            delta = start - local()
            if landing is not None:
                outer_step(landing)
            load(anchor.detach() - delta)
            start, landing = local(), mean(delta)
        snapshots.append(flat_params(model))
    delta = start - local()
    outer_step(landing)
    outer_step(mean(delta))
    load(anchor.detach())
    return {"params": snapshots, "final": flat_params(model)}


def alone(rank: int) -> dict[str, Any]:
    """Plain training, no strategy."""
    model = deep_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    snapshots = []
    for step in range(STEPS):
        x, y = rank_batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        snapshots.append(flat_params(model))
    return {"params": snapshots, "final": flat_params(model)}


CKPT_AT = 6  # round 1's mean launched at step 4, landing at step 8


def overlap_runs(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"direct": direct_overlap(rank, world), "alone": alone(rank)}
    out["diloco"] = train(rank, "diloco", OVERLAP, STEPS)
    out["plain"] = train(rank, "diloco", dict(sync_every=H), STEPS)
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank a worker of its own
    out["solo"] = train(rank, "diloco", dict(OVERLAP, outer_lr=1.0, outer_momentum=0.0, group=solo), STEPS)
    sgd = dict(OVERLAP, outer_lr=0.8, outer_momentum=0.0)
    out["diloco_sgd"] = train(rank, "diloco", sgd, STEPS)
    out["sparse_identity"] = train(
        rank, "sparseloco", dict(OVERLAP, density=1.0, bits=32, error_decay=0.0, outer_lr=0.8, aggregate="all"), STEPS
    )
    out["sparse"] = train(rank, "sparseloco", dict(OVERLAP, chunk=4, density=0.25), STEPS)
    for name, options in (
        ("diloco", OVERLAP),
        ("sparseloco", dict(OVERLAP, chunk=4, density=0.25)),
        ("diloco_q", dict(OVERLAP, codec="int8", error_feedback=True)),
    ):
        strategy = name.split("_")[0]
        out[f"{name}_full"] = train(rank, strategy, options, STEPS)
        saved = train(rank, strategy, options, STEPS, checkpoint_at=CKPT_AT)["saved"]
        out[f"{name}_saved"] = saved
        out[f"{name}_resumed"] = resume(rank, strategy, options, saved, CKPT_AT, STEPS)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(overlap_runs, 2, timeout=170)


def _close(a: dict[str, Any], b: dict[str, Any], atol: float = 1e-6) -> None:
    assert len(a["params"]) == len(b["params"])
    for step, (x, y) in enumerate(zip(a["params"], b["params"])):
        torch.testing.assert_close(x, y, rtol=0, atol=atol, msg=lambda m: f"step {step + 1}: {m}")
    torch.testing.assert_close(a["final"], b["final"], rtol=0, atol=atol)


def test_diloco_with_overlap_rounds_is_the_one_round_delayed_rule_written_out_with_torch(runs):
    for r in runs:
        _close(r["diloco"], r["direct"])
    a, b = runs
    assert torch.equal(a["diloco"]["final"], b["diloco"]["final"])  # every worker the same bits at the end
    assert not torch.equal(a["diloco"]["params"][H], b["diloco"]["params"][H])  # each its own round on top
    assert not torch.allclose(a["diloco"]["final"], a["plain"]["final"], atol=1e-4)  # not DiLoCo without delay


def test_one_worker_under_outer_sgd_at_lr_1_trains_as_it_would_alone(runs):
    for r in runs:
        _close(r["solo"], r["alone"], atol=1e-5)


def test_sparseloco_at_density_one_unquantized_is_diloco_with_outer_sgd_under_overlap_too(runs):
    for r in runs:
        _close(r["sparse_identity"], r["diloco_sgd"])
    a, b = runs
    assert torch.equal(a["sparse"]["final"], b["sparse"]["final"])


def test_the_round_launched_at_a_boundary_lands_at_the_next_and_travels_as_pseudo_gradients(runs):
    events = [e for e in runs[0]["diloco"]["events"] if e["type"] == "sync"]
    assert [(e["step"], e["overlapped"]) for e in events] == [(4, True), (8, True), (12, True), (14, False)]
    assert runs[0]["diloco"]["comm"]["pseudo_grads"]["calls"] == 4 and "params" not in runs[0]["diloco"]["comm"]


@pytest.mark.parametrize("name", ["diloco", "sparseloco", "diloco_q"])
def test_a_checkpoint_with_a_mean_in_flight_resumes_bit_for_bit(runs, name):
    for r in runs:
        full, resumed = r[f"{name}_full"], r[f"{name}_resumed"]
        for step, (x, y) in enumerate(zip(full["params"][CKPT_AT:], resumed["params"])):
            assert torch.equal(x, y), f"{name} step {CKPT_AT + step + 1}"
        assert torch.equal(full["final"], resumed["final"])
        state = torch.load(io.BytesIO(r[f"{name}_saved"]), weights_only=False)["sync"]["overlap"]
        assert state["landing"] is not None and state["start"] is not None  # the checkpoint waited for it


@pytest.mark.parametrize(
    "strategy, options, message",
    [
        ("local_sgd", {"overlap_rounds": True}, "overlap_rounds"),
        ("streaming", {"overlap_rounds": True}, "overlap_rounds"),
        ("diloco", {"overlap_rounds": "yes"}, "^overlap_rounds must be true or false, got 'yes'$"),
    ],
)
def test_overlap_rounds_where_it_cannot_be_is_one_line(strategy, options, message):
    with pytest.raises(ConfigError, match=message):
        make_options(strategy, **options)


def test_fault_tolerance_refuses_overlap_rounds():
    from wansync.ft.support import check_supported

    with pytest.raises(ConfigError, match="--fault-tolerant does not take overlap_rounds"):
        check_supported("diloco", overlap_rounds=True)


# ---- the trainer: the profiler sees the exchange hidden ----------------------------------

TWO_SITES = """
name = "two-sites"
[sites.a]
workers = 2
[sites.b]
workers = 2
[[links]]
sites = ["a", "b"]
rtt = "20ms"
bw = "40mbit"
[compute]
step = "100ms"
"""


def test_the_profiler_books_an_overlapped_exchange_as_hidden(tmp_path):
    """4 workers on two sites joined by a slow link: their mean goes by sites, in a thread of its own
    when overlapped; every step padded to 100 ms, so a round (400 ms) outlasts the exchange."""
    import json
    from cli_harness import TINY, wansync

    topology = tmp_path / "two-sites.toml"
    topology.write_text(TWO_SITES)
    runs = {}
    for overlap in (False, True):
        out = tmp_path / str(overlap)
        r = wansync(
            "train",
            "--strategy",
            "diloco",
            "--sync-every",
            "4",
            "--workers",
            "4",
            "--steps",
            "12",
            "--wan",
            str(topology),
            "--eval-every",
            "100",
            "--quiet",
            "--checkpoint-every",
            "0",
            "--out",
            str(out),
            *TINY,
            *(["--overlap-rounds"] if overlap else []),
            timeout=240,
        )
        assert r.returncode == 0, r.stderr
        runs[overlap] = (json.loads((out / "profile.json").read_text()), json.loads((out / "summary.json").read_text()))
    (plain, plain_summary), (over, summary) = runs[False], runs[True]
    assert summary["comm"]["pseudo_grads"]["algorithm"] == "hierarchical"
    assert summary["comm"]["pseudo_grads"]["calls"] == 3 and plain_summary["comm"]["params"]["calls"] == 3
    # the rounds ending at steps 4 and 8 travel during the next round: hidden; the last is waited for at the end
    assert over["derived"]["hidden_comm_pct"] > 40 > plain["derived"]["hidden_comm_pct"]
    assert over["categories_s"]["exposed_comm"] < plain["categories_s"]["exposed_comm"]


def test_the_planner_hides_a_round_that_fits_in_the_next_and_bills_two_more_copies():
    from wansync.net.wan import PRESETS
    from wansync.planner import of_params, predict, setting

    base = dict(size=of_params(1e8), workers=4, topology=PRESETS["cross-region"], step_s=0.5)
    plain, over = (predict(setting("diloco", {"sync_every": 10, "overlap_rounds": o}, **base)) for o in (False, True))
    assert plain.exposed_pct > 30 and over.exposed_pct == 0.0  # a 4.3 s exchange inside a 5 s round
    assert [t.purpose for t in over.timeline.held_in_flight] == ["pseudo_grads"]  # the last, at the end of the run
    assert over.memory["outer_state"] - plain.memory["outer_state"] == 2 * 4 * 10**8
    slow = dict(base, step_s=0.1)  # a round of 1 s: 3.3 s of each exposed
    assert predict(setting("diloco", {"sync_every": 10, "overlap_rounds": True}, **slow)).exposed_pct > 0
