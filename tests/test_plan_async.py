"""`wansync plan` of an asynchronous run (`async_diloco`, `planner/asynchronous.py`): lock-step DiLoCo's
wall clock where the asynchronous run is lock step (one speed, a quorum of every learner), the run's
own messages where it differs, staleness once a slow learner is merged without waiting for it, goodput
below 1 once its rounds are too stale, and one line for what a plan cannot use."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from torch import nn

import wansync as ws
from strategy_harness import rank_batch, tiny_model
from wansync.errors import ConfigError
from wansync.net.cost import collective_duration
from wansync.net.wan import parse_wan
from wansync.planner import of_name, predict, setting
from wansync.planner.asynchronous import ENVELOPE_BYTES
from wansync.planner.prediction import AsyncPrediction
from wansync.planner.tables import sparse_lines
from wansync.planner.sizes import of_module
from wansync.runner.localgroup import run_ranks

pytestmark = pytest.mark.timeout(120)


@functools.cache
def tiny() -> Any:
    """The tiny model's sizes (its first meta model costs a second: made when a test needs it, not at collection)."""
    return of_name("tiny")


LOCK_STEP = {"merge_quorum": 4, "grace": math.inf, "staleness_rule": "none"}  # every learner, every merge


def plan(capsys: Any, *argv: str) -> tuple[int, str, str]:
    from wansync.cli import main

    with pytest.raises(SystemExit) as done:
        main(["plan", *argv])
    out, err = capsys.readouterr()
    return done.value.code, out, err


def async_of(options: dict[str, Any], wan: str, step_s: float = 0.05, workers: int = 4) -> Any:
    return setting("async_diloco", options, tiny(), workers, parse_wan(wan), step_s)


def test_at_one_speed_with_a_quorum_of_all_it_is_lock_step_diloco_but_for_its_messages():
    """K = N / H rounds. Every learner starts round 1 at 0 and sends θ_m (E + 4n bytes, u seconds on its
    pair with rank 0; learner 0's take none); the merge comes with the last, at H·c + u, and its replies
    (the whole model, d seconds each) leave rank 0 one after another: learner j has it at j·d, so learner
    M−1 arrives last at every later merge, (M−1)·d after the others' replies began. Merge k is at
    k·(H·c + u) + (k−1)(M−1)·d; after the K-th every reply says stop, each learner sends its final (f:
    an envelope alone), the last final arrives (M−1)·d + f after the merge, and the last replies, an
    envelope each (e: every learner holds the last version already), reach learner M−1 (M−1)·e later:

        wall = K·H·c + K·u + K(M−1)·d + f + (M−1)·e

    DiLoCo's is K·(H·c + D), D its all-reduce. The compute is the same; what differs is the messages:
    each round the replies' serialization on rank 0's link, (M−1)·d, and u for D, and once at the end the
    finals and the last replies, f + (M−1)·e. On a LAN under long steps that is a tenth of a per cent."""
    h, n, c, m = 10, 100, 0.05, 4
    topology = parse_wan("rtt=80ms,bw=1gbit")
    s = async_of({"sync_every": h, **LOCK_STEP}, "rtt=80ms,bw=1gbit", c)
    p = predict(s, n, finish=True)
    assert isinstance(p, AsyncPrediction) and p.whole
    numel = tiny().sync_numel
    ups = {collective_duration("send", ENVELOPE_BYTES + 4 * numel, m, topology, [j, 0]) for j in range(1, m)}
    downs = {collective_duration("send", ENVELOPE_BYTES + 4 * numel, m, topology, [0, j]) for j in range(1, m)}
    (u,), (d,) = ups, downs  # one link for every pair
    f = collective_duration("send", ENVELOPE_BYTES, m, topology, [m - 1, 0])
    e = collective_duration("send", ENVELOPE_BYTES, m, topology, [0, m - 1])
    k = n // h
    assert p.wall_s == pytest.approx(k * h * c + k * u + k * (m - 1) * d + f + (m - 1) * e, rel=1e-12)
    assert p.result.staleness_shares() == {0: 1.0} and p.result.goodput == 1.0
    assert [x.steps for x in p.result.learners] == [n] * m

    diloco = predict(setting("diloco", {"sync_every": h}, tiny(), m, topology, c), n, finish=True)
    assert p.compute_s == diloco.compute_s == n * c
    exchange = (diloco.wall_s - n * c) / k  # D
    assert p.wall_s - diloco.wall_s == pytest.approx(k * (u - exchange) + k * (m - 1) * d + f + (m - 1) * e, rel=1e-9)

    lan = dict(wan="lan", step_s=0.5)  # messages of milliseconds against rounds of 5 s
    p = predict(async_of({"sync_every": h, **LOCK_STEP}, **lan), n, finish=True)
    diloco = predict(setting("diloco", {"sync_every": h}, tiny(), m, parse_wan("lan"), 0.5), n, finish=True)
    assert p.wall_s == pytest.approx(diloco.wall_s, rel=0.005)
    steady, lock_steady = (
        predict(async_of({"sync_every": h, **LOCK_STEP}, **lan)),
        predict(setting("diloco", {"sync_every": h}, tiny(), m, parse_wan("lan"), 0.5)),
    )
    assert not steady.whole and steady.wall_s == pytest.approx(lock_steady.wall_s, rel=0.005)


