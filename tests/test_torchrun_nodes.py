"""Real launches: two `torchrun` agents on this host acting as two nodes, each node one worker of two
ranks, train exactly what the local launcher trains with `--workers 2 --ranks-per-worker 2`: the same
final parameters, bit for bit (torchrun and its workers forked from tests/forked_python.py's stand-in).

They meet with `--rdzv-backend wansync` at a free port of 127.0.0.1, which both own: the first to bind
it hosts the rendezvous store and the other joins it as a client (they once both tried to host: one
agent ended in a traceback, "address already in use", the other waited for it until killed). The
wansync CLI adopts what torchrun sets (ranks, world, the worker of each rank) the same way whatever
the rendezvous; the namespace beds (test_hosts, test_secure_bed, test_chaos) run it across hosts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_harness import TINY, wansync
from forked_python import ForkedPython
from wansync.rundir import checkpoint
from wansync.workloads.lm.corpus import shakespeare_text

pytestmark = pytest.mark.timeout(300)

R = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_flags(corpus: Path, out: Path) -> list[str]:
    return [
        "train",
        "--strategy",
        "diloco",
        "--sync-every",
        "3",
        "--steps",
        "6",
        "--quiet",
        "--ranks-per-worker",
        str(R),
        "--data",
        str(corpus),
        "--eval-every",
        "100",
        *TINY,
        "--out",
        str(out),
    ]


def final_params(run: Path, world: int) -> list[torch.Tensor]:
    return [
        torch.cat([v.reshape(-1).float() for v in checkpoint.load_rank(run, rank, world)["model"].values()])
        for rank in range(world)
    ]


def torchrun_nodes(flags: list[str], timeout: float, python: ForkedPython) -> list[tuple[int, str]]:
    """Start two torchrun agents (the rendezvous numbers the nodes) and wait for both; every process
    they started is killed if they outlive `timeout`. The agents and their workers are forked from
    `python` (tests/forked_python.py)."""
    port = free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **python.env)
    nodes = [
        subprocess.Popen(
            [
                python.executable,
                str(Path(sys.executable).parent / "torchrun"),
                "--nnodes",
                "2",
                "--nproc-per-node",
                str(R),
                "--rdzv-backend",
                "wansync",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "wansync-test",
                "-m",
                "wansync",
                *flags,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    try:
        return [(p.wait(timeout=timeout), p.stdout.read()) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus, run): the local launcher's `--workers 2 --ranks-per-worker 2` run both tests compare with."""
    root = tmp_path_factory.mktemp("nodes")
    corpus = root / "plays.txt"
    corpus.write_text(shakespeare_text()[:200_000])
    local = wansync(*train_flags(corpus, root / "local"), "--workers", "2", timeout=240)
    assert local.returncode == 0, local.stderr
    return corpus, root / "local"


def test_two_torchrun_nodes_train_what_the_local_launcher_trains_bit_for_bit(local_run, tmp_path, forked_python):
    corpus, local = local_run
    results = torchrun_nodes(train_flags(corpus, tmp_path / "nodes"), timeout=240, python=forked_python)
    for code, output in results:
        assert code == 0, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    assert sum("wansync: under torchrun: rank 0 of 4" in out for _, out in results) == 1
    summary = json.loads((tmp_path / "nodes" / "summary.json").read_text())
    assert (summary["workers"], summary["steps"], summary["sync_events"]) == (2, 6, 2), summary
    ours, theirs = final_params(local, 4), final_params(tmp_path / "nodes", 4)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert all(torch.equal(ours[0], p) for p in ours)


def test_the_cli_trains_a_worker_of_two_ranks_as_one_rank_with_twice_the_batch(local_run, tmp_path):
    """Through the whole CLI (profiler hooks on DDP included: they once all-reduced a worker's
    gradients over every rank), not only the strategies' own loop."""
    corpus, two = local_run
    flags = train_flags(corpus, tmp_path / "one")
    r = wansync(*flags, "--workers", "2", "--ranks-per-worker", "1", "--batch-size", "8", timeout=240)
    assert r.returncode == 0, r.stderr
    mine, ref = final_params(two, 4)[0], final_params(tmp_path / "one", 2)[0]
    assert float((mine - ref).norm() / ref.norm()) <= 1e-5
