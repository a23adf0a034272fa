"""Every wait of a fault-tolerant run is bounded by its timeouts, and every failure is one line.

Three ways a fault-tolerant run cannot start, each injected: a worker stopped at start-up (before it
joins), a lighthouse that accepts connections and never answers, and one that waits for more workers
than the run has. Each run ends non-zero within 3 x --peer-timeout + 10 s (the start-up join's
deadline, `ft.member.join_quorum`, and the time to start and end the processes), with at most 3 lines
on stderr, no traceback, rank logs under 1 MB (torchft's own lines go there, and a traceback is
bounded), and no process left behind. Beside them a clean fault-tolerant run, whose stderr is empty
(torchft's lines used to fill the terminal). The four run side by side, to keep the suite short.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cli_harness import TINY, no_process_left, start
from wansync.runner.localgroup import rank_context

pytest.importorskip("torchft")

PEER_TIMEOUT = 3
BOUND_S = 3 * PEER_TIMEOUT + 10


class BlackHole:
    """A TCP server that accepts every connection and never answers (a hung lighthouse)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        try:
            while True:
                self.conns.append(self.sock.accept()[0])
        except OSError:  # closed
            pass

    def close(self):
        for c in self.conns:
            c.close()
        self.sock.close()


def greedy_lighthouse():
    """torchft's lighthouse wanting 3 replicas (the runs have 2): a quorum that cannot form. Its
    address once it listens, and the process."""
    exe = Path(sys.executable).parent / "torchft_lighthouse"
    proc = subprocess.Popen(
        [str(exe), "--min_replicas", "3", "--bind", "127.0.0.1:0", "--join_timeout_ms", "100"],
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, RUST_LOG="info"),
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if found := re.search(r"listening on: http://[^:]+:(\d+)", line):
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # drain it
            return f"127.0.0.1:{found.group(1)}", proc
    proc.kill()
    raise TimeoutError("torchft's lighthouse did not start")


def run(out: Path, *extra: str, fault: str | None = None, strategy: str = "local_sgd"):
    """A 2-worker fault-tolerant run on a small corpus of its own (a worker starts faster on it)."""
    out.mkdir(parents=True)
    (out.parent / "corpus.txt").write_text("to be or not to be, that is the question\n" * 400)
    return start(
        "train",
        "--strategy",
        strategy,
        "--sync-every",
        "2",
        "--workers",
        "2",
        "--steps",
        "4",
        "--fault-tolerant",
        "--peer-timeout",
        str(PEER_TIMEOUT),
        "--eval-every",
        "1000",
        "--quiet",
        "--out",
        str(out),
        *TINY,
        "--data",
        str(out.parent / "corpus.txt"),
        *extra,
        env={"WANSYNC_FAULT": fault} if fault else None,
    )


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    """The four runs, started side by side: name -> (result, seconds, run directory). Whatever
    happens, nothing they or the fixture started outlives it."""
    root = tmp_path_factory.mktemp("bounded")
    warm = rank_context().Process(target=int)  # the forkserver's start (importing torch) is the
    warm.start()  # harness's, not the runs'
    warm.join()
    hole, greedy, running = BlackHole(), None, {}
    try:
        address, greedy = greedy_lighthouse()
        t0 = time.monotonic()
        running = {
            "clean": (run(root / "clean", "--outer-momentum", "0", strategy="diloco"), root / "clean"),
            "stopped at start-up": (run(root / "a", fault="rank=1,step=0,action=stop"), root / "a"),
            "a lighthouse that never answers": (run(root / "b", "--lighthouse", f"127.0.0.1:{hole.port}"), root / "b"),
            "a quorum that cannot form": (run(root / "c", "--lighthouse", address), root / "c"),
        }
        ends = ended_at({name: proc for name, (proc, _) in running.items()}, timeout=120)
        return {name: (proc.result(timeout=10), ends[name] - t0, out) for name, (proc, out) in running.items()}
    finally:
        for proc, _ in running.values():
            proc.kill()
        hole.close()
        if greedy is not None:
            greedy.kill()
            greedy.wait()


def ended_at(procs: dict, timeout: float) -> dict[str, float]:
    """When each of the running CLIs ended (time.monotonic(), polled every 50 ms)."""
    ends: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(ends) < len(procs) and time.monotonic() < deadline:
        ends.update({name: time.monotonic() for name, p in procs.items() if name not in ends and not p.running()})
        time.sleep(0.05)
    return {name: ends.get(name, float("inf")) for name in procs}


CASES = ("stopped at start-up", "a lighthouse that never answers", "a quorum that cannot form")
CAUSES = {
    "stopped at start-up": "only 1 of 2 workers joined",
    "a lighthouse that never answers": "formed no quorum",
    "a quorum that cannot form": "formed no quorum",
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES)
def test_a_fault_tolerant_run_that_cannot_start_ends_in_one_line_within_its_timeouts(ended, case):
    result, seconds, out = ended[case]
    assert result.returncode != 0 and seconds <= BOUND_S, (result.returncode, seconds)
    lines = result.stderr.strip().splitlines()
    assert len(lines) <= 3 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert CAUSES[case] in lines[-1] and lines[-1].startswith("wansync: error: "), lines[-1]
    logs = [p.stat().st_size for p in (out / "logs").glob("rank*.log")]
    assert logs and max(logs) < 1 << 20
    assert no_process_left(out)


@pytest.mark.timeout(240)
def test_a_clean_fault_tolerant_run_leaves_torchfts_lines_to_the_rank_logs(ended):
    """torchft logged 100+ lines per run on the terminal: now its warnings go to logs/rank<r>.log."""
    result, _, out = ended["clean"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == "", result.stderr[-3000:]
    assert max(p.stat().st_size for p in (out / "logs").glob("rank*.log")) < 1 << 20
    assert no_process_left(out)
