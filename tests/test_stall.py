"""A step stuck on every rank at once ends the run in one line (`trainer.stall`).

A rank that hangs alone is ended by its peers' timeouts; when every rank hangs, each rank's watchdog
ends it: a `--data` workload whose next_batch() never returns from step 2 on, on both ranks, and one
whose loss (the forward) never returns, each end non-zero with one line naming the rank, the step and
the part (data, compute), long before the test would give up, and nothing left running. A run whose
steps are slow (each one's data longer than --peer-timeout, under the bound of twice it) trains to the
end; and under torchrun the ranks say their own line. The runs go side by side, to keep the file short.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_harness import no_process_left, start
from wansync.runner.localgroup import rank_context
from wansync.trainer.loop import Phase
from wansync.trainer.stall import Watchdog, bound_s, overdue

pytestmark = pytest.mark.timeout(240)

PEER_TIMEOUT = 3
BOUND_S = 2 * PEER_TIMEOUT
ENDS_WITHIN_S = 90  # start-up, the first step, the bound and the teardown on a loaded machine

STALLING = '''
import time

import torch
import torch.nn.functional as F
from torch import nn

FOREVER = 3600


class Stalling:
    """Points in two classes; from batch `stall_at` on, next_batch() (data) or loss() (compute)
    sleeps `seconds`."""

    kind = "vision"

    def __init__(self, spec, part, stall_at, seconds):
        self.part, self.stall_at, self.seconds = part, stall_at, seconds
        self.stream = torch.Generator().manual_seed(spec.seed * 1000 + spec.rank)
        self.model = nn.Linear(8, 2)
        self.batches = 0

    def draw(self, n, generator):
        x = torch.randn(n, 8, generator=generator)
        return x, (x[:, 0] > 0).long()

    def next_batch(self):
        self.batches += 1
        if self.part == "data" and self.batches >= self.stall_at:
            time.sleep(self.seconds)
        return self.draw(4, self.stream)

    def loss(self, model, batch):
        if self.part == "compute" and torch.is_grad_enabled() and self.batches >= self.stall_at:
            time.sleep(self.seconds)
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model):
        x, y = self.draw(64, torch.Generator().manual_seed(1))
        logits = model(x)
        return {"test_loss": float(F.cross_entropy(logits, y)),
                "test_acc": 100.0 * float((logits.argmax(1) == y).float().mean())}


def data_hangs(spec):
    return Stalling(spec, "data", 2, FOREVER)


def compute_hangs(spec):
    return Stalling(spec, "compute", 2, FOREVER)


def slow_data(spec):
    return Stalling(spec, "data", 2, 3.5)
'''


def flags(plugin: Path, factory: str, out: Path, steps: int = 4) -> list[str]:
    return [
        "train",
        "--data",
        f"{plugin}:{factory}",
        "--strategy",
        "ddp",
        "--workers",
        "2",
        "--steps",
        str(steps),
        "--peer-timeout",
        str(PEER_TIMEOUT),
        "--eval-every",
        "100",
        "--batch-size",
        "4",
        "--threads",
        "1",
        "--quiet",
        "--out",
        str(out),
    ]


def torchrun(plugin: Path, out: Path) -> subprocess.Popen:
    """One torchrun agent of two ranks on this host, the data stalling on both."""
    args = flags(plugin, "data_hangs", out)
    args.remove("--workers")
    args.remove("2")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "wansync",
            *args,
        ],
        env=dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    """The runs, started side by side: name -> (result, seconds, run directory); the torchrun agent's
    (exit status, output, seconds, its processes left when it ended). Nothing they started outlives the fixture."""
    root = tmp_path_factory.mktemp("stall")
    plugin = root / "stalling.py"
    plugin.write_text(STALLING)
    warm = rank_context().Process(target=int)  # the forkserver's start is the harness's, not the runs'
    warm.start()
    warm.join()
    t0 = time.monotonic()
    agent = torchrun(plugin, root / "torchrun")
    runs = {
        name: (start(*flags(plugin, factory, root / name, **extra)), root / name)
        for name, factory, extra in (
            ("data", "data_hangs", {}),
            ("compute", "compute_hangs", {}),
            ("slow", "slow_data", {"steps": 3}),
        )
    }
    try:
        ends = {}
        while len(ends) < len(runs) + 1 and time.monotonic() - t0 < ENDS_WITHIN_S:
            ends.update(
                {
                    name: time.monotonic() - t0
                    for name, (proc, _) in runs.items()
                    if name not in ends and not proc.running()
                }
            )
            if "torchrun" not in ends and agent.poll() is not None:
                ends["torchrun"] = time.monotonic() - t0
            time.sleep(0.05)
        output, _ = agent.communicate(timeout=max(1.0, ENDS_WITHIN_S - (time.monotonic() - t0)))
        results = {
            name: (proc.result(timeout=10), ends.get(name, float("inf")), out) for name, (proc, out) in runs.items()
        }
        results["torchrun"] = (
            agent.returncode,
            output,
            ends.get("torchrun", float("inf")),
            processes_naming(root / "torchrun"),
        )
        return results
    finally:
        for proc, _ in runs.values():
            proc.kill()
        for pid in [agent.pid, *processes_naming(root / "torchrun")]:  # torchrun's workers: sessions of their own
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        agent.wait()


@pytest.mark.parametrize("part", ["data", "compute"])
def test_a_step_stuck_on_every_rank_ends_the_run_in_one_line(ended, part):
    r, seconds, out = ended[part]
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("wansync: error: rank ") and f"stalled in step 2 ({part})" in lines[0], lines[0]
    assert f"beyond 2 x --peer-timeout {PEER_TIMEOUT} s" in lines[0] and "Traceback" not in r.stderr
    assert seconds < ENDS_WITHIN_S
    rank = int(lines[0].split()[3])
    assert "the training thread, stuck:" in (out / "logs" / f"rank{rank}.log").read_text()
    assert no_process_left(out)


def test_steps_slower_than_the_peer_timeout_but_within_the_bound_train_to_the_end(ended):
    r, _, out = ended["slow"]
    assert r.returncode == 0, r.stderr
    assert "stalled" not in r.stderr and (out / "summary.json").is_file()
    assert no_process_left(out)


def test_under_torchrun_the_ranks_stuck_say_their_own_line(ended):
    code, output, seconds, left = ended["torchrun"]
    said = [line for line in output.splitlines() if line.startswith("wansync: error: rank ")]
    assert code != 0 and said, output[-3000:]
    assert all("stalled in step 2 (data)" in line for line in said), said
    assert seconds < ENDS_WITHIN_S and left == []


def processes_naming(path: Path) -> list[int]:
    """The live processes with `path` on their command line (torchrun's workers, in sessions of their own)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(path).encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_the_watchdog_fires_once_past_the_bound_and_never_after_a_stop():
    phase, fired = Phase(), []
    assert overdue(phase, PEER_TIMEOUT, 0, time.monotonic()) is None  # start-up: not watched
    phase.begin("data", 5)
    since = phase.part[2]
    assert overdue(phase, PEER_TIMEOUT, 0, since + BOUND_S - 0.1) is None
    assert "rank 0 stalled in step 5 (data)" in overdue(phase, PEER_TIMEOUT, 0, since + BOUND_S + 0.1)
    phase.begin("compute", 1, first=True)  # warm-up: a longer bound
    assert bound_s(PEER_TIMEOUT, True) == 10 * PEER_TIMEOUT
    assert overdue(phase, PEER_TIMEOUT, 0, phase.part[2] + BOUND_S + 0.1) is None
    phase.end()
    assert overdue(phase, PEER_TIMEOUT, 0, time.monotonic() + 1e6) is None  # the exchange, an evaluation
    dog = Watchdog(phase, 0.2, 3, fired.append).start()  # a bound of 0.4 s
    phase.begin("compute", 7)
    deadline = time.monotonic() + 30
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(fired) == 1 and fired[0].startswith("rank 3 stalled in step 7 (compute)")
    stopped = Watchdog(phase, 0.2, 3, fired.append).start()
    stopped.stop()
    time.sleep(1.0)
    assert len(fired) == 1
    dog.stop()
