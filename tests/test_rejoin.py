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

from cli_harness import TINY
from test_rendezvous_one_host import free_port

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
    # node 0's worker trains slowly from step 24 to 47 (a second a step, alive: under every bound), time
    # enough for the node that dies at step 16 or so to come back while node 0 trains on
    slow = ";".join(f"rank=0,step={t},action=pause,seconds=1" for t in range(24, 48))
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
        wait_until(lambda: last_step(zero) >= 16, 90)
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
