"""A node that dies whole (its torchrun agent and every worker) and is started again with the same command
takes its place again in a fault-tolerant run (`runner.rendezvous.LateJoin`): the others train on and
are not restarted, its worker heals from a live peer, and both agents end together, at once. Under plain
c10d the agents of the live nodes restarted their own workers from step 0 to hold a new round, or
waited 300 s in torchrun's exit barrier for the dead one (docs/fault_tolerance.md, benchmarks/chaos.py).

Two nodes on one machine (127.0.0.1), each with its own run directory: nothing shared but the
rendezvous."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import netns
from cli_harness import TINY
from test_torchrun_nodes import free_port

pytestmark = pytest.mark.timeout(240)


def agent(port: int, out: Path, flags: list[str], log: Path, **extra: str) -> subprocess.Popen:
    """One torchrun node of one rank on the wansync rendezvous at 127.0.0.1:`port`, training into `out`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    command += ["--rdzv-backend", "wansync", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "rejoin"]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **extra)
    with open(log, "w") as f:
        return subprocess.Popen(
            [*command, "-m", "wansync", *flags, "--out", str(out)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=out.parent,
        )


def listening(port: int) -> bool:
    """the first agent hosts the rendezvous store"""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def last_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines()] if path.is_file() else []
    return max(steps, default=0)


