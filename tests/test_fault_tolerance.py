"""--fault-tolerant: a worker killed mid-run is left out, restarted, healed from a live peer, and the
run ends with every worker holding the same parameters (torchft on gloo, 127.0.0.1)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

import netns
from cli_harness import TINY, no_process_left, start, wansync, worker_pids
from wansync.ft.quorum import INSTALL, require_torchft
from wansync.config import build_config
from wansync.errors import ConfigError, PeerError
from wansync.runner.localgroup import run_ranks

pytest.importorskip("torchft")


def sync_participants(run_dir, by="step"):
    """(step, participants) of every sync event; by="started": the step its exchange started at."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r.get(by, r["step"]), r["participants"]) for r in records if r["type"] == "sync"]


def test_strategies_that_all_reduce_every_step_are_refused_in_one_line():
    for strategy in ("ddp", "cpdp", "post_local_sgd"):
        with pytest.raises(ConfigError, match="all-reduces gradients every step"):
            build_config(overrides={"strategy": strategy, "fault_tolerant": True})


def test_demo_exchanging_at_every_step_is_refused_in_one_line_sparseloco_is_not():
    with pytest.raises(ConfigError, match="demo: it exchanges at every step"):
        build_config(overrides={"strategy": "demo", "fault_tolerant": True})
    build_config(overrides={"strategy": "sparseloco", "fault_tolerant": True})


def test_a_lossy_codec_is_refused_workers_of_several_ranks_ddp_or_fsdp_inside_are_not():
    with pytest.raises(ConfigError, match="fp32 only"):
        build_config(overrides={"strategy": "streaming", "fault_tolerant": True, "codec": "int8"})
    for inside in ("ddp", "fsdp"):
        build_config(overrides={"strategy": "diloco", "fault_tolerant": True, "ranks_per_worker": 2, "inside": inside})


def test_without_torchft_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ConfigError, match=r"pip install wansync\[ft\]"):
        require_torchft()
    assert "wansync[ft]" in INSTALL


def test_the_quorum_group_records_its_members_and_id_from_torchft_0_2_configure_and_the_nightly_reconfigure(
    monkeypatch,
):
    """torchft 0.2.0's Manager hands the group the quorum id and the members' global ranks as `configure`'s
    arguments; torchft-nightly's hands it torch 2.14's ReconfigureOptions (the id as `uuid`, one JSON handle
    per member naming its global rank). Either way the group knows both, which the emulated link and the
    left-out rule read; torchft's own group (its rendezvous) is not what is under test here."""
    from datetime import timedelta
    from types import SimpleNamespace

    from torchft import ProcessGroupGloo
    from wansync.ft.quorum import members_recording_gloo

    monkeypatch.setattr(ProcessGroupGloo, "configure", lambda self, *args, **kwargs: None, raising=False)
    monkeypatch.setattr(ProcessGroupGloo, "reconfigure", lambda self, opts: "work", raising=False)
    group = members_recording_gloo(timedelta(seconds=5))
    assert (group.quorum_id, group.members) == (None, None)
    group.configure("host:1/torchft/3/1", "worker_1", 0, 2, 3, 1, 2, [3, 1])
    assert (group.quorum_id, group.members) == (3, [1, 3])
    handles = [json.dumps({"id": "a", "store": "host:1", "global_rank": rank}) for rank in (5, 1)]
    assert group.reconfigure(SimpleNamespace(uuid=4, handles=handles)) == "work"
    assert (group.quorum_id, group.members) == (4, [1, 5])


def test_the_cli_refuses_an_unsupported_strategy_in_one_line(tmp_path):
    r = wansync(
        "train",
        "--strategy",
        "ddp",
        "--fault-tolerant",
        "--workers",
        "2",
        "--steps",
        "2",
        "--out",
        str(tmp_path / "run"),
        *TINY,
        timeout=60,
    )
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "all-reduces gradients every step" in r.stderr


def _wait_for_a_peer_that_never_comes(rank, world_size, peer_timeout):
    """A FT worker alone in its group, a real lighthouse, 2 workers expected: what ends the join."""
    import threading

    import wansync as ws
    from torchft.coordination import LighthouseServer
    from wansync.ft.member import join_quorum
    from wansync.ft.quorum import Quorum
    from wansync.comm.replicas import Replicas

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=2000)
    quorum = Quorum(0, f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}", peer_timeout, hostname="127.0.0.1")
    model = torch.nn.Linear(3, 2)
    sync = ws.strategy(
        "diloco", model, torch.optim.SGD(model.parameters(), lr=0.1), replicas=Replicas(1, 0, 2, 0), quorum=quorum
    )
    outcome = []

    def join():
        try:
            join_quorum(sync, quorum, expected=2)
            outcome.append("joined")
        except BaseException as exc:  # noqa: BLE001 - the test inspects whatever ended the wait
            outcome.append(exc)

    waiting = threading.Thread(target=join, daemon=True)
    try:
        waiting.start()
        waiting.join(3 * peer_timeout + 30)  # three peer timeouts, and slack for a loaded machine
        return "never gave up" if waiting.is_alive() else (type(outcome[0]).__name__, str(outcome[0]))
    finally:
        quorum.shutdown()
        lighthouse.shutdown()


