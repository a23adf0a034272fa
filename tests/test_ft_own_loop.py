"""Fault tolerance in a user's own loop (docs/fault_tolerance.md, "In your own loop"): examples/ft_loop.py,
two workers on gloo/127.0.0.1 and torchft's lighthouse; worker 1 SIGKILLs itself at step 6 and is
restarted as its supervisor would (WANSYNC_RESTARTED=1), heals from worker 0 and trains on; both end
with the same parameters. Each worker is forked from the ranks' forkserver (torch preloaded) and runs
the example's own `__main__`, so a restart costs no interpreter start-up."""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

import wansync as ws
from wansync.errors import ConfigError
from wansync.runner.localgroup import rank_context

pytest.importorskip("torchft")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ft_loop.py"


def _example(argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """A worker process: its own process group (the test ends it whole), the example's `__main__`."""
    from cli_harness import into_files

    os.setsid()
    into_files(out, err, env, os.O_APPEND)
    sys.argv = [str(EXAMPLE), *argv]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


class Workers:
    """The example's worker processes; `close()` ends every process group one of them led."""

    def __init__(self, root: Path):
        self.root, self.procs, self.started = root, {}, []

    def start(self, worker: int, *argv: str, restarted: bool = False):
        env = dict(os.environ, WANSYNC_RESTARTED="1" if restarted else "0", RUST_LOG="warn")
        proc = rank_context().Process(
            target=_example, args=(list(argv), env, str(self.log(worker, "out")), str(self.log(worker, "err")))
        )
        proc.start()
        self.procs[worker] = proc
        self.started.append(proc)
        return proc

    def log(self, worker: int, kind: str) -> Path:
        return self.root / f"worker{worker}.{kind}"

    def text(self, worker: int, kind: str) -> str:
        path = self.log(worker, kind)
        return path.read_text() if path.is_file() else ""

    def close(self) -> None:
        for proc in self.started:
            for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
                try:
                    kill()
                except (ProcessLookupError, PermissionError, OSError, AttributeError):
                    pass
            proc.join(5)


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_worker_killed_in_a_users_loop_is_restarted_heals_from_its_peer_and_training_goes_on(tmp_path):
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=5000, heartbeat_timeout_ms=1000)
    address = "127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    out = tmp_path / "runs"
    common = [
        "--workers",
        "2",
        "--lighthouse",
        address,
        "--out",
        str(out),
        "--steps",
        "32",
        "--sync-every",
        "4",
        "--peer-timeout",
        "5",
        "--step-time",
        "0.1",
    ]
    workers = Workers(tmp_path)
    t0 = time.monotonic()
    try:
        w0 = workers.start(0, "--worker", "0", *common)
        w1 = workers.start(1, "--worker", "1", *common, "--die-at", "6")
        w1.join(60)
        assert w1.exitcode == -signal.SIGKILL, workers.text(1, "err")
        assert w0.exitcode is None, "the survivor must still be training when the restart comes"
        w1 = workers.start(1, "--worker", "1", *common, "--die-at", "6", restarted=True)  # the supervisor
        for proc in (w0, w1):
            proc.join(60)
        assert (w0.exitcode, w1.exitcode) == (0, 0), workers.text(0, "err") + workers.text(1, "err")
        elapsed = time.monotonic() - t0
    finally:
        workers.close()
        lighthouse.shutdown()
    assert not any(_alive(p.pid) for p in workers.started)

    # the heal is visible: the restarted worker's one line, and its heals.jsonl past the death step
    assert "rejoined the run and healed from a live peer at step" in workers.text(1, "err")
    heals = [json.loads(line) for line in (out / "worker1" / "logs" / "heals.jsonl").read_text().splitlines()]
    assert len(heals) == 1 and heals[0]["rank"] == 1 and 6 < heals[0]["step"] < 32
    # worker 0 went on past the death; its quorum's membership changed (a new life of worker 1, the
    # dead one left out first when the restart came later than the heartbeat timeout); 2 at the end
    quorums = [json.loads(line) for line in (out / "worker0" / "logs" / "quorum_rank0.jsonl").read_text().splitlines()]
    counts = [q["participants"] for q in quorums if q["step"] > 0]
    ids = [q["quorum_id"] for q in quorums if q["step"] > 0]
    assert ids[-1] > ids[0] and counts[-1] == 2 and quorums[-1]["step"] == 32, quorums
    # training went on in the restarted worker (its metrics continue from the healed step) ...
    steps = [
        json.loads(line)["step"]
        for line in (out / "worker1" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["type"] == "step"
    ]
    assert steps[-1] == 32 and steps[steps.index(6) + 1] > 7, steps
    assert "worker 1 (restarted): 32 steps" in workers.text(1, "out")
    # ... and both end with the same parameters, those of a model that learned
    final = [torch.load(out / f"worker{w}" / "final.pt") for w in (0, 1)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    summary = json.loads((out / "worker0" / "summary.json").read_text())
    assert summary["final_val_loss"] < 1.0
    print(f"\nfault-tolerant own loop: {elapsed:.1f} s, healed at step {heals[0]['step']}, participants {counts}")


def test_an_unreachable_lighthouse_is_one_line_and_a_non_zero_exit_within_the_peer_timeout(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = Workers(tmp_path)
    t0 = time.monotonic()
    try:
        proc = workers.start(
            0,
            "--worker",
            "0",
            "--workers",
            "2",
            "--lighthouse",
            f"127.0.0.1:{port}",
            "--peer-timeout",
            "1",
            "--out",
            str(tmp_path / "runs"),
        )
        proc.join(30)
        elapsed = time.monotonic() - t0
    finally:
        workers.close()
    lines = workers.text(0, "err").strip().splitlines()
    assert proc.exitcode not in (0, None) and elapsed < 10
    assert "Traceback" not in workers.text(0, "err")
    assert lines[-1].startswith("ft_loop: error: cannot reach the lighthouse at http://127.0.0.1:"), lines


def test_bad_options_and_unsupported_strategies_are_refused_in_one_line(monkeypatch):
    monkeypatch.delenv("WANSYNC_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match="needs a lighthouse"):
        ws.FaultTolerance(worker=0, workers=2)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        ws.FaultTolerance(lighthouse="localhost", worker=0, workers=2)
    with pytest.raises(ConfigError, match=r"worker must be in 0\.\.1"):
        ws.FaultTolerance(lighthouse="127.0.0.1:1", worker=2, workers=2)
    ft = ws.FaultTolerance(lighthouse="127.0.0.1:1", worker=0, workers=2)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="fault_tolerant= does not support ddp: it all-reduces gradients"):
        ws.strategy("ddp", model, optimizer, fault_tolerant=ft)
    with pytest.raises(ConfigError, match="fp32 only"):
        ws.strategy("diloco", model, optimizer, fault_tolerant=ft, codec="int8")
