"""The environment cannot silently override the command line: a torchrun environment is adopted
only when complete and consistent, with one line saying so; anything else is refused in one line."""

from __future__ import annotations

import os
import socket

import pytest

from cli_harness import TINY, wansync

pytestmark = pytest.mark.timeout(150)

TRAIN = ["train", "--strategy", "ddp", "--steps", "2", "--quiet", *TINY]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def torchrun(rank: str = "0", world: str = "1", addr: str = "127.0.0.1", port: str | None = None) -> dict[str, str]:
    return {"RANK": rank, "WORLD_SIZE": world, "MASTER_ADDR": addr, "MASTER_PORT": port or free_port()}


CASES = [
    (
        "a stale environment against --workers 2",
        torchrun(),
        ["--workers", "2"],
        "says WORLD_SIZE=1 (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set) but this run has --workers 2",
    ),
    (
        "a partial environment",
        {"RANK": "0", "WORLD_SIZE": "2"},
        [],
        "incomplete torchrun environment: RANK, WORLD_SIZE set but MASTER_ADDR, MASTER_PORT not",
    ),
    ("RANK not a number", torchrun(rank="abc"), [], "RANK must be an integer in [0, 0], got 'abc'"),
    ("RANK beyond WORLD_SIZE", torchrun(rank="3", world="2"), [], "RANK must be an integer in [0, 1], got '3'"),
    ("WORLD_SIZE zero", torchrun(world="0"), [], "WORLD_SIZE must be an integer >= 1, got '0'"),
    ("MASTER_PORT out of range", torchrun(port="99999"), [], "MASTER_PORT must be an integer in [1, 65535]"),
    (
        "a world that workers of R ranks cannot fill",
        torchrun(world="3"),
        ["--ranks-per-worker", "2"],
        "WORLD_SIZE=3, which workers of --ranks-per-worker 2 cannot fill",
    ),
    (
        "--workers x --ranks-per-worker against WORLD_SIZE",
        torchrun(world="2"),
        ["--workers", "2", "--ranks-per-worker", "2"],
        "says WORLD_SIZE=2 (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set) but this run has --workers 2 x "
        "--ranks-per-worker 2",
    ),
    (
        "node 0 advertised at a loopback address (its host name resolves to 127.0.0.1)",
        {**torchrun(rank="1", world="2"), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},
        [],
        "a loopback address where nothing answers on this host (node 0's host name resolves to a loopback address): "
        "start torchrun with --rdzv-backend wansync",
    ),
]


@pytest.mark.parametrize("label, env, flags, expect", CASES, ids=[c[0] for c in CASES])
def test_an_environment_that_does_not_fit_is_refused_in_one_line(tmp_path, label, env, flags, expect):
    r = wansync(*TRAIN, *flags, "--out", str(tmp_path / "run"), env=env, timeout=120)
    assert r.returncode == 1, f"{label}: {r.stdout} {r.stderr}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wansync: error: ") and expect in lines[0], r.stderr
    assert not (tmp_path / "run").exists()