def test_a_worker_waiting_for_the_first_quorum_gives_up_in_one_line_after_three_peer_timeouts():
    """In a rank process of its own: the lighthouse and quorum threads would stay in this one."""
    kind, message = run_ranks(_wait_for_a_peer_that_never_comes, 1, 1.0, timeout=120)[0]
    assert kind == PeerError.__name__ and "only 1 of 2 workers joined" in message
    assert "\n" not in message


def wait_for_one_quorum_request(lighthouse, timeout=60.0):
    """Until the lighthouse's status page says one worker asks for a quorum. (A quorum that all the
    previous one's members ask for forms at once, without a worker that only heartbeats.)"""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{lighthouse}/status", timeout=5) as page:
            if "only have 1 participants" in page.read().decode():
                return
        time.sleep(0.05)
    raise TimeoutError("no worker asked the lighthouse for a quorum")


def _heal_in_the_final_quorum(rank, world_size, strategy, steps, options):
    """Worker 0 trains alone to its final quorum; worker 1 starts only then (from other parameters),
    heals there, and the two finish together. What each holds at the end."""
    import torch.distributed as dist

    import wansync as ws
    from torchft.coordination import LighthouseServer
    from wansync.ft.member import join_quorum, meet_final_quorum
    from wansync.ft.quorum import Quorum
    from wansync.comm.replicas import Replicas

    lighthouse = None
    if rank == 0:  # waits for every heartbeating worker: worker 1 is in the quorum it starts in
        lighthouse = LighthouseServer(
            bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=5000
        )
    address = [f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}" if lighthouse else None]
    dist.broadcast_object_list(address)
    own = [dist.new_group([r]) for r in range(2)][rank]  # each worker a group of its own, as in a run
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))  # two blocks: two fragments
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def build():
        """This worker's quorum and the strategy it is handed to (worker 1's are built late)."""
        quorum = Quorum(rank, address[0], 10, hostname="127.0.0.1")
        real_mean = quorum.mean

        def mean(values, valid):  # how many workers each exchange counted
            averaged, contributors = real_mean(values, valid)
            counted.append(contributors)
            return averaged, contributors

        quorum.mean = mean
        sync = ws.strategy(
            strategy, model, optimizer, group=own, replicas=Replicas(1, rank, 2, 0), quorum=quorum, **options
        )

        def load(state):
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            sync.load_heal_state(state["strategy"])

        quorum.serve(
            lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "strategy": sync.heal_state()},
            load,
        )
        return sync, quorum

    quorum, trained_bytes, counted = None, 0, []
    try:
        if rank == 0:
            sync, quorum = build()
            join_quorum(sync, quorum, 1)
            while sync.t < steps:
                model(torch.randn(16, 8)).square().mean().backward()
                sync.step()
                sync.zero_grad()
            trained_bytes = sync.comm.bytes
            counted.clear()  # its exchanges alone
            dist.barrier()  # worker 1 may start
            wait_for_one_quorum_request(address[0])  # worker 1's: the lighthouse waits for worker 0 in it
            meet_final_quorum(sync)
        else:
            dist.barrier()
            sync, quorum = build()
            join_quorum(sync, quorum, 1)
        sync.finish()
        dist.barrier()
        return {
            "t": sync.t,
            "heals": quorum.heals,
            "final_bytes": sync.comm.bytes - trained_bytes,
            "counted": counted,
            "state": {k: v.clone() for k, v in model.state_dict().items()},
        }
    finally:
        if quorum is not None:
            quorum.shutdown()
        if lighthouse is not None:
            lighthouse.shutdown()