def wait_until(what, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what.__doc__}"
        time.sleep(0.1)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (a worker may run in a session of its own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_group(p: subprocess.Popen) -> None:
    """The agent and everything it started, at once (a host that dies)."""
    for pid in [p.pid, *descendants(p.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


@pytest.mark.skipif(
    netns.unavailable() is None,
    reason="the namespace bed is here: tests/test_chaos.py restarts a host whole across three hosts, with these checks",
)
def test_a_node_killed_whole_and_started_again_rejoins_without_restarting_the_others(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 400)
    flags = ["train", "--strategy", "diloco", "--sync-every", "4", "--steps", "80", "--fault-tolerant"]
    flags += ["--max-restarts", "1", "--peer-timeout", "4", "--eval-every", "1000", "--quiet", *TINY]
    flags += ["--data", str(corpus)]
    port = free_port()
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        out.mkdir()
    # node 0's worker trains slowly from step 20 to 37 (a second a step, alive: under every bound), time
    # enough for the node that dies at step 12 or so to come back while node 0 trains on
    slow = ";".join(f"rank=0,step={t},action=pause,seconds=1" for t in range(20, 38))
    agents = [agent(port, outs[0], flags, tmp_path / "a.log", WANSYNC_FAULT=slow)]
    again = None
    try:
        # node a first, so that it hosts the rendezvous store (the first agent to bind the port): the
        # store's host cannot die and leave the run (in a real run, the endpoint's host)
        wait_until(lambda: listening(port), 60)
        agents.append(agent(port, outs[1], flags, tmp_path / "b.log"))
        # which node holds rank 1 (c10d orders the nodes by its own descriptor, not by start)
        wait_until(lambda: any((o / "logs" / "rank1.pid").exists() for o in outs), 60)
        one = next(i for i, o in enumerate(outs) if (o / "logs" / "rank1.pid").exists())
        zero = outs[1 - one]
        assert one == 1, "the node that hosts the store has rank 0 (c10d orders one machine's nodes by pid)"
        wait_until(lambda: last_step(zero) >= 12, 90)
        kill_group(agents[one])  # the node dies whole: agent, supervisor, worker
        killed_at = last_step(zero)
        again = agent(port, outs[one], flags, tmp_path / "again.log")
        codes = [agents[1 - one].wait(timeout=150), again.wait(timeout=150)]
    finally:
        for p in [*agents, *([again] if again else [])]:
            kill_group(p)
    logs = {name: (tmp_path / name).read_text() for name in (f"{zero.name}.log", "again.log")}
    assert codes == [0, 0], logs
    assert "takes its place" in logs["again.log"], logs["again.log"][-3000:]
    assert "Traceback" not in "".join(logs.values()), logs
    summary = json.loads((zero / "summary.json").read_text())
    assert summary["heals"] >= 1 and summary["rejoins"] >= 1, summary
    # node 0's worker was never restarted: its quorum log only moves forward, past the kill
    slots = [json.loads(line)["step"] for line in (zero / "logs" / "quorum_rank0.jsonl").read_text().splitlines()]
    assert slots == sorted(slots) and slots[-1] > killed_at, slots
    # the rejoined worker healed to its peer's step and finished the run with it
    assert last_step(outs[one]) == 80 or (outs[one] / "logs" / "heals.jsonl").read_text().strip()


def test_a_rejoined_rank_meets_the_others_agreement_and_is_held_to_their_flags_not_their_start():
    """It agrees in rank 0's round, long after the others did; it heals, so it may start afresh where
    they resumed, but not with other flags."""
    import datetime
    import threading

    import torch.distributed as dist

    from wansync.errors import ConfigError
    from wansync.runner.agreement import agree
    from wansync.runner.torchrun import TorchrunEnv

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    envs = [TorchrunEnv(r, 2, "127.0.0.1", server.port, 0, 1, "run", 0, agent_store=True) for r in (0, 1)]
    config = {"strategy": "diloco", "lr": 0.001}
    threads = [threading.Thread(target=agree, args=(envs[r], config, 8, 20)) for r in (0, 1)]  # both resumed at 8
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    back = TorchrunEnv(1, 2, "127.0.0.1", server.port, 0, 1, "run", 0, agent_store=True, rejoined=True)
    assert agree(back, config, 0, 5).round == 1  # the others' round, and its fresh start is no objection
    with pytest.raises(ConfigError, match=r"different training flags \(lr\)"):
        agree(back, {**config, "lr": 0.002}, 0, 5)


def test_a_node_that_comes_back_to_a_run_that_is_not_fault_tolerant_is_refused_in_one_line(tmp_path):
    from wansync.config import Config
    from wansync.errors import ConfigError
    from wansync.runner.run import adopt
    from wansync.runner.torchrun import TorchrunEnv
    from wansync.strategies import resolve_options

    cfg = Config(strategy="diloco")
    with socket.socket() as node0:  # where torchrun told it to meet the others: something answers
        node0.bind(("127.0.0.1", 0))
        node0.listen()
        back = TorchrunEnv(1, 2, "127.0.0.1", node0.getsockname()[1], rejoined=True)
        with pytest.raises(ConfigError, match="only a --fault-tolerant run takes a node back"):
            adopt(back, cfg, resolve_options("diloco", vars(cfg)), tmp_path / "run", resume=False)


def test_a_node_takes_the_place_of_a_gone_node_of_its_own_address_only(monkeypatch):
    """`LateJoin` on a store like the rendezvous': rank 0 formed a round of three; rank 1 (10.0.0.2)
    stopped heartbeating, rank 2 (10.0.0.3) beats on. A node of 10.0.0.2 takes rank 1's place; one of
    10.0.0.3 finds no place (its node is alive) and one of another address none either: both go through
    c10d. Before a round is formed nobody takes a place."""
    import datetime
    import threading

    import torch.distributed as dist

    from wansync.runner import rendezvous

    monkeypatch.setattr(rendezvous, "GONE_AFTER_S", 0.3)
    monkeypatch.delenv(rendezvous.REJOINED_ENV, raising=False)
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    assert rendezvous.LateJoin(None, store, "run", "10.0.0.2").vacant_place() is None  # not formed yet
    ns = "wansync/rdzv/run"
    formed = {"round": 1, "world_size": 3, "master_addr": "10.0.0.1", "master_port": 29500}
    store.set(f"{ns}/formed", json.dumps(formed))
    for rank, addr in enumerate(["10.0.0.1", "10.0.0.2", "10.0.0.3"]):
        store.set(f"{ns}/r1/member/{rank}", addr)
        store.add(f"{ns}/r1/alive/{rank}", 1)
    stop = threading.Event()

    def beat() -> None:  # rank 2's agent, checking on its workers ten times a second
        while not stop.is_set():
            store.add(f"{ns}/r1/alive/2", 1)
            time.sleep(0.05)

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        assert rendezvous.LateJoin(None, store, "run", "10.0.0.3").vacant_place() is None
        assert rendezvous.LateJoin(None, store, "run", "10.0.0.9").vacant_place() is None
        back = rendezvous.LateJoin(None, store, "run", "10.0.0.2")
        place = back.vacant_place()
        assert place == (formed, 1)
        info = back.take(*place)
    finally:
        stop.set()
        beater.join()
    assert (info.rank, info.world_size) == (1, 3)
    assert (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) == ("10.0.0.1", 29500)
    assert os.environ.pop(rendezvous.REJOINED_ENV) == "1"  # its workers inherit it
    store.set(f"{ns}/r1/agents/torchelastic/assigned_ranks/1", "[1, 3, 1, 3]")  # as rank 0's agent wrote it
    assert info.store.get("torchelastic/assigned_ranks/1") == b"[1, 3, 1, 3]"  # the round's store of the others
    assert back.num_nodes_waiting() == 0  # it never makes the others restart
