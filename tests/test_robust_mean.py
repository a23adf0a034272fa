"""The robust mean of pseudo-gradients (`comm.robust`, `robust_mean median`), on real gloo groups:

- the rule written out with torch alone (no wansync code) is what the exchange computes, for fp32, a
  pseudo-gradient measured from an origin, a lossy codec and a weighted mean; every rank ends bitwise alike;
- robust_mean off is the strategy as it was: no collective more, the same bits;
- with no outlier, median is off bit for bit (diloco, streaming, sparseloco);
- a worker's pseudo-gradient x 1000 (the `scale` fault) is clipped, logged as an event, and the ranks
  stay bitwise identical;
- in workers of two ranks (DDP inside, FSDP inside) the factor is the whole worker's, not a shard's;
- what cannot work is refused in one line: κ ≤ 0, not a number, κ without the robust mean, a strategy
  without it, fewer than 3 workers at κ ≥ M;
- under fault tolerance the norms travel over the quorum and the faulty worker is clipped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import wansync as ws
from cli_harness import TINY, wansync
from strategy_harness import flat_params, rank_batch, tiny_model
from wansync.comm.exchange import Exchange
from wansync.comm.replicas import replica_groups
from wansync.comm.robust import Clip, RobustMean, check_workers, clip_factors
from wansync.errors import ConfigError
from wansync.runner.localgroup import run_ranks

NORMS = [1.0, 2.0, 3.0, 100.0]  # rank r's contribution has norm NORMS[r]
KAPPA = 2.0


# ---- the rule, written with torch alone ---------------------------------------------------------------
def torch_rule(contributions: list[torch.Tensor], kappa: float) -> tuple[torch.Tensor, torch.Tensor]:
    """mean_m c_m·Δ_m with c_m = min(1, κ·median/‖Δ_m‖), the median of an even count the midpoint."""
    norms = torch.stack([c.double().norm() for c in contributions])
    s = norms.sort().values
    median = (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2
    factors = torch.where(norms > kappa * median, kappa * median / norms, torch.ones_like(norms))
    return torch.stack([f.float() * c for f, c in zip(factors, contributions)]).mean(0), factors


def contribution(rank: int, numel: int = 300) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(numel, generator=g)
    return x * (NORMS[rank] / x.norm())


def test_the_factors_are_the_rule_written_with_torch_alone():
    xs = [contribution(r) for r in range(4)]
    _, expected = torch_rule(xs, KAPPA)
    factors, _ = clip_factors([float(x.double().norm()) for x in xs], KAPPA)
    assert factors == pytest.approx(expected.tolist(), rel=1e-12)
    assert clip_factors(NORMS, KAPPA) == ([1.0, 1.0, 1.0, 2 * 2.5 / 100], 2.5)  # the last clipped to 2 x median
    # a non-finite norm (the non-finite guard's business) neither counts in the median nor is clipped
    assert clip_factors([1.0, float("nan"), 3.0, 100.0], KAPPA) == ([1.0, 1.0, 1.0, 0.06], 3.0)


# ---- four workers of one rank -------------------------------------------------------------------------
def _train(rank: int, name: str, options: dict[str, Any], steps: int, fault_at: int | None = None) -> dict[str, Any]:
    model = tiny_model(0)
    if name == "demo":  # its optimizer only carries the learning rate
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sync = ws.strategy(name, model, opt, **options)
    if fault_at is not None and rank == 1:
        sync.exchange.fault = lambda: 1000.0 if sync.t == fault_at else 1.0
    events: list[dict[str, Any]] = []
    sync.on_event(events.append)
    params = []
    for step in range(steps):
        x, y = rank_batch(rank, step)
        nn.functional.mse_loss(sync.model(x), y).backward()
        sync.step()
        sync.zero_grad()
        params.append(flat_params(model))
    sync.finish()
    return {
        "params": params,
        "final": flat_params(model),  # every rank's alike
        "clips": [e for e in events if e["type"] == "robust_clip"],
        "comm": sync.comm.snapshot(),
    }


STRATEGIES = {  # two outer steps each, and the step at which a fault strikes an outer exchange
    "diloco": ({"sync_every": 4, "outer_momentum": 0.0}, 8, 4),
    "streaming": ({"sync_every": 4, "fragments": 2, "overlap": 1}, 8, 4),
    "sparseloco": ({"sync_every": 4, "density": 0.25, "chunk": 4}, 8, 4),
}


EVERY = {  # every other strategy and exchange the robust mean covers: a fault at step 4 is clipped there
    "local_sgd": ("local_sgd", {"sync_every": 4}),
    "post_local_sgd": ("post_local_sgd", {"sync_every": 2, "switch_step": 2}),
    "slowmo": ("slowmo", {"sync_every": 4}),
    "cpdp": ("cpdp", {"sync_every": 4}),
    "cocodc": ("cocodc", {"sync_every": 4, "fragments": 2, "overlap": 1}),
    "demo": ("demo", {"density": 0.25, "chunk": 4}),
    "diloco int8, error feedback": ("diloco", {"sync_every": 4, "codec": "int8", "error_feedback": True}),
    "diloco overlap_rounds": ("diloco", {"sync_every": 4, "overlap_rounds": True}),
}


def _four_workers(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    robust = Exchange(robust=RobustMean(KAPPA))
    plain = Exchange()
    mine = contribution(rank)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    origin = torch.linspace(-1, 1, mine.numel())  # every rank holds it alike
    out["contributions"] = everyone
    out["origin"] = origin
    out["fp32"] = robust.mean(mine, "pseudo_grads", origin=0.0).wait()
    out["from_origin"] = robust.mean(origin + mine, "params", origin=origin).wait()
    out["bf16"] = robust.mean(mine, "pseudo_grads", "bf16", collective="allgather", origin=0.0).wait()
    out["weighted"] = robust.mean(mine, "pseudo_grads", origin=0.0, weight=float(rank + 1)).wait()
    out["untouched"] = torch.equal(mine, contribution(rank))  # not inplace: the caller's buffer is left alone
    out["clips"] = []
    robust.on_clip.append(lambda clips: out["clips"].append([dataclasses.asdict(c) for c in clips]))
    robust.mean(mine, "pseudo_grads", origin=0.0, replay=True)  # a replayed exchange is not logged again
    robust.mean(mine, "pseudo_grads", origin=0.0)
    out["plain"] = plain.mean(mine, "pseudo_grads").wait()
    out["plain_origin"] = plain.mean(mine, "pseudo_grads", origin=0.0).wait()
    out["ledger"] = robust.ledger.snapshot()
    for name, (options, steps, fault_at) in STRATEGIES.items():
        out[name] = {
            "default": _train(rank, name, options, steps),
            "off": _train(rank, name, {**options, "robust_mean": "off"}, steps),
            "median": _train(rank, name, {**options, "robust_mean": "median"}, steps),
            "fault": _train(rank, name, options, steps, fault_at),
            "fault_median": _train(rank, name, {**options, "robust_mean": "median"}, steps, fault_at),
        }
    for label, (name, options) in EVERY.items():
        out[label] = _train(rank, name, {**options, "robust_mean": "median"}, 8, fault_at=4)
    return out


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_ranks(_four_workers, 4, timeout=120)


def _bitwise_alike(results: list[dict[str, Any]], key: str) -> torch.Tensor:
    first = results[0][key]
    assert all(torch.equal(r[key], first) for r in results), f"{key}: the ranks differ"
    return first


def test_the_exchange_clips_as_the_rule_written_with_torch_alone_and_every_rank_alike(four):
    xs = four[0]["contributions"]
    expected, factors = torch_rule(xs, KAPPA)
    assert factors.tolist()[:3] == [1.0, 1.0, 1.0] and factors[3] < 0.1  # the outlier only
    torch.testing.assert_close(_bitwise_alike(four, "fp32"), expected, rtol=1e-5, atol=1e-6)
    origin = four[0]["origin"]
    torch.testing.assert_close(_bitwise_alike(four, "from_origin") - origin, expected, rtol=1e-5, atol=1e-5)
    # bf16: each clipped contribution quantized, then averaged
    bf16 = torch_rule([x for x in xs], KAPPA)[1]
    quantized = torch.stack([(f.float() * x).bfloat16().float() for f, x in zip(bf16, xs)]).mean(0)
    torch.testing.assert_close(_bitwise_alike(four, "bf16"), quantized, rtol=1e-5, atol=1e-6)
    # weighted (a slow policy's steps): the clip comes before the weight, Σ w·c·Δ / Σ w
    w = torch.arange(1.0, 5.0)
    weighted = (torch.stack([wi * f.float() * x for wi, f, x in zip(w, factors, xs)]).sum(0)) / w.sum()
    torch.testing.assert_close(_bitwise_alike(four, "weighted"), weighted, rtol=1e-5, atol=1e-6)
    assert all(r["untouched"] for r in four)


def test_every_clip_is_told_once_with_its_worker_and_factor(four):
    for r in four:
        (clips,) = r["clips"]  # the replayed exchange told nothing
        (fields,) = clips
        clip = Clip(**fields)
        assert (clip.worker, clip.kappa) == (3, KAPPA) and clip.median == pytest.approx(2.5, rel=1e-6)
        assert clip.norm == pytest.approx(100.0, rel=1e-6) and clip.factor == pytest.approx(0.05, rel=1e-6)
        assert "worker 3's pseudo-gradient clipped by 0.05 (norm 1e+02 > 2 x median 2.5)" in clip.line(7)
        assert r["ledger"]["robust_norms"]["bytes"] == 8 * r["ledger"]["robust_norms"]["calls"]


def test_a_mean_of_pseudo_gradients_without_the_robust_mean_is_the_plain_mean(four):
    for r in four:
        assert torch.equal(r["plain_origin"], r["plain"])


def _calls_and_bytes(comm: dict[str, dict[str, Any]]) -> dict[str, tuple[int, int]]:
    return {purpose: (v["calls"], v["bytes"]) for purpose, v in comm.items()}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_robust_mean_off_is_the_strategy_as_it_was(four, name):
    for r in four:
        default, off = r[name]["default"], r[name]["off"]
        assert all(torch.equal(a, b) for a, b in zip(default["params"], off["params"]))
        assert _calls_and_bytes(default["comm"]) == _calls_and_bytes(off["comm"])
        assert "robust_norms" not in off["comm"]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_with_no_outlier_median_is_off_bit_for_bit(four, name):
    for r in four:
        off, median = r[name]["off"], r[name]["median"]
        assert median["clips"] == []
        assert all(torch.equal(a, b) for a, b in zip(off["params"], median["params"]))
        assert median["comm"]["robust_norms"]["calls"] > 0


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_worker_whose_pseudo_gradient_went_wrong_is_clipped_and_logged(four, name):
    fault_at = STRATEGIES[name][2]
    assert all(torch.equal(r[name]["fault_median"]["final"], four[0][name]["fault_median"]["final"]) for r in four)
    clips = four[0][name]["fault_median"]["clips"]
    assert clips and {c["worker"] for c in clips} == {1} and {c["step"] for c in clips} == {fault_at}
    assert all(c["factor"] < 0.01 and c["norm"] > 2 * c["median"] for c in clips)
    assert all(r[name]["fault_median"]["clips"] == clips for r in four)  # every rank tells the same story
    healthy = four[0][name]["off"]["final"]
    damage = {run: float((four[0][name][run]["final"] - healthy).norm()) for run in ("fault", "fault_median")}
    assert damage["fault_median"] < damage["fault"] / 10, damage


# ---- two workers of two ranks -------------------------------------------------------------------------
WORKERS = [[1.0, 1.0], [10.0, 0.1]]  # per worker, the value of each of its two halves (its shards)


def _two_by_two(rank: int, world: int, shard_inside: bool) -> torch.Tensor:
    replicas = replica_groups(2, shard_inside=shard_inside)
    exchange = Exchange(replicas=replicas, robust=RobustMean(1.0))  # κ = 1: two workers can be told apart
    halves = [torch.full((6,), v) for v in WORKERS[replicas.worker]]
    mine = halves[replicas.local_rank] if shard_inside else torch.cat(halves)
    return exchange.mean(mine, "pseudo_grads", origin=0.0).wait()


@pytest.mark.parametrize("shard_inside", [False, True], ids=["ddp_inside", "fsdp_inside"])
def test_in_workers_of_two_ranks_the_factor_is_the_whole_workers(shard_inside):
    wholes = [torch.cat([torch.full((6,), v) for v in w]) for w in WORKERS]
    expected, factors = torch_rule(wholes, 1.0)
    assert factors[0] == 1.0 and factors[1] < 1.0  # (a shard's own norms would clip worker 0's second half)
    means = run_ranks(_two_by_two, 4, shard_inside, timeout=90)
    for rank, mean in enumerate(means):
        want = expected[6 * (rank % 2) : 6 * (rank % 2) + 6] if shard_inside else expected
        torch.testing.assert_close(mean, want, rtol=1e-6, atol=1e-6)


# ---- refusals, one line each --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, says",
    [
        ({"robust_mean": "median", "robust_kappa": 0}, "robust_kappa must be > 0, got 0.0"),
        ({"robust_mean": "median", "robust_kappa": -1.5}, "robust_kappa must be > 0, got -1.5"),
        ({"robust_mean": "median", "robust_kappa": "two"}, "robust_kappa must be a number, got 'two'"),
        ({"robust_mean": "median", "robust_kappa": float("inf")}, "robust_kappa must be > 0, got inf"),
        ({"robust_kappa": 3.0}, "robust_kappa 3 is the robust mean's clip, and robust_mean is off"),
        ({"robust_mean": "trimmed"}, "robust_mean must be off or median, got 'trimmed'"),
    ],
)
def test_the_api_refuses_in_one_line(options, says):
    model = tiny_model(0)
    with pytest.raises(ConfigError) as e:
        ws.strategy("diloco", model, torch.optim.SGD(model.parameters(), lr=0.1), **options)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_strategy_without_the_robust_mean_is_named():
    model = tiny_model(0)
    with pytest.raises(ConfigError, match="strategy ddp has no option 'robust_mean'"):
        ws.strategy("ddp", model, torch.optim.SGD(model.parameters(), lr=0.1), robust_mean="median")


def test_what_cannot_clip_or_cannot_run_is_refused():
    with pytest.raises(ConfigError, match="cannot clip anything with 2 workers at robust_kappa 2"):
        check_workers(2, 2.0)
    check_workers(2, 1.5)  # the larger of two is clipped to 1.5 x their midpoint
    check_workers(3, 2.0)


def test_under_fault_tolerance_the_quorums_members_norms_clip_the_faulty_worker(tmp_path):
    """The norms travel over the quorum (each with its worker's number): worker 1's pseudo-gradient
    x 1000 at step 4 is clipped, logged once with its number, and the run ends well, every worker
    with the same parameters."""
    import json
    import os

    out = tmp_path / "ft"
    args = ["train", "--strategy", "diloco", "--sync-every", "2", "--workers", "3", "--steps", "6", *TINY]
    done = wansync(
        *args,
        "--fault-tolerant",
        "--robust-mean",
        "median",
        "--eval-every",
        "100",
        "--out",
        str(out),
        env={**os.environ, "WANSYNC_FAULT": "rank=1,step=4,action=scale,factor=1000"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    clips = [e for e in events if e.get("type") == "robust_clip"]
    assert [(c["worker"], c["step"]) for c in clips] == [(1, 4)], clips
    assert clips[0]["factor"] < 0.01
    assert "worker 1's pseudo-gradient clipped by" in done.stdout + done.stderr


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--robust-mean", "median", "--robust-kappa", "0"], "robust_kappa must be > 0, got 0"),
        (["--robust-mean", "median", "--robust-kappa", "two"], "two"),
        (["--robust-kappa", "3"], "robust_mean is off, so it would do nothing"),
        (["--strategy", "ddp", "--robust-mean", "median"], "ddp has no option robust_mean"),
        (["--workers", "2", "--robust-mean", "median"], "cannot clip anything with 2 workers"),
    ],
)
def test_the_cli_refuses_in_one_line(tmp_path, flags, says):
    args = ["train", "--strategy", "diloco", "--workers", "4", "--steps", "2", *TINY, "--out", str(tmp_path / "r")]
    done = wansync(*args, *flags)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_a_strategy_with_the_robust_mean_declares_both_options():
    from wansync import strategies

    for name in (
        "local_sgd",
        "post_local_sgd",
        "slowmo",
        "cpdp",
        "diloco",
        "streaming",
        "cocodc",
        "sparseloco",
        "demo",
    ):
        options = strategies.make_options(name, robust_mean="median", robust_kappa=1.5)
        assert dataclasses.asdict(options)["robust_kappa"] == 1.5


@pytest.mark.parametrize("label", list(EVERY))
def test_every_strategy_with_pseudo_gradients_clips_the_faulty_worker(four, label):
    clips = [c for c in four[0][label]["clips"] if c["step"] == 4]  # (demo's per-step gradients on these
    assert [c["worker"] for c in clips] == [1] and clips[0]["factor"] < 0.01  # skewed data: worker 3's, later)
    assert all(torch.equal(r[label]["final"], four[0][label]["final"]) for r in four)