@pytest.mark.parametrize(
    "strategy,steps,options,finish_exchanges",
    [
        ("diloco", 4, {"sync_every": 2}, False),  # the last step exchanged: finish has nothing to do
        ("streaming", 5, {"sync_every": 4, "fragments": 2, "overlap": 1}, True),  # finish syncs the fragments
    ],
)
def test_a_worker_healed_in_the_final_quorum_makes_no_exchange_again_and_finishes_with_the_others(
    strategy, steps, options, finish_exchanges
):
    """A worker that arrives as the others meet for the final synchronization heals to their state
    after the last step's exchanges: it must not make them again (the CI failure of a run whose
    stopped worker came back just then: it exchanged alone and ended with other parameters)."""
    first, late = run_ranks(_heal_in_the_final_quorum, 2, strategy, steps, options, timeout=120)
    assert (first["heals"], late["heals"]) == (0, 1) and late["t"] == first["t"] == steps
    assert all(torch.equal(first["state"][k], late["state"][k]) for k in first["state"])
    assert late["final_bytes"] == first["final_bytes"]  # only the final synchronization's exchanges
    assert (first["final_bytes"] > 0) == finish_exchanges
    # worker 1 holds a copy of worker 0's state: its values would count worker 0's work twice
    assert first["counted"] == late["counted"] == ([1] * len(first["counted"]))
    assert bool(first["counted"]) == finish_exchanges


class DoneWork:
    """A quorum all-reduce that has already finished (the link model is what is under test)."""

    def wait(self, timeout=None):
        return True


def test_a_quorum_all_reduce_under_the_emulator_takes_the_modelled_time_of_its_participants():
    from wansync.ft.quorum import on_link
    from wansync.net import Emulator, collective_duration, parse_wan

    topology = parse_wan("rtt=40ms,bw=100mbit,sites=2")
    emulator = Emulator(topology, seed=0)
    wire = torch.zeros(2501)
    first = on_link(emulator, DoneWork(), wire, [0, 1, 3], 4, seq=0)
    second = on_link(emulator, DoneWork(), wire, [0, 1, 3], 4, seq=1)
    first.wait()
    second.wait()
    expected = collective_duration("allreduce", 4 * 2501, 4, topology, [0, 1, 3])
    assert expected > 0.04  # two sites: at least a round trip
    records = emulator.records()
    assert [r.modelled_s for r in records] == [expected, expected]
    assert records[1].start >= records[0].modelled_end  # one link, first in first out
    assert all(r.end >= r.modelled_end and r.waited is not None for r in records)


WAN = "rtt=40ms,bw=100mbit,sites=2"  # worker 0 on one site, worker 1 on the other; no jitter


