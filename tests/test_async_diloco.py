"""Asynchronous DiLoCo: its identity with lock-step DiLoCo, each staleness rule against the same rule
written with torch alone, and what it refuses.

The merges are held against hand-written rules through the syncer itself (`strategies/syncer.py`, the
strategy's merge), fed contributions of staleness 0, 1 and 2; the identity runs the whole strategy,
learners and the syncer's threads, in two gloo processes.
"""

from __future__ import annotations

import json
import re
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import wansync as ws
from async_learner_life import padded_step
from strategy_harness import flat_params, rank_batch, tiny_model
from wansync.errors import ConfigError
from wansync.runner.localgroup import run_ranks
from wansync.strategies.syncer import Contribution, Settings, Syncer

H, ROUNDS = 4, 3


def _train(
    rank: int, world: int, name: str, options: dict[str, Any], steps: int, make: Any = tiny_model
) -> dict[str, Any]:
    model = make(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sync = ws.strategy(name, model, opt, **options)
    events: list[dict[str, Any]] = []
    sync.on_event(events.append)
    snapshots = []
    for step in range(steps):
        x, y = rank_batch(rank, step)
        nn.functional.mse_loss(sync.model(x), y).backward()
        sync.step()
        sync.zero_grad()
        snapshots.append(flat_params(model))
    sync.finish()
    ledger = {k: v["bytes"] for k, v in sync.comm.snapshot().items() if k != "init"}
    return {"params": snapshots, "final": flat_params(model), "events": events, "ledger": ledger}


def _both(rank: int, world: int) -> dict[str, Any]:
    steps = H * ROUNDS
    lock = _train(rank, world, "diloco", {"sync_every": H}, steps)
    free = _train(
        rank,
        world,
        "async_diloco",
        {"sync_every": H, "merge_quorum": world, "grace": math.inf, "staleness_rule": "none"},
        steps,
    )
    return {"diloco": lock, "async": free}


def test_at_one_speed_with_a_quorum_of_all_and_no_correction_it_is_lock_step_diloco_bit_for_bit():
    out = run_ranks(_both, 2, timeout=120)
    for rank in range(2):
        lock, free = out[rank]["diloco"], out[rank]["async"]
        for step, (a, b) in enumerate(zip(lock["params"], free["params"])):
            assert torch.equal(a, b), f"rank {rank} differs from diloco after step {step + 1}"
        assert torch.equal(lock["final"], free["final"])
    assert torch.equal(out[0]["async"]["final"], out[1]["async"]["final"])
    syncs = [e for e in out[0]["async"]["events"] if e["type"] == "sync" and not e["final"]]
    assert [e["version"] for e in syncs] == [1, 2, 3] and all(e["behind"] == 0 for e in syncs)
    merges = [e for e in out[0]["async"]["events"] if e["type"] == "merge"]
    assert [m["learners"] for m in merges] == [[0, 1]] * ROUNDS and all(m["staleness"] == [0, 0] for m in merges)


# ---- the staleness rules, by hand ---------------------------------------------------------------
LR, BETA = 0.7, 0.9


def _settings(rule: str, **kw: Any) -> Settings:
    base = dict(learners=2, quorum=1, grace_s=0.0, max_staleness=4, rule=rule, outer_lr=LR, outer_momentum=BETA)
    return Settings(**(base | kw))


def _script(seed: int = 0) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    """θ̃_0 and three merges, each one contribution: (its base, its θ_m). Bases 0, 0, 0 give the
    merges staleness 0, 1 and 2."""
    g = torch.Generator().manual_seed(seed)
    theta0 = torch.randn(10, generator=g)
    return theta0, [(0, theta0 + 0.1 * torch.randn(10, generator=g)) for _ in range(3)]


def _merge_all(rule: str, **kw: Any) -> list[torch.Tensor]:
    theta0, script = _script()
    syncer = Syncer([theta0.clone()], [], _settings(rule, **kw))
    out = []
    for i, (base, values) in enumerate(script):
        assert syncer.add(Contribution(i % 2, base, tokens=8, steps=8, values=values))
        merged = syncer.merge()
        assert merged.staleness == [i]
        out.append(syncer.value.clone())
    return out


def _nesterov(theta: torch.Tensor, m: torch.Tensor | None, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.optim.SGD's Nesterov step written out: m ← β·m + g (m = g the first time); θ ← θ − lr·(g + β·m)."""
    m = g.clone() if m is None else BETA * m + g
    return theta - LR * (g + BETA * m), m


def test_no_correction_applies_each_stale_pseudo_gradient_against_its_own_base():
    theta0, script = _script()
    history = {0: theta0}
    theta, m = theta0, None
    for i, (base, values) in enumerate(script):
        theta, m = _nesterov(theta, m, history[base] - values)
        history[i + 1] = theta
    got = _merge_all("none")
    torch.testing.assert_close(got[-1], theta, rtol=0, atol=1e-6)


def test_polynomial_scales_each_pseudo_gradient_by_one_plus_its_staleness_to_the_minus_half():
    theta0, script = _script()
    theta, m = theta0, None
    for tau, (base, values) in enumerate(script):
        theta, m = _nesterov(theta, m, (1 + tau) ** -0.5 * (theta0 - values))
    got = _merge_all("polynomial")
    torch.testing.assert_close(got[-1], theta, rtol=0, atol=1e-6)


@pytest.mark.parametrize("period", [1, 2, 3])
def test_delayed_nesterov_is_liu_et_al_algorithm_3(period):
    theta0, script = _script()
    theta, m, buf = theta0.clone(), torch.zeros(10), torch.zeros(10)
    for t, (base, values) in enumerate(script):
        g = theta0 - values
        buf = buf + g
        if (t + 1) % period == 0:
            m = BETA * m + buf / period
            theta = theta - LR * (BETA * m + g / period)
            buf = torch.zeros(10)
        else:
            theta = theta - LR * (g / period)
    got = _merge_all("delayed_nesterov", dn_period=period)
    torch.testing.assert_close(got[-1], theta, rtol=0, atol=1e-6)


def test_delayed_nesterov_with_a_period_of_one_is_nesterov_itself():
    torch.testing.assert_close(
        _merge_all("delayed_nesterov", dn_period=1)[-1], _merge_all("none")[-1], rtol=0, atol=1e-6
    )


def test_a_merge_weights_contributions_by_tokens_and_drops_what_is_too_stale():
    theta0 = torch.zeros(4)
    syncer = Syncer([theta0.clone()], [], _settings("none", outer_momentum=0.0, outer_lr=1.0, max_staleness=1))
    assert syncer.add(Contribution(0, 0, tokens=30, steps=3, values=torch.full((4,), 1.0)))
    assert syncer.add(Contribution(1, 0, tokens=10, steps=1, values=torch.full((4,), 5.0)))
    syncer.merge()
    torch.testing.assert_close(syncer.value, torch.full((4,), 0.75 * 1.0 + 0.25 * 5.0))
    for _ in range(2):
        assert syncer.add(Contribution(0, syncer.version, tokens=1, steps=1, values=torch.zeros(4)))
        syncer.merge()
    assert not syncer.add(Contribution(1, 0, tokens=10, steps=1, values=torch.ones(4)))
    assert syncer.tally.dropped_tokens == 10


def test_the_quorum_and_the_grace_window_decide_when_a_merge_is_due():
    syncer = Syncer([torch.zeros(2)], [], _settings("none", learners=3, quorum=2, grace_s=1.0))
    assert not syncer.due(0.0, alive=3)
    syncer.add(Contribution(0, 0, 1, 1, torch.ones(2)))
    assert not syncer.due(0.0, alive=3)  # below the quorum
    syncer.add(Contribution(1, 0, 1, 1, torch.ones(2)))
    assert not syncer.due(10.0, alive=3)  # the quorum is in: the grace window opens
    assert syncer.wait_s(10.5) == pytest.approx(0.5)
    assert syncer.due(11.0, alive=3)
    assert syncer.due(10.0, alive=2)  # every learner alive has arrived: no window


# ---- what it refuses -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, says",
    [
        ({"merge_quorum": 0}, "merge_quorum must be >= 1"),
        ({"grace": 0.0}, "grace must be > 0 \\(inf: unbounded\\)"),
        ({"grace": -1.0}, "grace must be > 0"),
        ({"max_staleness": -1}, "max_staleness must be >= 0"),
        ({"staleness_rule": "heloco"}, "staleness_rule must be one of"),
        ({"staleness_rule": "none", "dn_period": 4}, "dn_period 4 is delayed Nesterov's period"),
    ],
)
def test_bad_settings_are_one_line_each(options, says):
    from wansync.strategies import make_options

    with pytest.raises(ConfigError, match=says):
        make_options("async_diloco", **options)


# ---- a learner stopped mid-run (SIGSTOP) stops no one ---------------------------------------------
STOP_S, STEP_S = 3.0, 0.02


def _stopped_learner(rank: int, world: int, stop_at: int | None) -> dict[str, Any]:
    """Four learners, learner 3 stopped for STOP_S at its step `stop_at` (None: no fault); every step
    padded to STEP_S, as an emulated speed."""
    import os
    import signal
    import subprocess
    import time

    model = tiny_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sync = ws.strategy("async_diloco", model, opt, sync_every=5, merge_quorum=2, grace=0.3, max_staleness=2)
    events: list[dict[str, Any]] = []
    sync.on_event(events.append)
    began = time.perf_counter()
    while sync.continues(60):
        if rank == 3 and sync.t == stop_at:  # a helper process continues it: a stopped process cannot
            subprocess.Popen(["sh", "-c", f"sleep {STOP_S}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        padded_step(sync, rank, STEP_S)
    sync.finish()
    return {"events": events, "final": flat_params(model), "steps": sync.t, "wall": time.perf_counter() - began}


def _merge_gaps(events: list[dict[str, Any]]) -> list[float]:
    times = [e["time"] for e in events if e["type"] == "merge"]
    return [b - a for a, b in zip(times, times[1:])]


def test_a_learner_stopped_for_seconds_stops_no_one_and_its_stale_round_is_dropped():
    calm, stormy = (run_ranks(_stopped_learner, 4, stop_at, timeout=120) for stop_at in (None, 10))
    for out in (calm, stormy):
        assert all(torch.equal(out[0]["final"], o["final"]) for o in out)  # every learner ends on one model
    summary = {o["type"]: o for o in stormy[0]["events"]}["syncer"]
    calm_summary = {o["type"]: o for o in calm[0]["events"]}["syncer"]
    assert calm_summary["goodput"] == 1.0 and summary["goodput"] < 1.0  # the stopped learner's round was dropped
    assert summary["dropped_tokens"] > 0
    # the others trained on: no round of theirs waited anywhere near the stop
    for rank in range(3):
        waits = [e["waited_s"] for e in stormy[rank]["events"] if e["type"] == "sync" and not e["final"]]
        assert max(waits) < STOP_S / 2, (rank, waits)
    # versions went on being published: no gap near the stop (grace window plus a round or two)
    assert max(_merge_gaps(stormy[0]["events"])) < STOP_S / 2
    assert stormy[3]["steps"] < stormy[0]["steps"]  # the stopped learner did less of the run's work


# ---- a learner killed mid-round and restarted --------------------------------------------------------
def _killed_and_restarted(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Learners 0-2 train here; learner 3's place is taken by two lives in processes of their own
    (`_two_lives`), the first killed (SIGKILL) mid-round, the second joining the run. Rank 3 steps aside:
    it names the syncer to the test and waits for the lives' end."""
    import os
    import time

    from async_learner_life import OPTIONS, RUN_STEPS, STEP_S

    model = tiny_model(0)
    sync = ws.strategy("async_diloco", model, torch.optim.AdamW(model.parameters(), lr=0.01), **OPTIONS)
    events: list[dict[str, Any]] = []
    sync.on_event(events.append)
    if rank == 3:
        sync.channel.close()
        Path(f"{tmp}/join.part").write_text(sync.syncer_address)
        os.replace(f"{tmp}/join.part", f"{tmp}/join")
        deadline = time.monotonic() + 150
        while not os.path.exists(f"{tmp}/lives.done") and time.monotonic() < deadline:
            time.sleep(0.05)
        return {}
    deadline = time.monotonic() + 90
    second_in = lambda: os.path.exists(f"{tmp}/second.json.synced") or time.monotonic() > deadline  # noqa: E731
    while sync.continues(RUN_STEPS) or not second_in():  # past the budget until learner 3's second life is in
        padded_step(sync, rank, STEP_S)
    sync.finish()
    waits = [e["waited_s"] for e in events if e["type"] == "sync" and not e["final"]]
    final = flat_params(model)
    return {"events": events, "waits": waits, "final_sum": float(final.double().sum()), "steps": sync.t}


def _life(env: dict[str, str], learner: int, out: str) -> None:
    """One life of learner `learner` (async_learner_life.py) in a process forked from the ranks' forkserver,
    as a launcher's zygote forks a restarted worker: torch imported already, not a fresh interpreter's seconds."""
    import os

    from async_learner_life import main

    os.environ.update(env)
    main(learner, out)


def _two_lives(tmp: Path, ranks: Any) -> tuple[int | None, int | None]:
    """Learner 3's lives, once rank 3 names the syncer: the first killed into its second round, the second
    run to the end; their exit statuses."""
    from async_learner_life import STEP_S
    from wansync.runner.localgroup import rank_context
    from wansync.strategies.async_diloco import JOIN_ENV, LEARNER_ENV

    deadline = time.monotonic() + 60
    while not (tmp / "join").exists():
        assert time.monotonic() < deadline and not ranks.done(), "rank 3 never named the syncer"
        time.sleep(0.02)
    env = {JOIN_ENV: (tmp / "join").read_text(), LEARNER_ENV: "3"}
    first = rank_context().Process(target=_life, args=(env, 3, f"{tmp}/first.json"))
    first.start()
    while not (tmp / "first.json.synced").exists() and time.monotonic() < deadline and first.is_alive():
        time.sleep(0.02)
    time.sleep(3 * STEP_S)  # into its second round
    first.kill()
    first.join()
    second = rank_context().Process(target=_life, args=(env, 3, f"{tmp}/second.json"))
    second.start()
    second.join(90)
    if second.exitcode is None:
        second.kill()
        second.join()
    return first.exitcode, second.exitcode


def test_a_learner_killed_mid_round_and_restarted_takes_the_newest_version_and_contributes_again(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        ranks = pool.submit(run_ranks, _killed_and_restarted, 4, str(tmp_path), timeout=150)
        try:
            first, second_life = _two_lives(tmp_path, ranks)
        finally:
            (tmp_path / "lives.done").touch()
        out = ranks.result()
    assert first != 0 and second_life == 0  # killed, then a whole second life
    second = json.loads((tmp_path / "second.json").read_text())
    syncs = [e for e in second["events"] if e["type"] == "sync" and not e["final"]]
    assert syncs and syncs[0]["based_on"] > 0  # it started from the run's version, not from scratch
    merges = [e for e in out[0]["events"] if e["type"] == "merge"]
    assert any(3 in m["learners"] for m in merges if m["version"] > syncs[0]["based_on"])  # and contributed again
    assert (
        second["final_sum"] == pytest.approx(out[0]["final_sum"], abs=0) and out[1]["final_sum"] == out[0]["final_sum"]
    )
    for rank in range(3):  # the others never stopped for it
        assert max(out[rank]["waits"]) < 2.0, out[rank]["waits"]
    summary = next(e for e in out[0]["events"] if e["type"] == "syncer")
    assert 0 < summary["goodput"] <= 1.0


# ---- settings that disagree, a syncer that stops, what the command line refuses -------------------------
def _disagreeing(rank: int, world: int) -> str:
    model = tiny_model(0)
    try:
        ws.strategy("async_diloco", model, torch.optim.AdamW(model.parameters()), grace=0.5 if rank == 0 else 0.25)
    except ConfigError as e:
        return str(e)
    return ""


def test_learners_started_with_other_settings_than_the_syncers_are_refused_in_one_line():
    out = run_ranks(_disagreeing, 2, timeout=60)
    assert out[0] == ""
    assert "learner 1 was started with other settings than the syncer's: grace 0.25 here, 0.5 at the syncer" in out[1]
    assert "\n" not in out[1]


def _syncer_stops(rank: int, world: int) -> str:
    from wansync.errors import PeerError

    model = tiny_model(0)
    sync = ws.strategy("async_diloco", model, torch.optim.AdamW(model.parameters()), sync_every=2, merge_quorum=2)
    try:
        for step in range(20):
            if rank == 0 and step == 5:  # the syncer's process goes away mid-run
                sync.service.close()
                sync.channel.close()
                return "stopped"
            x, y = rank_batch(rank, step)
            nn.functional.mse_loss(sync.model(x), y).backward()
            sync.step()
            sync.zero_grad()
    except PeerError as e:
        return str(e)
    return "trained on"


def test_a_syncer_that_stops_ends_each_learner_in_one_line():
    out = run_ranks(_syncer_stops, 2, timeout=60)
    assert out[0] == "stopped" and "the syncer" in out[1] and "\n" not in out[1], out


def test_on_the_command_line_a_learner_that_dies_stops_no_one_and_comes_back(tmp_path):
    """`wansync train --max-restarts 1`: learner 2 of 3 kills itself (SIGKILL) in its second round, while the
    others pause 6 s a little later. The launcher says so in one line and starts it again into the running
    run: the syncer welcomes it, its data and step count go on from its last contribution, and it contributes
    again. The run ends 0 with its summary (figures averaged without a collective: the learners' own, sent
    with their contributions), the same final model on every learner, and nothing left behind."""
    from cli_harness import TINY, no_process_left, wansync

    out = tmp_path / "run"
    flags = ("--workers", "3", "--steps", "12", "--sync-every", "3", "--merge-quorum", "2", "--grace", "0.5")
    faults = ";".join(["rank=2,step=5,action=kill", *(f"rank={r},step=7,action=pause,seconds=6" for r in (0, 1))])
    r = wansync(
        "train", "--strategy", "async_diloco", *flags, "--max-restarts", "1", "--quiet", "--out", str(out), *TINY,
        env={"WANSYNC_FAULT": faults}, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if "rank 2" in line or "learner 2" in line]
    joined = re.compile(r"wansync: syncer: learner 2 joined the running run at version [1-9]\d*")
    assert len(lines) == 3 and sum(bool(joined.fullmatch(line)) for line in lines) == 1, r.stderr
    assert {"wansync: rank 2 was killed by SIGKILL; restarted (1 of 1): it rejoins the run",
            "wansync: syncer: learner 2 left (the learner closed the connection); the others go on"} < set(lines)  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    run = summary["asynchronous"]
    assert run["versions"] > 0 and run["joins"] == 1 and summary["bytes_sent"] > 0
    assert all(s > 0 for s in summary["worker_step_s"])
    final = sorted((out / "checkpoints").glob("step*"))[-1]
    states = [torch.load(final / f"rank{r}.pt", weights_only=False) for r in (0, 1, 2)]
    assert all(torch.equal(states[0]["model"][k], s["model"][k]) for s in states[1:] for k in states[0]["model"])
    version = int(next(line for line in lines if joined.fullmatch(line)).rsplit(" ", 1)[-1])
    merges = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"merge"' in x]
    assert any(2 in m["learners"] for m in merges if m["version"] > version), "its new life contributed"
    assert states[2]["strategy"]["life_start"] == 3, "its steps (and data) went on from its last contribution's"
    assert states[2]["strategy"]["t"] > 3
    assert no_process_left(out)


def test_a_run_whose_syncer_died_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    """`--checkpoint-every 4`: each learner saves its own steps (no barrier), rank 0's with the syncer's state.
    Rank 0, the syncer's process, killed at step 7 ends the run in one line; `--resume` restores the syncer
    (its version, outer momentum, tally) and every learner rejoins it. With a quorum of both and an unbounded
    grace window the run is lock-step, so the resumed run ends on the uninterrupted run's model bit for bit,
    and its versions go on from the checkpoint's."""
    from cli_harness import TINY, no_process_left, wansync

    flags = ("--strategy", "async_diloco", "--workers", "2", "--steps", "12", "--sync-every", "2",
             "--merge-quorum", "2", "--grace", "inf", "--checkpoint-every", "4", "--quiet", *TINY)  # fmt: skip
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert wansync("train", *flags, "--out", str(whole), timeout=120).returncode == 0
    r = wansync("train", *flags, "--out", str(cut), env={"WANSYNC_FAULT": "rank=0,step=7,action=kill"}, timeout=120)
    lines = [line for line in r.stderr.splitlines() if not line.startswith("wansync: warning:")]
    assert r.returncode != 0 and lines == ["wansync: error: rank 0 was killed by SIGKILL"], r.stderr
    assert sorted(d.name for d in (cut / "checkpoints").iterdir())[0] == "step00000004"
    r = wansync("train", "--resume", str(cut), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    states = [
        torch.load(sorted((d / "checkpoints").glob("step*"))[-1] / "rank1.pt", weights_only=False) for d in (whole, cut)
    ]
    assert all(torch.equal(states[0]["model"][k], states[1]["model"][k]) for k in states[0]["model"])
    versions = [json.loads(x)["version"] for x in (cut / "metrics.jsonl").read_text().splitlines() if '"merge"' in x]
    assert versions == list(range(1, len(versions) + 1)) and len(versions) >= 6, versions  # 2 before the cut, then on
    summary = json.loads((cut / "summary.json").read_text())["asynchronous"]
    assert summary["joins"] == 0 and summary["versions"] == versions[-1] and 0 < summary["goodput"] <= 1
    assert no_process_left(cut)


class _Process:
    """What the launcher reads of a worker: `poll()`, its exit status (None: running)."""

    def __init__(self, code: int | None = None):
        self.code = code

    def poll(self) -> int | None:
        return self.code


def test_the_launcher_restarts_a_learner_only_into_a_running_run_and_at_most_max_restarts_times(tmp_path):
    """`Launch.restart_learner`: not before the syncer listens (no logs/syncer.address yet), never once rank 0
    (the syncer's process) has ended, at most --max-restarts times; each time with the syncer's address and
    the learner's number in the new life's environment (`async_diloco.JOIN_ENV`, `LEARNER_ENV`); under torchrun
    wansync's --max-restarts is refused in one line (its agent restarts every node's workers)."""
    from wansync.config import Config
    from wansync.errors import ConfigError
    from wansync.runner.launch import Launch
    from wansync.runner.run import check_restarts_under_torchrun

    launch = Launch(Config(strategy="async_diloco", workers=3, max_restarts=1), tmp_path, "", False)
    started: list[tuple[int, str]] = []
    launch.start = lambda rank, restarted=False, join="": started.append((rank, join)) or _Process()  # type: ignore[method-assign]
    launch.procs = [_Process(), _Process(-9), _Process(-9)]
    (tmp_path / "logs").mkdir()
    assert launch.restarts_learners() and launch.survivable() == {1, 2}
    assert launch.restart_learner(1) == (
        None, "not restarted: the run's syncer was not listening yet; the others go on without it"
    )  # fmt: skip
    (tmp_path / "logs" / "syncer.address").write_text("127.0.0.1:41234\n")
    proc, line = launch.restart_learner(1)
    assert proc is not None and line == "restarted (1 of 1): it rejoins the run" and started == [(1, "127.0.0.1:41234")]
    assert launch.restart_learner(1) == (None, "the others go on without it (--max-restarts 1 spent)")
    launch.procs[0] = _Process(0)
    assert launch.restart_learner(2) == (None, "not restarted: the run's syncer (rank 0) has ended")
    assert len(started) == 1
    with pytest.raises(ConfigError, match="^--max-restarts: under torchrun a dead async_diloco learner"):
        check_restarts_under_torchrun(Config(strategy="async_diloco", workers=3, max_restarts=1))


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--merge-quorum", "3"], "merge_quorum 3 is more than the run's 2 workers"),
        (["--merge-quorum", "0"], "merge_quorum must be >= 1"),
        (["--grace", "0"], "grace must be > 0"),
        (["--max-staleness", "-1"], "max_staleness must be >= 0"),
        (["--ranks-per-worker", "2"], "async_diloco runs one rank per learner"),
        (["--fault-tolerant"], "--fault-tolerant does not support async_diloco"),
        (["--adapt", "exposed=5%", "--wan", "cross-region"], "--adapt tunes lock-step rounds"),
    ],
)
def test_what_it_cannot_honour_is_one_line_before_any_work(tmp_path, flags, says):
    from cli_harness import wansync

    r = wansync(
        "train", "--strategy", "async_diloco", "--workers", "2", "--steps", "1", *flags, "--out", str(tmp_path / "r")
    )
    assert r.returncode != 0 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ---- the sparse payload (SparseLoCo's, error-fed) --------------------------------------------------------
LOCK_STEP = {"merge_quorum": 2, "grace": math.inf, "staleness_rule": "none"}


def _normed_model(seed: int = 0) -> nn.Module:
    """The tiny model with BatchNorm statistics: float buffers, which travel beside the sparse payload."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _wide_model(seed: int = 0) -> nn.Module:
    """A 128 x 128 layer among small ones: 64 x 64 blocks, SparseLoCo's, where the default density sends 32 values
    of each 4096."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 3))


def _dense_and_sparse(rank: int, world: int) -> dict[str, Any]:
    steps, options = H * ROUNDS, {"sync_every": H, **LOCK_STEP}
    whole = {"sparse": True, "density": 1.0, "bits": 32, "error_decay": 0.0}  # every value, unquantized, no memory
    return {
        "dense": _train(rank, world, "async_diloco", options, steps, _normed_model),
        "sparse": _train(rank, world, "async_diloco", {**options, **whole}, steps, _normed_model),
    }


def test_the_sparse_payload_of_every_value_unquantized_without_error_memory_trains_what_the_dense_one_does():
    """Density 1, 32-bit values, error_decay 0: the payload carries Δ_m = θ̃_b − θ_m whole and the syncer merges
    it against its base; the dense fp32 learner sends θ_m and the syncer averages it (DiLoCo's boundary).
    Within rounding at every step, BatchNorm's statistics (sent beside the payload) included."""
    out = run_ranks(_dense_and_sparse, 2, timeout=120)
    for rank in range(2):
        dense, sparse = out[rank]["dense"], out[rank]["sparse"]
        for step, (a, b) in enumerate(zip(dense["params"], sparse["params"])):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=lambda m, s=step: f"rank {rank}, step {s + 1}: {m}")
        torch.testing.assert_close(sparse["final"], dense["final"], rtol=0, atol=1e-6)
        syncs = [e for e in sparse["events"] if e["type"] == "sync" and not e["final"]]
        assert [e["version"] for e in syncs] == [1, 2, 3] and all(e["codec"] == "sparse" for e in syncs)
        assert not torch.equal(dense["params"][-1], dense["params"][0])  # it trained
    assert torch.equal(out[0]["sparse"]["final"], out[1]["sparse"]["final"])


def _sparse_learners(rank: int, world: int) -> dict[str, Any]:
    return _train(rank, world, "async_diloco", {"sync_every": H, **LOCK_STEP, "sparse": True}, H * ROUNDS, _wide_model)


def test_a_sparse_learner_books_the_payloads_wire_bytes_a_few_per_cent_of_fp32():
    """At SparseLoCo's defaults (density 32/4096, 2-bit values) each round's contribution is the sparse codec's
    payload, byte for byte: the sync events' bytes, the learner's ledger (`pseudo_grads`), the planner's."""
    from wansync.net.wan import parse_wan
    from wansync.planner import predict, setting
    from wansync.planner.sizes import of_module
    from wansync.strategies import make_options
    from wansync.strategies.async_diloco import AsyncDiLoCo

    options = {"sync_every": H, **LOCK_STEP, "sparse": True}
    model = _wide_model(0)
    numel = sum(p.numel() for p in model.parameters())
    codec = AsyncDiLoCo.wire_codec(make_options("async_diloco", **options), [p.shape for p in model.parameters()])
    wire = codec.wire_bytes()
    assert wire < 0.05 * 4 * numel  # a few per cent of fp32, tables included
    out = run_ranks(_sparse_learners, 2, timeout=120)
    planned = predict(setting("async_diloco", options, of_module("wide", model), 2, parse_wan("lan"), 0.01), H * ROUNDS)
    for rank in range(2):
        syncs = [e for e in out[rank]["events"] if e["type"] == "sync"]
        rounds = [e for e in syncs if not e["final"]]
        assert [e["bytes"] for e in rounds] == [wire] * ROUNDS and all(e["kept"] == codec.kept for e in rounds)
        assert sum(e["bytes"] for e in syncs) == ROUNDS * wire  # the final carries no steps, no payload
        assert out[rank]["ledger"]["pseudo_grads"] == ROUNDS * wire == planned.figures.bytes[rank][0]
    assert torch.equal(out[0]["final"], out[1]["final"])


@pytest.mark.parametrize(
    "options, says",
    [
        ({"density": 0.25}, "density shapes the sparse payload, and sparse is off"),
        ({"topk": 8}, "topk shapes the sparse payload, and sparse is off"),
        ({"chunk": 32}, "chunk shapes the sparse payload, and sparse is off"),
        ({"bits": 4}, "bits shapes the sparse payload, and sparse is off"),
        ({"quant_range": 3.0}, "quant_range shapes the sparse payload, and sparse is off"),
        ({"dct": True}, "dct shapes the sparse payload, and sparse is off"),
        ({"error_decay": 0.5}, "error_decay shapes the sparse payload, and sparse is off"),
        ({"sparse": True, "codec": "int8"}, "codec int8 encodes the dense payload, and sparse is on"),
        ({"sparse": True, "bits": 32, "quant_range": 3.0}, "bits 32 sends float32 values unquantized"),
        ({"sparse": True, "topk": 8, "density": 0.5}, "give density or topk, not both"),
    ],
)
def test_a_sparse_knob_without_the_sparse_payload_is_one_line(options, says):
    from wansync.strategies import make_options

    with pytest.raises(ConfigError) as e:
        make_options("async_diloco", **options)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_sparse_payloads_density_guard_warns_a_sparse_learner_only():
    """SparseLoCo's regime guard (rounds x density under 20 %: most of the update never leaves a worker) reads
    async_diloco's density only where its learners send the sparse payload."""
    from wansync.strategies import make_options
    from wansync.strategies.guards import regime_warnings

    def lines(**options: Any) -> list[str]:
        return regime_warnings("async_diloco", vars(make_options("async_diloco", **options)), 1000)

    assert not any("density" in line for line in lines())
    assert any("--density 0.00781 over the 10 round(s)" in line for line in lines(sparse=True))


# ---- Dynamic Local Updates: a slower learner takes shorter rounds -------------------------------------
def _two_speeds(rank: int, world: int) -> list[int]:
    import time

    model = tiny_model(0)
    sync = ws.strategy(
        "async_diloco", model, torch.optim.AdamW(model.parameters(), lr=0.01), sync_every=8, dynamic_h=True
    )
    step_s = 0.05 * (rank + 1)  # learner 1 at half speed (padded well past a loaded machine's step of this model)
    starts = []
    while sync.continues(48):
        t0 = time.perf_counter()
        x, y = rank_batch(rank, sync.t)
        nn.functional.mse_loss(sync.model(x), y).backward()
        before = sync.round_start
        sync.step()
        sync.zero_grad()
        if sync.round_start != before:
            starts.append(sync.t)
        time.sleep(max(0.0, step_s - (time.perf_counter() - t0)))
    sync.finish()
    return [b - a for a, b in zip([0, *starts], starts)]


def test_dynamic_local_updates_give_a_learner_at_half_speed_rounds_of_half_the_steps():
    fast, slow = run_ranks(_two_speeds, 2, timeout=60)
    assert fast[0] == slow[0] == 8  # no speed is known before the first round
    assert all(h == 8 for h in fast[1:]), fast
    assert slow[1:] and all(3 <= h <= 5 for h in slow[1:]), slow  # H × its speed / the fastest's: 4


def test_a_message_on_an_emulated_link_is_recorded_and_timed_as_a_collective_is():
    """A learner's contribution and a syncer's version are not collectives, but they cross the same
    emulated link: each is recorded on the sender's emulator (bytes, modelled time, queued behind the one
    before), and the profiler's step events book them with the wait the sender adds (`profile.json`)."""
    from wansync.comm import p2p
    from wansync.net import Emulator, parse_wan
    from wansync.net.cost import collective_duration
    from wansync.telemetry.commtime import CommTimer

    emulator = Emulator(parse_wan("cross-region"))
    timer = CommTimer(emulator)
    link = p2p.LinkModel(emulator, 1, 0, 2)
    timer.begin(1, 0)
    first, second = link.seconds_from_now(4_000_000), link.seconds_from_now(1000)
    link.last.waited = 0.25  # what a learner adds once the version it waits for is in
    timer.end(0, 0.0)
    one, two = emulator.records()
    topology = emulator.topology
    assert (one.op, one.nbytes, one.group, two.nbytes) == ("send", 4_000_000, "p2p", 1000)
    assert one.modelled_s == collective_duration("send", 4_000_000, 2, topology, [1, 0], 1, 0.0) > 0
    assert two.start == pytest.approx(one.modelled_end) and second > first  # queued behind the first
    (event,) = timer.events()
    assert event["bytes"] == 4_001_000 and event["collectives"] == 2
    assert event["modelled_s"] == pytest.approx(one.modelled_s + two.modelled_s)
    assert event["exposed_s"] == 0.25
    assert p2p.LinkModel(emulator, 0, 0, 2).seconds_from_now(10) == 0.0 and len(emulator.records()) == 2  # local


def test_a_learner_whose_rounds_are_always_dropped_is_told_once_it_trains_for_nothing():
    """At max_staleness 0 a learner that always arrives one version late has each round dropped (one line
    each); after the third in a row the syncer says once why, and what to change."""
    from wansync.comm import p2p
    from wansync.comm.codecs import get_codec
    from wansync.strategies.syncer_service import SyncerService
    from wansync.trust.settings import current

    settings = {"sync_every": 2}
    logged: list[str] = []
    trust = current({})
    service = SyncerService(
        Syncer([torch.zeros(3)], [], Settings(2, 1, 0.01, 0, "none", 1.0, 0.0)), trust=trust, host="127.0.0.1",
        rank=0, ranks=[0, 1], world=2, emulator=None, settings=settings, codec=get_codec("fp32"), log=logged.append,
    )  # fmt: skip

    def learner(m: int) -> p2p.Channel:
        channel = p2p.Channel(p2p.connect(service.address, trust), p2p.key(trust), p2p.LinkModel(None, 0, 0, 2), "s")
        channel.send({"kind": "hello", "learner": m, "settings": settings})
        assert channel.recv(10)["kind"] == "welcome"
        return channel

    def contribute(channel: p2p.Channel, base: int) -> dict:
        channel.send({"kind": "contribution", "base": base, "steps": 2, "tokens": 2, "values": torch.ones(3)})
        return channel.recv(10)

    try:
        fast, slow = learner(0), learner(1)
        for _ in range(4):
            version = contribute(fast, service.syncer.version)["version"]  # a merge of its own: a new version
            assert contribute(slow, version - 1)["dropped"]  # one version late: dropped at max_staleness 0
        warnings = [line for line in logged if "warning" in line]
        assert warnings == [
            "syncer: warning: learner 1's last 3 rounds were all dropped: it trains for nothing while it is this much "
            "slower than the others; raise --max-staleness (now 0), or shorten its rounds with --dynamic-h"
        ]  # fmt: skip
        assert len(logged) == 5 and logged.index(warnings[0]) == 3
    finally:
        service.close()


def test_the_syncer_service_refuses_a_stranger_and_a_malformed_contribution_in_one_line_and_serves_on():
    """`syncer_service.SyncerService` alone, on loopback: a hello for a learner the run does not have is
    refused; a learner whose contribution is not the model's is logged in one line and let go; a learner
    started with other settings is refused naming the key; a learner that resumes while the syncer was never
    restored (rank 0 did not resume: nodes that disagree) is refused once its wait is over; a good learner is
    then welcomed at version 0 and its round merged (quorum 1) into version 1."""
    from wansync.comm import p2p
    from wansync.comm.codecs import get_codec
    from wansync.strategies.syncer_service import SyncerService
    from wansync.trust.settings import current

    tensors = [torch.zeros(3)]
    settings = {"sync_every": 2}
    syncer = Syncer(tensors, [], Settings(2, 1, 0.01, 4, "none", 1.0, 0.0))
    logged: list[str] = []
    trust = current({})
    service = SyncerService(
        syncer, trust=trust, host="127.0.0.1", rank=0, ranks=[0, 1], world=2, emulator=None,
        settings=settings, codec=get_codec("fp32"), log=logged.append, resume_wait_s=0.2,
    )  # fmt: skip

    def learner() -> p2p.Channel:
        return p2p.Channel(p2p.connect(service.address, trust), p2p.key(trust), p2p.LinkModel(None, 0, 0, 2), "syncer")

    try:
        stranger = learner()
        stranger.send({"kind": "hello", "learner": 7, "settings": settings})
        refused = stranger.recv(10)
        assert (refused["kind"], refused["why"]) == ("refused", "not a learner's hello")
        other = learner()
        other.send({"kind": "hello", "learner": 0, "settings": {"sync_every": 3}})
        refused = other.recv(10)
        assert refused["kind"] == "refused" and "sync_every 3 here, 2 at the syncer" in refused["why"]
        service.error = None  # the run would end on it (every learner's next exchange): go on for the test
        resuming = learner()
        resuming.send({"kind": "hello", "learner": 1, "settings": settings, "join": True, "resume": True})
        refused = resuming.recv(10)
        assert (refused["kind"], refused["why"]) == (
            "refused",
            "the syncer's state was not restored: rank 0 did not resume",
        )
        bad = learner()
        bad.send({"kind": "hello", "learner": 1, "settings": settings})
        assert bad.recv(10)["kind"] == "welcome"
        bad.send({"kind": "contribution", "base": 0, "steps": 2, "tokens": 2, "values": torch.zeros(5)})
        deadline = time.monotonic() + 10
        while not logged and time.monotonic() < deadline:
            time.sleep(0.01)
        assert logged == ["syncer: learner 1 left (learner 1 sent a malformed contribution (its values are not the "
                          "model's)); the others go on"]  # fmt: skip
        good = learner()
        good.send({"kind": "hello", "learner": 0, "settings": settings})
        welcome = good.recv(10)
        assert welcome["kind"] == "welcome" and welcome["version"] == 0
        good.send({"kind": "contribution", "base": 0, "steps": 2, "tokens": 2, "values": torch.ones(3)})
        reply = good.recv(10)
        assert reply["kind"] == "version" and reply["version"] == 1 and torch.equal(reply["values"], torch.ones(3))
    finally:
        service.close()


def test_a_channel_closed_here_while_its_reader_comes_back_to_it_says_so_in_one_line():
    """The syncer's `close` closes every learner's channel while that learner's thread may be between two
    `recv`s: its next `recv` met a closed stream and its thread died on "ValueError: peek of closed file"
    (a traceback on stderr, seen beside busy loops). Now the one line every other end of a channel gives."""
    import socket

    from wansync.comm import p2p
    from wansync.errors import PeerError
    from wansync.trust.settings import current

    def channel() -> p2p.Channel:
        mine, _theirs = socket.socketpair()
        return p2p.Channel(mine, p2p.key(current({})), p2p.LinkModel(None, 0, 0, 2), "the learner")

    closed = channel()
    closed.close()  # before the reader came back: its socket is closed too
    half = channel()
    half.closed = True  # the moment of the race: the stream closed, the socket not yet
    half.stream.close()
    for ch in (closed, half):
        with pytest.raises(PeerError) as e:
            ch.recv()
        assert str(e.value) == "the learner: the connection was closed here"
    open_one = channel()
    open_one.stream.close()  # not closed through `close`: a bug of ours, not a peer's, still raised as it is
    with pytest.raises(ValueError):
        open_one.recv()
    half.close()
    open_one.close()