def test_a_complete_environment_is_adopted_and_says_so(tmp_path):
    env = torchrun()
    run = tmp_path / "run"
    r = wansync(*TRAIN, "--out", str(run), env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"wansync: under torchrun: rank 0 of 1, rendezvous 127.0.0.1:{env['MASTER_PORT']}" in r.stdout.splitlines()
    assert "workers = 1" in (run / "config.toml").read_text()


def test_gloo_binds_the_interface_of_the_route_to_the_rendezvous(monkeypatch):
    from wansync.runner.torchrun import GLOO_IFNAME, TorchrunEnv, join_network

    monkeypatch.delenv(GLOO_IFNAME, raising=False)
    join_network(TorchrunEnv(0, 1, "127.0.0.1", 29400))
    assert os.environ[GLOO_IFNAME].startswith("lo")
    monkeypatch.setenv(GLOO_IFNAME, "eth7")  # one the user set is kept
    join_network(TorchrunEnv(0, 1, "127.0.0.1", 29400))
    assert os.environ[GLOO_IFNAME] == "eth7"


def test_the_rendezvous_plugin_advertises_the_route_and_hosts_where_it_owns_the_endpoint():
    from wansync.runner.rendezvous import advertised_address
    from wansync.runner.route import owns, route_to

    assert advertised_address("127.0.0.1") == "127.0.0.1"  # every node on this machine
    assert owns("127.0.0.1") and not owns("192.0.2.1")  # TEST-NET: no host owns it
    assert route_to("127.0.0.1").loopback and route_to("127.0.0.1").interface.startswith("lo")


BASE = {"strategy": "diloco", "lr": 0.001, "sync_every": 3, "model": "micro", "seed": 0}


@pytest.mark.parametrize("key, value", [("strategy", "local_sgd"), ("lr", 0.002), ("sync_every", 4), ("model", "tiny")])
def test_a_node_with_another_training_flag_is_refused_in_one_line_naming_the_key(key, value):
    from wansync.errors import ConfigError
    from wansync.runner.agreement import check_same

    with pytest.raises(
        ConfigError,
        match=rf"different training flags \({key}\): rank 1 has {key}={value} where " rf"rank 0 has {key}={BASE[key]}",
    ):
        check_same({"config": BASE, "start": 0}, {"config": {**BASE, key: value}, "start": 0}, 1)


def test_a_node_that_resumes_while_another_starts_afresh_is_refused():
    from wansync.errors import ConfigError
    from wansync.runner.agreement import check_same

    with pytest.raises(ConfigError, match="rank 1 resumes from the checkpoint of step 4 but rank 0 starts afresh"):
        check_same({"config": BASE, "start": 0}, {"config": BASE, "start": 4}, 1)


def test_the_ranks_meet_in_torchruns_store_and_share_the_machines_cores():
    """Two ranks of one launch (two threads here) against a store like torchrun's agent serves."""
    import datetime
    import threading

    import torch.distributed as dist
    from wansync.runner.agreement import agree
    from wansync.runner.torchrun import TorchrunEnv

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    envs = [TorchrunEnv(r, 2, "127.0.0.1", server.port, 0, 1, "run", 0, agent_store=True) for r in (0, 1)]
    seen: dict[int, object] = {}

    def rank(r: int, config: dict) -> None:
        try:
            seen[r] = agree(envs[r], config, 0, 20)
        except Exception as e:  # noqa: BLE001 - the test reads what each rank got
            seen[r] = e

    threads = [threading.Thread(target=rank, args=(r, BASE)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [a.ranks_here for a in seen.values()] == [2, 2]  # one machine: its cores halved
    assert seen[0].threads == max(1, len(os.sched_getaffinity(0)) // 2)
    envs = [TorchrunEnv(r, 2, "127.0.0.1", server.port, 0, 1, "run", 1, agent_store=True) for r in (0, 1)]
    threads = [threading.Thread(target=rank, args=(r, {**BASE, "lr": 0.001 * (r + 1)})) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all("different training flags (lr)" in str(e) for e in seen.values()), seen  # both refuse
    refusal = "refusing to train into runs/x: it is not empty and not a wansync run"
    threads = [
        threading.Thread(
            target=lambda r=r: seen.__setitem__(
                r,
                _agree_or_error(
                    TorchrunEnv(r, 2, "127.0.0.1", server.port, 0, 1, "run", 2, agent_store=True),
                    refusal if r == 0 else None,
                ),
            )
        )
        for r in (0, 1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert str(seen[1]) == f"rank 0 will not start: {refusal}"  # nobody waits for rank 0


def _agree_or_error(env, refused):
    from wansync.runner.agreement import agree

    try:
        return agree(env, BASE, 0, 20, refused)
    except Exception as e:  # noqa: BLE001 - the test reads what each rank got
        return e


def test_a_fault_tolerant_rank_that_left_the_run_waits_for_its_end_and_never_for_a_run_none_will_end():
    import datetime

    import torch.distributed as dist
    from wansync.ft.nodes import Nodes
    from wansync.runner.torchrun import TorchrunEnv

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    nodes = [Nodes(TorchrunEnv(r, 2, "127.0.0.1", server.port, 0, 1, "ft", 0, agent_store=True), 10) for r in (0, 1)]
    for n in nodes:
        n.report({"failures": 1})
    assert not nodes[1].wait_for_end(2)  # both failed for good: nobody will end it
    nodes[0].end()
    assert nodes[1].wait_for_end(2)
    assert nodes[0].reports(2, 1) == {0: {"failures": 1}, 1: {"failures": 1}}


@pytest.mark.parametrize("key, value", [("steps", 40), ("eval_every", 7), ("checkpoint_every", 5)])
def test_nodes_given_a_different_schedule_of_collectives_are_refused(key, value):
    """--steps, --eval-every and --checkpoint-every change no math (a resume may change them) but decide
    when every rank meets the others: the nodes must agree on them as on the fingerprint."""
    from wansync.config import build_config, fingerprint
    from wansync.errors import ConfigError
    from wansync.runner.agreement import check_same, shared
    from wansync.strategies import resolve_options

    mine = build_config(overrides={"strategy": "diloco", "steps": 20, "eval_every": 5, "checkpoint_every": 10})
    theirs = build_config(
        overrides={"strategy": "diloco", "steps": 20, "eval_every": 5, "checkpoint_every": 10, key: value}
    )
    records = [
        {"config": shared(fingerprint(c, resolve_options("diloco", vars(c))), c), "start": 0} for c in (mine, theirs)
    ]
    with pytest.raises(ConfigError, match=rf"different training flags \({key}\): rank 1 has {key}={value} "):
        check_same(records[0], records[1], 1)
    check_same(records[0], records[0], 1)