@pytest.mark.parametrize("ranks_per_worker", [1, 2])
def test_under_wan_every_quorum_exchange_books_the_link_models_time_for_its_participants(tmp_path, ranks_per_worker):
    """With workers of two ranks, rank 0 averages its half over the quorum of ranks 0 and 2, one of
    two such all-reduces sharing each site's uplink at once (`parallel`); the worker's own
    collectives (DDP's gradients, the reassembly) run on the in-site link."""
    import dataclasses

    from wansync.net import collective_duration, parse_wan

    r_, out = ranks_per_worker, tmp_path / "run"
    r = wansync(
        "train",
        "--strategy",
        "diloco",
        "--sync-every",
        "5",
        "--workers",
        "2",
        "--ranks-per-worker",
        str(r_),
        "--steps",
        "10",
        "--eval-every",
        "1000",
        "--fault-tolerant",
        "--peer-timeout",
        "60",
        "--wan",
        WAN,
        "--quiet",
        "--out",
        str(out),
        *TINY,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    profile = json.loads((out / "profile.json").read_text())
    assert profile["wan"]["spec"] == WAN and profile["wan"]["emulated"]
    collectives = [c for ev in profile["events"] for c in ev["per_collective"]]
    on_link = [c for c in collectives if c["modelled_s"] > 0.02]  # between the sites: 40 ms RTT
    assert len(on_link) == len(sync_participants(out)) == 2  # steps 5 and 10 (the drift rides on them)
    topology = dataclasses.replace(parse_wan(WAN), ranks_per_worker=r_)
    for c in on_link:
        assert c["op"] == "allreduce"
        assert c["modelled_s"] == pytest.approx(
            collective_duration("allreduce", c["bytes"], 2 * r_, topology, [0, r_], parallel=r_)
        )
    modelled = sum(c["modelled_s"] for c in collectives)
    assert profile["derived"]["comm_modelled_s"] == pytest.approx(modelled)
    assert profile["categories_s"]["exposed_comm"] >= modelled  # an exchange ends after the link says
    assert abs(sum(profile["categories_s"].values()) - profile["wall_clock_s"]) <= 0.02 * profile["wall_clock_s"]
    assert no_process_left(out)


@pytest.mark.parametrize("ranks_per_worker,inside", [(1, "ddp"), (2, "ddp"), (2, "fsdp")])
def test_under_wan_cocodc_takes_its_sync_time_from_the_link_model_of_every_worker(tmp_path, ranks_per_worker, inside):
    """T_s is the modelled time of a fragment's mean between the workers, for workers of several
    ranks too (each rank's shard at once over the sites' uplink; sharded inside, the rank's own)."""
    out = tmp_path / "run"
    r = wansync(
        "train",
        "--strategy",
        "cocodc",
        "--sync-every",
        "4",
        "--fragments",
        "2",
        "--overlap",
        "1",
        "--workers",
        "2",
        "--ranks-per-worker",
        str(ranks_per_worker),
        "--inside",
        inside,
        "--steps",
        "8",
        "--eval-every",
        "1000",
        "--fault-tolerant",
        "--peer-timeout",
        "60",
        "--wan",
        WAN,
        "--quiet",
        "--out",
        str(out),
        *TINY,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    schedule = next(rec for rec in records if rec["type"] == "schedule")
    profile = json.loads((out / "profile.json").read_text())
    fragment_syncs = [
        c["modelled_s"]
        for ev in profile["events"]
        for c in ev["per_collective"]
        if c["modelled_s"] > 0.02 and c["bytes"] > 64
    ]  # between the sites: 40 ms RTT
    assert schedule["t_s_source"] == "model" and fragment_syncs
    assert schedule["t_s"] == pytest.approx(min(fragment_syncs), rel=0.05)  # not one worker's (zero) link
    assert no_process_left(out)


# ---- the must-show scenarios: 4 workers, worker 2 fails (micro LM, few steps) ---------------------
STEPS, EVERY, FAILS_AT = 25, 5, 12  # the last exchange worker 2 takes part in is at step 10
WORKERS = 4
FOUR = ("--workers", str(WORKERS), "--steps", str(STEPS), "--eval-every", "1000", "--quiet", *TINY)


def run_four(out, strategy, *extra, fault=None, peer_timeout=10, timeout=240, setup=None):
    env = {"WANSYNC_FAULT": fault} if fault else None
    return wansync(
        "train",
        "--strategy",
        strategy,
        "--fault-tolerant",
        "--peer-timeout",
        str(peer_timeout),
        "--out",
        str(out),
        *FOUR,
        *extra,
        env=env,
        timeout=timeout,
        setup=setup,
    )


def straggle_until_the_others_wait():
    """`setup` of a run whose worker 0 straggles (WANSYNC_FAULT's `pause`, alive: the others wait for it
    at the next quorum) so that a killed worker is back before the run ends: the pause ends as soon as
    every other worker, the restarted one among them, asks the lighthouse for that quorum (its status
    page), at the latest after its `seconds` (a page that never says so costs only the time). The
    launcher forks its workers from the CLI's process: they inherit it."""
    import re
    import urllib.request

    from wansync.ft.member import LIGHTHOUSE_ENV
    from wansync.trainer import faults

    strike = faults.Fault._strike
    waiting = re.compile(r"Valid quorum with (\d+) participants")

    def pause(self, step, model=None):
        if self.action != "pause":
            return strike(self, step, model)
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{os.environ[LIGHTHOUSE_ENV]}/status", timeout=5) as page:
                found = waiting.search(page.read().decode())
            if found and int(found[1]) == WORKERS - 1:
                return
            time.sleep(0.1)

    faults.Fault._strike = pause


def quorums(out, rank):
    path = out / "logs" / f"quorum_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def final_models(out, ranks):
    final = sorted((out / "checkpoints").glob("step*"))[-1]
    return [torch.load(final / f"rank{r}.pt", weights_only=False)["model"] for r in ranks]


def all_equal(models):
    return all(torch.equal(models[0][k], m[k]) for m in models[1:] for k in models[0])


@pytest.fixture(scope="module")
def killed_for_good(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft4")
    clean = run_four(root / "clean", "diloco", "--sync-every", str(EVERY))
    killed = run_four(
        root / "killed", "diloco", "--sync-every", str(EVERY), fault=f"rank=2,step={FAILS_AT},action=kill"
    )
    return clean, root / "clean", killed, root / "killed"


def test_four_workers_one_killed_for_good_the_run_finishes_with_three_at_every_exchange_after(killed_for_good):
    _, _, r, out = killed_for_good
    assert r.returncode == 0, r.stderr[-2000:]
    after = [p for s, p in sync_participants(out) if s > FAILS_AT]
    assert after and all(p == 3 for p in after)
    assert all(p == 4 for s, p in sync_participants(out) if s < FAILS_AT)
    assert all_equal(final_models(out, [0, 1, 3]))
    assert no_process_left(out)


def test_the_killed_run_reports_its_losses_next_to_the_fault_free_run(killed_for_good):
    clean, clean_out, r, out = killed_for_good
    assert clean.returncode == 0, clean.stderr[-2000:]
    fault_free, faulty = (json.loads((d / "summary.json").read_text()) for d in (clean_out, out))
    assert fault_free["final_val_loss"] > 0 and faulty["final_val_loss"] > 0
    assert faulty["steps_lost"] == [0, 0, STEPS - 10, 0] and fault_free["steps_lost"] == [0, 0, 0, 0]
    assert faulty["short_exchanges"] == list(range(15, STEPS + 1, EVERY)) and fault_free["short_exchanges"] == []


def test_fault_tolerant_drift_telemetry_rides_on_the_quorum_exchange(killed_for_good):
    """The quorum's exchange averages ‖θ_m‖² over the same workers as θ_m: every boundary reports
    a drift between 0 and 1."""
    _, clean_out, _, _ = killed_for_good
    records = [json.loads(line) for line in (clean_out / "metrics.jsonl").read_text().splitlines()]
    drifts = [r["drift"] for r in records if r["type"] == "sync"]
    assert len(drifts) == STEPS // EVERY and all(0 < d < 1 for d in drifts)


@pytest.fixture(scope="module")
def killed_and_healed(tmp_path_factory):
    out = tmp_path_factory.mktemp("ft4heal") / "run"
    # the restarted worker, forked by the launcher's zygote, is usually back for the next slot (15);
    # worker 0 straggles at step 18 (alive, so the others wait for it at step 20) until it is back
    # and waits at step 20 too, on a loaded machine too (at most 30 s: a tenth of a second when it is)
    r = run_four(
        out,
        "diloco",
        "--sync-every",
        str(EVERY),
        "--max-restarts",
        "1",
        peer_timeout=90,
        fault=f"rank=2,step={FAILS_AT},action=kill;rank=0,step=18,action=pause,seconds=30",
        setup=straggle_until_the_others_wait,
    )
    return r, out


def heal_step(out):
    healed = [q for q in quorums(out, 2) if q["healed"]]
    assert len(healed) == 1
    return healed[0]["step"]


def test_a_killed_worker_does_not_end_the_run(killed_and_healed):
    r, out = killed_and_healed
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["worker_failures"] == 1 and summary["rejoins"] == 1 and summary["heals"] == 1
    assert no_process_left(out)


def test_the_exchanges_after_the_failure_lack_the_killed_worker_until_it_heals(killed_and_healed):
    _, out = killed_and_healed
    seen, healed_at = sync_participants(out), heal_step(out)
    assert FAILS_AT < healed_at <= 20
    assert all(p == 4 for s, p in seen if s < FAILS_AT or s >= healed_at)
    assert all(p == 3 for s, p in seen if FAILS_AT < s < healed_at)


def test_a_healed_worker_holds_its_peers_anchors_and_outer_state_bit_for_bit(killed_and_healed):
    r, out = killed_and_healed
    assert r.returncode == 0, r.stderr[-2000:]
    step = heal_step(out)
    mine = next(q["anchor_digest"] for q in quorums(out, 2) if q["healed"])
    for peer in (0, 1, 3):
        theirs = [q["anchor_digest"] for q in quorums(out, peer) if q["step"] == step and "anchor_digest" in q]
        assert theirs and theirs[-1] == mine
    summary = json.loads((out / "summary.json").read_text())
    # its lost steps: from the last slot it took part in (10) to the one it healed at
    assert summary["heals"] == 1 and summary["steps_lost"] == [0, 0, step - 10, 0]


def test_a_healed_worker_reads_its_shard_on_from_where_it_would_have_been(killed_for_good, killed_and_healed):
    _, clean, _, _ = killed_for_good
    _, out = killed_and_healed

    def data_position(run):
        final = sorted((run / "checkpoints").glob("step*"))[-1]
        return torch.load(final / "rank2.pt", weights_only=False)["workload"]

    assert data_position(out) == data_position(clean)  # the fault-free run's, not 25 - heal step batches in


def test_after_healing_every_rank_ends_with_identical_parameters(killed_and_healed):
    _, out = killed_and_healed
    assert all_equal(final_models(out, range(4)))
    assert no_process_left(out)


def first_slot_after(strategy_args, after):
    """The first step after `after` where the fragment schedule starts an exchange (cocodc may
    change the schedule after its agreement: the fault then strikes its first exchange after)."""
    from wansync.strategies.fragments import Schedule

    h, p = int(strategy_args[1]), int(strategy_args[3])
    schedule = Schedule(h, p, p)
    return next(t for t in range(after + 1, STEPS) if schedule.is_slot(t))


@pytest.mark.parametrize("strategy", ["streaming", "cocodc"])
def test_a_worker_killed_inside_a_fragment_exchange_is_left_out_of_it_and_the_others_go_on(strategy, tmp_path):
    args = ("--sync-every", "8", "--fragments", "2", "--overlap", "2")
    slot = first_slot_after(args, FAILS_AT)
    out = tmp_path / "run"
    # the workers not next to it in the ring wait out the collective's timeout (half the peer timeout:
    # 3 s, ample for live peers that have just met in the quorum) before they retry without it
    r = run_four(out, strategy, *args, fault=f"rank=2,step={slot},action=kill_in_exchange", peer_timeout=6)
    assert r.returncode == 0, r.stderr[-2000:]
    died_in = quorums(out, 2)[-1]["step"]  # the exchange it was killed inside
    assert died_in >= slot
    at_slot = [q["participants"] for q in quorums(out, 0) if q["step"] == died_in]
    assert at_slot[0] == 4 and at_slot[-1] == 3  # retried without it, inside that exchange
    assert all(p == 3 for s, p in sync_participants(out, by="started") if s >= died_in)  # merged later
    assert all_equal(final_models(out, [0, 1, 3]))
    assert no_process_left(out)


def worker_pid(out, rank):
    return worker_pids(out).get(rank)


def test_a_stopped_worker_is_left_out_and_when_continued_rejoins_or_exits_in_one_line(tmp_path):
    out = tmp_path / "run"
    proc = start(
        "train",
        "--strategy",
        "diloco",
        "--sync-every",
        str(EVERY),
        "--fault-tolerant",
        "--peer-timeout",
        "60",
        "--out",
        str(out),
        *FOUR,  # left out by heartbeat (2 s)
        env={"WANSYNC_FAULT": f"rank=2,step={FAILS_AT},action=stop"},
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.running():
            log = out / "logs" / "quorum_rank0.jsonl"
            lines = log.read_text().splitlines() if log.is_file() else []
            if any(q["participants"] == 3 and q["step"] > FAILS_AT for q in map(json.loads, filter(str.strip, lines))):
                break
            time.sleep(0.5)
        pid = worker_pid(out, 2)
        assert pid is not None and Path(f"/proc/{pid}/stat").read_text().split()[2] == "T"  # stopped, left out
        os.kill(pid, signal.SIGCONT)
        r = proc.result(timeout=180)  # never a hang
    finally:
        proc.kill()
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    healed = [q for q in quorums(out, 2) if q["healed"]]
    err = out / "logs" / "rank2.err"
    if healed:
        assert all_equal(final_models(out, range(4)))
    else:
        assert err.is_file() and len(err.read_text().strip().splitlines()) == 1
        assert all_equal(final_models(out, [0, 1, 3]))
    assert no_process_left(out)


def test_a_stopped_worker_continued_after_the_others_ended_exits_in_one_line_instead_of_training_alone(tmp_path):
    out = tmp_path / "run"
    proc = start(
        "train",
        "--strategy",
        "diloco",
        "--sync-every",
        str(EVERY),
        "--fault-tolerant",
        "--peer-timeout",
        "60",
        "--out",
        str(out),
        *FOUR,
        env={"WANSYNC_FAULT": f"rank=2,step={FAILS_AT},action=stop"},
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.running() and not (out / "summary.json").is_file():
            time.sleep(0.5)  # rank 0 wrote its summary: the others ended
        pid = worker_pid(out, 2)
        assert pid is not None and Path(f"/proc/{pid}/stat").read_text().split()[2] == "T"
        os.kill(pid, signal.SIGCONT)
        r = proc.result(timeout=180)
    finally:
        proc.kill()
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    lines = (out / "logs" / "rank2.err").read_text().strip().splitlines()
    assert len(lines) == 1 and "left out" in lines[0] and "Traceback" not in r.stdout + r.stderr
    # it never trained on alone (at the start-up join, quorums short of workers are only waited in)
    assert all(q["participants"] > 1 for q in quorums(out, 2) if q["step"] > 0)
    assert all_equal(final_models(out, [0, 1, 3]))
    assert no_process_left(out)


def test_steps_lost_run_from_the_last_slot_taken_part_in_to_the_heal_or_the_end():
    from wansync.ft.quorums import short_exchanges, steps_lost

    slots = [5, 10, 15, 20, 25, 30]
    lost = steps_lost({0: slots, 1: [5, 10, 20, 25, 30], 2: [5, 10], 3: []}, end=30)
    assert lost == {0: 0, 1: 10, 2: 20, 3: 30}
    # back in time for the next slot, healed there: no exchange missed, its steps since slot 10 discarded
    assert steps_lost({0: slots, 1: slots}, end=30, healed={1: [15]}) == {0: 0, 1: 5}
    records = [{"step": 5, "participants": 4}, {"step": 10, "participants": 4}, {"step": 10, "participants": 3}]
    assert short_exchanges(records, 4) == [10]


def test_a_worker_stopped_for_good_is_ended_one_peer_timeout_after_the_others_finished(tmp_path):
    out = tmp_path / "run"
    r = wansync(
        "train",
        "--strategy",
        "diloco",
        "--sync-every",
        str(EVERY),
        "--fault-tolerant",
        "--peer-timeout",
        "5",  # what the test waits out after the others finish (the chaos benchmark runs with 4)
        "--out",
        str(out),
        "--workers",
        "3",
        "--steps",
        "20",
        "--eval-every",
        "1000",
        "--quiet",
        *TINY,
        env={"WANSYNC_FAULT": "rank=2,step=7,action=stop"},
        timeout=240,
    )  # never continued
    assert r.returncode == 0, r.stderr[-2000:]  # the workers still in the run ended well
    warnings = [line for line in r.stderr.splitlines() if "rank 2 was stopped (it hung)" in line]
    assert len(warnings) == 1 and "launcher ended it" in warnings[0] and "Traceback" not in r.stderr
    assert (out / "logs" / "rank2.err").read_text().strip() == warnings[0].removeprefix("wansync: warning: ")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["worker_failures"] == 1 and summary["rejoins"] == 0
    assert all_equal(final_models(out, [0, 1]))
    assert no_process_left(out)


# ---- workers of two ranks (DDP inside): one worker lives and dies whole ------------------------------
STEPS_2x2 = 20
IDENTITY_STEPS_2x2 = 2 * EVERY  # the fixed group's bits at both exchanges: the second takes the outer momentum on


def two_by_two(steps):
    return (
        "--workers",
        "2",
        "--ranks-per-worker",
        "2",
        "--steps",
        str(steps),
        "--eval-every",
        "1000",
        "--quiet",
        *TINY,
    )


TWO_BY_TWO = two_by_two(STEPS_2x2)


def side_by_side(legs: dict[str, tuple[str, ...]], timeout: float) -> None:
    """Runs that compare bits, not times, side by side: a fault-tolerant one waits on its quorum much of
    the time, which the other's compute fills."""
    started = {name: start(*args) for name, args in legs.items()}
    for name, running in started.items():
        r = running.result(timeout)
        assert r.returncode == 0, f"{name}: {r.stderr[-2000:]}"


def test_fault_tolerant_workers_of_two_ranks_train_what_the_fixed_group_trains_bit_for_bit(tmp_path):
    """Each rank averages its shard over its own quorum group and the worker puts the whole
    together: with no fault, the same parameters as the fixed group's sharded exchange."""
    runs = {name: tmp_path / name for name in ("fixed", "ft")}
    side_by_side(
        {
            name: ("train", "--strategy", "diloco", "--sync-every", str(EVERY), *extra)
            + (*two_by_two(IDENTITY_STEPS_2x2), "--out", str(runs[name]))
            for name, extra in (("fixed", ()), ("ft", ("--fault-tolerant", "--peer-timeout", "30")))
        },
        timeout=180,
    )
    models = final_models(runs["fixed"], range(4)) + final_models(runs["ft"], range(4))
    assert all_equal(models)
    summaries = [json.loads((runs[n] / "summary.json").read_text()) for n in ("fixed", "ft")]
    assert summaries[0]["bytes_between_workers"] == summaries[1]["bytes_between_workers"]


def sharded_model(run, worker):
    """A worker's final model (FSDP inside) as its DCP checkpoint holds it, read offline."""
    from test_sharded_workers import sharded_state

    return sharded_state(run, IDENTITY_STEPS_2x2, worker)["model"]


def test_workers_sharded_inside_train_what_the_fixed_group_trains_bit_for_bit(tmp_path):
    """FSDP inside: with no fault the fixed group's parameters bit for bit. A worker of two FSDP ranks
    killed, restarted whole and healed shard by shard (the model's and the inner optimizer's local
    shards, DTensors again on arrival) is the short chaos run's (tests/test_chaos.py: its anchors equal
    the others', local rank by local rank, at every step compared)."""
    runs = {name: tmp_path / name for name in ("fixed", "ft")}
    side_by_side(
        {
            name: ("train", "--strategy", "diloco", "--sync-every", str(EVERY), "--inside", "fsdp", *extra)
            + (*two_by_two(IDENTITY_STEPS_2x2), "--out", str(runs[name]))
            for name, extra in (("fixed", ()), ("ft", ("--fault-tolerant", "--peer-timeout", "30")))
        },
        timeout=240,
    )
    fixed = [sharded_model(runs["fixed"], w) for w in (0, 1)]
    assert all_equal(fixed + [sharded_model(runs["ft"], w) for w in (0, 1)])
    assert no_process_left(runs["ft"])


@pytest.mark.skipif(
    netns.unavailable() is None,
    reason="the namespace bed is here: tests/test_chaos.py kills a rank of a two-rank worker and checks its heal",
)
def test_a_worker_of_two_ranks_with_one_killed_is_restarted_whole_and_heals_rank_by_rank(tmp_path):
    """Rank 3 (worker 1's second) is killed: the launcher ends rank 2 with it and restarts both; each
    heals from the same rank of worker 0, and all four ranks end with the same parameters."""
    out = tmp_path / "run"
    r = wansync(
        "train",
        "--strategy",
        "diloco",
        "--sync-every",
        str(EVERY),
        "--fault-tolerant",
        "--peer-timeout",
        "60",
        "--max-restarts",
        "1",
        *TWO_BY_TWO,
        "--out",
        str(out),
        timeout=240,
        env={"WANSYNC_FAULT": "rank=3,step=7,action=kill;rank=0,step=13,action=pause,seconds=10"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["worker_failures"], summary["rejoins"], summary["heals"]) == (1, 1, 1), summary
    assert summary["steps_lost"][0] == 0 and summary["steps_lost"][1] > 0
    healed = [q for q in quorums(out, 1) if q["healed"]]
    assert len(healed) == 1 and 7 < healed[0]["step"] <= 15
    assert [json.loads(line)["rank"] for line in (out / "logs" / "heals.jsonl").read_text().splitlines()] == [1]
    assert all_equal(final_models(out, range(4)))
    assert no_process_left(out)


def test_a_worker_of_two_ranks_killed_inside_an_exchange_is_left_out_of_it_by_both_ranks_of_the_other(tmp_path):
    """Rank 2 (worker 1's first: its manager and store) dies inside the exchange of step 10: worker 0's
    two ranks, whose all-reduces may fail at different moments, retry it together without worker 1."""
    out = tmp_path / "run"
    r = wansync(
        "train",
        "--strategy",
        "diloco",
        "--sync-every",
        str(EVERY),
        "--fault-tolerant",
        "--peer-timeout",
        "20",
        *TWO_BY_TWO,
        "--out",
        str(out),
        timeout=240,
        env={"WANSYNC_FAULT": "rank=2,step=10,action=kill_in_exchange"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert [p for s, p in sync_participants(out)] == [2, 1, 1, 1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["worker_failures"] == 1 and summary["short_exchanges"] == [10, 15, 20]
    assert all_equal(final_models(out, [0, 1]))
    assert no_process_left(out)


# ---- a sparse exchange under the quorum: all-gathered over its members ---------------------------
def test_fault_tolerant_sparseloco_trains_what_the_fixed_group_trains_bit_for_bit(tmp_path):
    """No fault: the quorum's all-gather of the sparse payloads (each flagged valid) gives the fixed
    group's mean, the same pseudo-gradient bytes (the flag is booked apart)."""
    runs = {name: tmp_path / name for name in ("fixed", "ft")}
    two = ("--workers", "2", "--steps", "12", "--eval-every", "1000", "--quiet", *TINY)
    side_by_side(
        {
            name: ("train", "--strategy", "sparseloco", "--sync-every", "4", *extra, *two, "--out", str(runs[name]))
            for name, extra in (("fixed", ()), ("ft", ("--fault-tolerant", "--peer-timeout", "30")))
        },
        timeout=180,
    )
    assert all_equal(final_models(runs["fixed"], range(2)) + final_models(runs["ft"], range(2)))
    comm = [json.loads((runs[n] / "summary.json").read_text())["comm"]["pseudo_grads"] for n in ("fixed", "ft")]
    assert comm[0]["bytes"] == comm[1]["bytes"] and comm[0]["parts"] == comm[1]["parts"]


def test_a_sparseloco_worker_killed_heals_with_a_zero_error_buffer_and_every_rank_ends_alike(tmp_path):
    out = tmp_path / "run"
    r = run_four(
        out,
        "sparseloco",
        "--sync-every",
        str(EVERY),
        "--max-restarts",
        "1",
        peer_timeout=90,
        fault=f"rank=2,step={FAILS_AT},action=kill;rank=0,step=18,action=pause,seconds=30",
        setup=straggle_until_the_others_wait,  # as in killed_and_healed
    )
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["worker_failures"] == 1 and summary["heals"] == 1
    seen, healed_at = sync_participants(out), heal_step(out)
    assert all(p == 3 for s, p in seen if FAILS_AT < s < healed_at)
    assert all_equal(final_models(out, range(4)))
    assert no_process_left(out)
