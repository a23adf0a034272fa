"""`torchrun --rdzv-backend wansync` with two agents on one host (two nodes of one machine): both own
the endpoint's address, so the first to bind its port hosts the rendezvous store and the other joins
it as a client. They once both tried to host: one agent ended in a traceback ("address already in
use"), the other waited for it until killed."""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from cli_harness import TINY
from wansync.runner.rendezvous import rendezvous_store

pytestmark = pytest.mark.timeout(240)

TIMEOUT = datetime.timedelta(seconds=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_agent_that_finds_the_port_taken_joins_the_store_hosted_there():
    host = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT)  # the agent that bound first
    joined, _ = rendezvous_store("127.0.0.1", host.port, None, TIMEOUT)
    joined.set("node1", "here")
    assert host.get("node1") == b"here"


def test_an_agent_told_to_host_where_the_port_is_taken_says_so():
    """`--rdzv-conf is_host=1` is obeyed: no quiet fallback to a client of whatever holds the port."""
    host = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT)
    with pytest.raises(RendezvousConnectionError, match=f"cannot open the store at 127.0.0.1:{host.port}: .*in use"):
        rendezvous_store("127.0.0.1", host.port, True, TIMEOUT)


def test_two_agents_on_one_host_train_with_the_wansync_rendezvous(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 400)
    out = tmp_path / "run"
    flags = [
        "train",
        "--strategy",
        "ddp",
        "--steps",
        "4",
        "--quiet",
        "--eval-every",
        "100",
        *TINY,
        "--data",
        str(corpus),
        "--out",
        str(out),
    ]
    results = two_agents(flags, timeout=180)
    for code, output in results:
        assert code == 0, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    assert sum("wansync: under torchrun: rank 0 of 2" in output for _, output in results) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["workers"], summary["steps"]) == (2, 4)


def two_agents(flags: list[str], timeout: float) -> list[tuple[int, str]]:
    """Two torchrun agents, two nodes of one rank, meeting at a free port of 127.0.0.1: (exit
    status, output) of each. Every process they started is killed if they outlive `timeout`."""
    port = free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "wansync",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "one-host",
                "-m",
                "wansync",
                *flags,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            cwd=Path(flags[-1]).parent,
        )
        for _ in range(2)
    ]
    deadline = time.monotonic() + timeout
    try:
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in agents]
        return [(p.returncode, output) for p, output in zip(agents, outputs)]
    finally:
        for p in agents:  # an agent, or a worker it left behind
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
