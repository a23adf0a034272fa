"""Workers of different speeds (`strategies.pace`): the weighted mean, the policies' decisions, the
strategies that follow them on real gloo groups, and the trainer's emulated speeds."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch

from cli_harness import TINY, wansync
from wansync.errors import ConfigError
from wansync.runner.localgroup import run_ranks
from wansync.strategies import make_options
from wansync.strategies.pace import Pace

pytestmark = pytest.mark.timeout(240)

WEIGHTS = (1.0, 0.25, 0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the weighted mean: Σ w x / Σ w, every rank the same bits ------------------------------------------------


def _weighted(rank: int, world: int) -> dict:
    from wansync.comm.exchange import Exchange

    exchange = Exchange()
    xs = [torch.randn(1001, generator=torch.Generator().manual_seed(m)) for m in range(world)]
    x = xs[rank].clone()
    x[-1] = 10.0 * (rank + 1)  # a side-band scalar: averaged plainly
    want = sum(w * v[:-1] for w, v in zip(WEIGHTS, xs)) / sum(WEIGHTS)
    out = {}
    for codec in ("fp32", "int8"):
        for async_op in (False, True):
            buf = x.clone()
            handle = exchange.mean(
                buf, "pseudo_grads", codec, async_op=async_op, inplace=True, extra=1, weight=WEIGHTS[rank], mean_sq=True
            )
            mean = handle.wait()
            gathered = [torch.empty_like(mean) for _ in range(world)]
            torch.distributed.all_gather(gathered, mean)
            out[f"{codec}/{async_op}"] = {
                "error": float((mean[:-1] - want).abs().max()),
                "side": float(mean[-1]),
                "same": all(torch.equal(g, gathered[0]) for g in gathered),
                "inplace": mean is buf,
                "mean_sq": handle.mean_sq,
                "exact_sq": float((mean[:-1].double() ** 2).sum()),
            }
    equal = exchange.mean(x.clone(), "params", weight=0.5).wait()
    plain = exchange.mean(x.clone(), "params").wait()
    out["equal_weights_error"] = float((equal - plain).abs().max())
    return out


def test_a_weighted_mean_is_the_weighted_average_on_every_rank_alike():
    for r in run_ranks(_weighted, 3, timeout=120):
        for key in ("fp32/False", "fp32/True", "int8/False", "int8/True"):
            got = r[key]
            assert got["same"] and got["inplace"], key
            assert got["error"] < (1e-5 if key.startswith("fp32") else 0.1), (key, got["error"])
            assert got["side"] == pytest.approx(20.0)  # (10 + 20 + 30) / 3: unweighted
            assert got["mean_sq"] == pytest.approx(got["exact_sq"], rel=1e-9)  # the weighted mean's norm
        assert r["equal_weights_error"] < 1e-6


# -- the policies' decisions ------------------------------------------------------------------------------------


class _Worker:
    ranks_per_worker, inside = 1, None


def paced(policy: str, deadline_s: float = 0.0) -> Pace:
    return Pace(policy, 10, deadline_s, _Worker(), worker=1, workers=3)


def test_balanced_spreads_each_workers_share_of_the_round_evenly():
    pace = paced("balanced")
    pace.agreed = [0.1, 0.25, 0.1]  # worker 1 at 40 % of the fastest's speed
    assert pace.steps_for(0) == 10 and pace.steps_for(1) == 4
    pace.agreed = [0.1, 0.105, 0.1]
    assert pace.steps_for(1) == 10  # within 10 %: noise, every step
    pace.agreed = [0.1, 0.25, 0.1]
    computed = [t for t in range(11, 21) if pace.computes(t)]
    assert len(computed) == 4 and computed == [13, 15, 18, 20]  # spread over the round, its last step included
    pace.agreed = [0.1, 100.0, 0.1]
    assert pace.steps_for(1) == 1  # never nothing: a contribution always has a step


def test_deadline_sits_out_what_cannot_finish_before_the_round_closes(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("wansync.strategies.pace.time.perf_counter", lambda: now[0])
    pace = paced("deadline")
    assert all(pace.computes(t) for t in range(1, 11))  # round 1: nothing measured, every step
    pace.after_step(10, True, 0.2)  # a round ends: the next one starts now
    pace.agreed = [0.1, 0.2, 0.1]  # (alone, it agreed with itself: as if 3 had)
    assert pace.round_deadline() == pytest.approx(1.1 * 10 * 0.1)  # 1.1 x H x the median worker's step
    pace.times = [0.2]
    assert pace.computes(11)  # a round's first step: always
    now[0] += 0.85
    assert pace.computes(15)  # 0.85 + 0.2 <= 1.1
    now[0] += 0.1
    assert not pace.computes(16)  # 0.95 + 0.2 > 1.1
    pace.pause(0.5)  # an evaluation: not training, not counted
    assert pace.computes(17)
    pace.after_step(17, True, 0.7)  # the step after it: its own 0.2 s, not the 0.5
    assert pace.times[-1] == pytest.approx(0.2)
    assert paced("deadline", 5.0).deadline_s == 5.0


def test_wait_computes_every_step_and_weighs_nothing():
    pace = paced("wait")
    assert all(pace.computes(t) for t in range(1, 40)) and pace.weight(0) is None


def test_a_contribution_of_no_step_weighs_almost_nothing_but_not_nothing():
    from wansync.strategies.pace import NO_STEPS_WEIGHT

    pace = paced("balanced")
    pace.computed = 5
    assert pace.weight(0) == 0.5 and pace.weight(5) == NO_STEPS_WEIGHT > 0  # every worker idle: the plain mean


@pytest.mark.parametrize(
    "strategy, options, message",
    [
        ("cpdp", {"slow_policy": "balanced"}, "cpdp takes slow_policy wait only, not balanced: its step K all-reduces"),
        ("post_local_sgd", {"slow_policy": "deadline"}, "post_local_sgd takes slow_policy wait only"),
        ("diloco", {"deadline": 3.0}, "deadline 3 s does nothing under slow_policy wait"),
        ("streaming", {"slow_policy": "balanced", "deadline": 3.0}, "does nothing under slow_policy balanced"),
        ("diloco", {"slow_policy": "fast"}, "slow_policy must be one of wait, deadline, balanced"),
        ("sparseloco", {"deadline": -1.0}, "deadline must be >= 0"),
    ],
)
def test_policies_a_strategy_cannot_follow_are_one_line(strategy, options, message):
    with pytest.raises(ConfigError, match=message):
        make_options(strategy, **options)
    make_options("cpdp", slow_policy="balanced", grad_phase=False)  # no gradient phase: allowed
    make_options("post_local_sgd", slow_policy="balanced", switch_step=0)


def test_fault_tolerance_takes_wait_only():
    from wansync.ft.support import check_supported

    with pytest.raises(ConfigError, match="--fault-tolerant takes slow_policy wait only, not deadline"):
        check_supported("diloco", slow_policy="deadline")


# -- the strategies follow them ------------------------------------------------------------------------------------


def _paced(rank: int, world: int, name: str, options: dict) -> dict:
    """A loop where worker 1 is 4 times slower: its computed steps take 200 ms, the others' 50 ms (long
    enough that a loaded machine's scheduling noise stays under balanced's 10 % tolerance)."""
    import wansync as ws
    from strategy_harness import flat_params, rank_batch, tiny_model

    model = tiny_model(0)
    sync = ws.strategy(name, model, torch.optim.SGD(model.parameters(), lr=0.05), **options)
    idle, after_boundaries = [], []
    for step in range(24):
        if sync.computes_next():
            x, y = rank_batch(rank, step)
            torch.nn.functional.mse_loss(sync.model(x), y).backward()
            time.sleep(0.2 if rank == 1 else 0.05)
            sync.step()
        else:
            idle.append(step + 1)
            sync.step(idle=True)
        sync.zero_grad()
        if sync.t % options["sync_every"] == 0:
            after_boundaries.append(flat_params(model))
    sync.finish()
    return {"idle": idle, "params": after_boundaries, "final": flat_params(model), "agreed": sync.pace.agreed}


@pytest.mark.parametrize(
    "name, options",
    [
        ("local_sgd", {"sync_every": 6, "slow_policy": "balanced"}),
        ("diloco", {"sync_every": 6, "slow_policy": "balanced"}),
        ("streaming", {"sync_every": 6, "fragments": 2, "overlap": 1, "slow_policy": "balanced"}),
        ("sparseloco", {"sync_every": 6, "slow_policy": "balanced"}),
    ],
)
def test_the_slow_worker_sits_out_steps_and_every_worker_holds_the_same_bits_after_each_round(name, options):
    out = run_ranks(_paced, 3, name, options, timeout=120)
    assert out[0]["idle"] == out[2]["idle"] == []
    assert out[1]["idle"] and min(out[1]["idle"]) > 6  # round 1 measures; the policy starts after
    assert out[0]["agreed"] == out[1]["agreed"] == out[2]["agreed"]
    if name != "streaming":  # streaming's fragments merge at their own steps
        for a, b, c in zip(*(r["params"] for r in out)):
            assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(out[0]["final"], out[1]["final"]) and torch.equal(out[0]["final"], out[2]["final"])


# -- the trainer: emulated speeds, the policy, peer wait --------------------------------------------------------

SLOW = """
name = "one-slow"
[sites.a]
workers = 2
speeds = [1.0, 0.5]
[sites.b]
workers = 1
[[links]]
sites = ["a", "b"]
rtt = "10ms"
bw = "1gbit"
[compute]
step = "60ms"
"""


def test_an_emulated_slow_worker_paces_wait_and_sits_out_steps_under_balanced(tmp_path):
    topology = tmp_path / "slow.toml"
    topology.write_text(SLOW)
    runs = {}
    for policy in ("wait", "balanced"):
        out = tmp_path / policy
        r = wansync(
            "train",
            "--strategy",
            "diloco",
            "--sync-every",
            "4",
            "--workers",
            "3",
            "--steps",
            "16",
            "--wan",
            str(topology),
            "--slow-policy",
            policy,
            "--eval-every",
            "100",
            "--quiet",
            "--checkpoint-every",
            "0",
            "--out",
            str(out),
            *TINY,
            timeout=180,
        )
        assert r.returncode == 0, r.stderr
        runs[policy] = json.loads((out / "summary.json").read_text()), json.loads((out / "profile.json").read_text())
        assert (out / "topology.toml").read_text() == SLOW  # the run keeps the file it ran on
    wait, profile = runs["wait"]
    speeds = wait["worker_step_s"]
    assert speeds[1] == pytest.approx(2 * speeds[0], rel=0.3)  # measured: half the speed
    ranks = {r["rank"]: r for r in profile["ranks"]}
    assert ranks[0]["peer_wait_s"] > 0.5 * 4 * 0.06 and ranks[1]["peer_wait_s"] < ranks[0]["peer_wait_s"] / 2
    assert wait["idle_steps"] == 0 and wait["comm"]["params"]["algorithm"] == "hierarchical"
    balanced, _ = runs["balanced"]
    assert balanced["idle_steps"] >= 4  # worker 1: about half of rounds 2-4
    ranks = [
        torch.load(Path(tmp_path, "balanced", "checkpoints", "step00000016", f"rank{r}.pt"), weights_only=True)["model"]
        for r in range(3)
    ]
    assert all(torch.equal(ranks[0][k], other[k]) for other in ranks[1:] for k in ranks[0])


def test_a_run_resumes_from_its_own_copy_of_its_topology_file(tmp_path):
    """The run keeps the file it ran on; a resume after the file moved reads that copy, and one after
    the file changed is refused (its content is in the checkpoint's record)."""
    topology = tmp_path / "slow.toml"
    topology.write_text(SLOW.replace('step = "60ms"', 'step = "10ms"'))
    out = tmp_path / "run"
    base = (
        "--strategy",
        "diloco",
        "--sync-every",
        "2",
        "--workers",
        "3",
        "--wan",
        str(topology),
        "--quiet",
        "--eval-every",
        "100",
        "--checkpoint-every",
        "2",
        "--out",
        str(out),
        *TINY,
    )
    r = wansync("train", *base, "--steps", "3", timeout=180)
    assert r.returncode == 0, r.stderr
    kept = (out / "topology.toml").read_text()
    topology.unlink()  # the file moved away
    r = wansync("train", "--resume", str(out), "--steps", "4", timeout=180)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    edited = out / "topology.toml"
    edited.write_text(kept.replace('bw = "1gbit"', 'bw = "2gbit"'))
    r = wansync("train", "--resume", str(out), "--steps", "6", timeout=180)
    assert r.returncode != 0 and "changed: wan" in r.stderr