def _learner(rank: int, world: int, steps: int, options: dict[str, Any]) -> dict[str, Any]:
    """A learner in the trainer's loop: steps until the syncer says stop, then `finish()`."""
    model = tiny_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sync = ws.strategy("async_diloco", model, opt, **options)
    events: list[dict[str, Any]] = []
    sync.on_event(events.append)
    while sync.continues(steps):
        x, y = rank_batch(rank, sync.t)
        nn.functional.mse_loss(sync.model(x), y).backward()
        sync.step()
        sync.zero_grad()
    sync.finish()
    ledger = {k: v["bytes"] for k, v in sync.comm.snapshot().items() if k != "init"}
    merges = [e["staleness"] for e in events if e["type"] == "merge"]
    received = sum(e["received_bytes"] for e in events if e["type"] == "sync")
    return {"steps": sync.t, "ledger": ledger, "merges": merges, "received": received}


def test_the_planned_rounds_and_bytes_are_the_ones_the_strategy_makes():
    """Two learners of the real strategy (its learners, the syncer's threads, `comm.p2p`), run as the
    trainer runs them: the steps each computes, the merges, the bytes its ledger books and those of the
    versions it took are the simulation's."""
    h, steps = 4, 12
    options = {"sync_every": h, "merge_quorum": 2, "grace": math.inf, "staleness_rule": "none"}
    out = run_ranks(_learner, 2, steps, options, timeout=120)
    p = predict(setting("async_diloco", options, of_module("test", tiny_model()), 2, parse_wan("lan"), 0.01), steps)
    assert isinstance(p, AsyncPrediction)
    assert out[0]["merges"] == [list(m.staleness) for m in p.result.merges] == [[0, 0]] * (steps // h)
    for rank, ((sent, received), learner) in enumerate(zip(p.figures.bytes, p.result.learners)):
        got = out[rank]
        assert got["steps"] == learner.steps == steps
        # its contributions (the final carries no steps); rank 0 books the syncer's versions beside its own
        versions = {"versions": sum(r for _, r in p.figures.bytes)} if rank == 0 else {}
        assert got["ledger"] == {"pseudo_grads": sent, **versions}
        # the whole model in fp32, each version; the last reply none: each learner holds that version
        assert got["received"] == received == (steps // h) * 4 * 163


def test_a_slow_learner_is_merged_stale_under_a_quorum_of_fewer():
    """Speeds 1, 1, 0.5, 0.33: with a quorum of every learner each merge waits for the slowest and every
    contribution is fresh; with a quorum of 2 the fast ones go on and the slow ones' rounds arrive after
    merges they are not in."""
    wan = "uneven-speeds"
    all_of_them = predict(async_of({"sync_every": 20, **LOCK_STEP}, wan, 0.1), 200, finish=True)
    two = predict(async_of({"sync_every": 20, "merge_quorum": 2}, wan, 0.1), 200, finish=True)
    assert all_of_them.result.staleness_shares() == {0: 1.0}
    shares = two.result.staleness_shares()
    assert max(shares) > 0 and sum(shares.values()) == pytest.approx(1.0)
    assert two.wall_s < all_of_them.wall_s  # nobody waits for the slowest
    steps = [x.steps for x in two.result.learners]
    assert steps[0] > steps[2] > steps[3]  # each on its own clock


def test_a_learner_slower_than_max_staleness_allows_loses_its_rounds():
    """A merge for every contribution (quorum 1, a grace window of 1 ms): the learner at a third of the speed comes
    back several versions behind; under max_staleness 0 its rounds are dropped, computed and never
    merged, and goodput falls below 1. Under a generous bound nothing is lost."""
    options = {"sync_every": 10, "merge_quorum": 1, "grace": 1e-3}
    strict = predict(async_of({**options, "max_staleness": 0}, "uneven-speeds", 0.1), 200, finish=True)
    loose = predict(async_of({**options, "max_staleness": 100}, "uneven-speeds", 0.1), 200, finish=True)
    assert strict.result.dropped_steps > 0 and strict.result.goodput < 1
    assert loose.result.dropped_steps == 0 and loose.result.goodput == 1.0
    assert max(loose.result.staleness_shares()) > 0


def test_plan_prints_an_asynchronous_run(capsys):
    code, out, err = plan(
        capsys,
        *("--strategy", "async_diloco", "--wan", "uneven-speeds", "--workers", "4", "--steps", "200"),
        *("--sync-every", "20", "--merge-quorum", "2", "--model", "tiny", "--step-time", "0.1"),
    )
    assert code == 0, err
    for says in (
        "wall clock of the whole run, 200 steps (until the syncer has merged 4 learners x 200 steps",
        "learners' utilization (compute share of each one's wall clock): ",
        "goodput: ",
        "staleness of the merged contributions: 0: ",
        "syncer: idle ",
        "bytes per learner per run, sent (contributions) / received (versions",
        "stragglers: none wait for another: each learner on its own clock (the topology's worker speeds",
        "memory per GPU (rank 0, its learner and the syncer)",
    ):
        assert says in out, out
    code, out, err = plan(capsys, "--strategy", "async_diloco", "--wan", "cross-region", "--model", "tiny")
    assert code == 0 and "per 1000 steps (steady state: between the merges at 1/4 and 3/4" in out, err


def test_plan_strategies_all_ranks_it_and_leaves_it_out_of_workers_of_several_ranks(capsys):
    argv = ["--strategies", "all", "--model", "tiny", "--workers", "4", "--wan", "cross-region"]
    code, out, err = plan(capsys, *argv, "--step-time", "0.05", "--steps", "100")
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("| ") and " async_diloco " in line)
    assert "--sync-every " in row and "--merge-quorum 1 --grace 0.5" in row
    code, out, err = plan(capsys, *argv, "--ranks-per-worker", "2", "--step-time", "0.05")
    assert code == 0, err
    assert " async_diloco " not in out.split("Not ranked")[0]
    assert "Not ranked: async_diloco: it runs one rank per learner, and these workers have 2" in out


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--merge-quorum", "5"], "merge_quorum 5 is more than the"),
        (["--staleness-rule", "none"], "--staleness-rule changes what a run learns"),
        (["--dn-period", "2"], "--dn-period changes what a run learns"),
        (["--outer-lr", "0.5"], "--outer-lr changes what a run learns"),
        (["--ranks-per-worker", "2"], "async_diloco runs one rank per learner"),
        (["--grace", "-1"], "grace must be > 0"),
        (["--steps", "100000000", "--sync-every", "1"], "the planner simulates each learner's rounds"),
    ],
)
def test_what_an_asynchronous_plan_cannot_use_is_one_line(argv, says, capsys):
    base = ["--strategy", "async_diloco", "--model", "tiny", "--workers", "4", "--wan", "cross-region"]
    code, out, err = plan(capsys, *base, *argv)
    assert code == 1 and out == "" and err.count("\n") == 1 and says in err, err


def test_the_simulation_refuses_what_the_strategy_refuses():
    with pytest.raises(ConfigError, match="merge_quorum 3 is more than the 2 learners"):
        predict(async_of({"merge_quorum": 3}, "cross-region", workers=2), 100)


def test_plan_strategies_all_keeps_a_sparse_learner_sparse_and_prints_the_flags_that_act(capsys):
    """With --sparse the codec does nothing: it is not searched, and the row gives --sparse and the payload's
    knobs, not a --codec the command line would refuse beside it."""
    argv = ["--strategies", "all", "--model", "tiny", "--workers", "4", "--wan", "cross-region", "--step-time", "0.05"]
    for extra, shows, hides in (([], "--codec ", "--sparse"), (["--sparse"], "--sparse --density ", "--codec ")):
        code, out, err = plan(capsys, *argv, "--steps", "100", *extra)
        assert code == 0, err
        row = next(line for line in out.splitlines() if line.startswith("| ") and " async_diloco " in line)
        assert shows in row and hides not in row, row
    sparse = predict(async_of({"sync_every": 20, **LOCK_STEP, "sparse": True}, "cross-region"), 100, finish=True)
    assert "sparse payload: " in "\n".join(sparse_lines(sparse.setting))
