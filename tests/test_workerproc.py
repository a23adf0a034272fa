"""How the launcher starts workers (workerproc): forked from a single-threaded launcher, a fresh
interpreter otherwise. The specification:
- a forked worker answers poll/wait/terminate/kill with subprocess.Popen's conventions;
- forked and fresh workers train the same bits, and the launcher records every worker's pid;
- a zygote forks workers later (a fault-tolerant run's restarts) that are the launcher's children.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from cli_harness import TINY, no_process_left, start
from wansync.runner.workerproc import ForkedWorker


def forked(then_exit: int | None = None) -> ForkedWorker:
    """A child of this process that exits with `then_exit` at once, or sleeps until signalled."""
    pid = os.fork()
    if pid == 0:
        if then_exit is None:
            time.sleep(60)
        os._exit(then_exit or 0)
    return ForkedWorker(pid)


def test_a_forked_worker_reports_its_end_as_popen_does():
    ok, failed = forked(0), forked(3)
    assert (ok.wait(timeout=30), failed.wait(timeout=30)) == (0, 3)
    assert (ok.poll(), failed.returncode) == (0, 3)

    running = forked()
    assert running.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        running.wait(timeout=0.1)
    running.terminate()
    assert running.wait(timeout=30) == -signal.SIGTERM

    running = forked()
    running.kill()
    assert running.wait(timeout=30) == -signal.SIGKILL
    running.kill()  # already reaped: nothing is signalled


def a_second_thread() -> None:
    """`setup` of a launcher that is not single-threaded: it starts its workers with Popen."""
    threading.Thread(target=threading.Event().wait, daemon=True).start()


def test_forked_and_fresh_workers_train_the_same_bits(tmp_path):
    args = [
        "train",
        "--strategy",
        "local_sgd",
        "--sync-every",
        "2",
        "--workers",
        "2",
        "--steps",
        "4",
        "--checkpoint-every",
        "4",
        *TINY,
    ]
    forked_run, fresh_run = tmp_path / "forked", tmp_path / "fresh"
    forked = start(*args, "--out", str(forked_run))  # a CLI process of its own forks its workers
    fresh = start(*args, "--out", str(fresh_run), setup=a_second_thread)  # ... beside a threaded one, which cannot
    try:
        for r in (fresh.result(timeout=120), forked.result(timeout=120)):
            assert r.returncode == 0, r.stderr
    finally:
        forked.kill()
        fresh.kill()
    losses = [
        [json.loads(line).get("loss") for line in (run / "metrics.jsonl").read_text().splitlines()]
        for run in (forked_run, fresh_run)
    ]
    assert losses[0] == losses[1] and any(v is not None for v in losses[0])
    for rank in (0, 1):
        a, b = (
            torch.load(run / "checkpoints" / "step00000004" / f"rank{rank}.pt", weights_only=False)
            for run in (forked_run, fresh_run)
        )
        assert a["model"].keys() == b["model"].keys()
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for run in (forked_run, fresh_run):
        assert sorted(p.name for p in (run / "logs").glob("rank*.pid")) == ["rank0.pid", "rank1.pid"]
        assert no_process_left(run)


CAN_FORK = """
import threading, torch
from wansync.runner.workerproc import can_fork
seen = [can_fork()]
torch.set_num_threads(2)
x = torch.randn(1000, 1000)
(x @ x).cos()                                        # torch's OpenMP team starts: 2 threads
seen.append(can_fork())
print(seen)
"""


def test_a_launcher_forks_only_without_other_threads_and_before_an_openmp_team():
    r = subprocess.run([sys.executable, "-c", CAN_FORK], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["[True,", "False]"], r.stderr
    import threading
    from wansync.runner.workerproc import can_fork

    waiting = threading.Event()
    thread = threading.Thread(target=waiting.wait, daemon=True)
    thread.start()
    try:
        assert not can_fork()
    finally:
        waiting.set()
        thread.join()


def _warmed(data: str, fault_tolerant: bool, inside: str, out) -> None:
    """In a process forked from the ranks' forkserver (nothing warmed yet): what `warm` left behind."""
    from wansync.config import Config
    from wansync.runner.workerproc import can_fork, warm
    from wansync.workloads.lm.corpus import shakespeare_documents

    before = "torchft" in sys.modules or "torch.distributed.checkpoint" in sys.modules
    cfg = Config(data=data, fault_tolerant=fault_tolerant, inside=inside, ranks_per_worker=2 if inside == "fsdp" else 1)
    warm(cfg)
    out.put(
        {
            "before": before,
            "corpus": shakespeare_documents.cache_info().currsize,
            "torchft": "torchft" in sys.modules,
            "checkpoint": "torch.distributed.checkpoint" in sys.modules,
            "can_fork": can_fork(),
        }
    )


@pytest.mark.parametrize(
    "data, fault_tolerant, inside, expected",
    [
        ("shakespeare", True, "fsdp", {"corpus": 1, "torchft": True, "checkpoint": True}),
        ("corpus.txt", False, "ddp", {"corpus": 0, "torchft": False, "checkpoint": False}),
    ],
)
def test_the_launcher_warms_what_its_forked_workers_need_and_no_more(data, fault_tolerant, inside, expected):
    """Before it forks, the launcher imports what its workers would each import first (the checkpoint
    module of a sharded worker, torchft of a fault-tolerant one) and strips the bundled corpus once;
    it starts no thread, so it may still fork."""
    from wansync.runner.localgroup import rank_context

    ctx = rank_context()
    out = ctx.Queue()
    p = ctx.Process(target=_warmed, args=(data, fault_tolerant, inside, out))
    p.start()
    seen = out.get(timeout=120)
    p.join(timeout=30)
    assert seen == {"before": False, **expected, "can_fork": True}, seen


def _from_a_zygote(out: str) -> None:
    """In a clean process: two workers from a Zygote, given a config that cannot be read; what
    this process (the launcher) sees of them, into `out` (their stderr is this process's)."""
    from wansync.runner.interrupts import LAUNCHER_PID_ENV
    from wansync.runner.workerproc import Zygote

    err = os.open(out + ".err", os.O_WRONLY | os.O_CREAT)
    os.dup2(err, 2)
    zygote = Zygote()
    env = {LAUNCHER_PID_ENV: str(os.getpid()), "WANSYNC_RUN_DIR": os.path.dirname(out), "WANSYNC_CONFIG": "["}
    codes = [zygote.start(env).wait(timeout=60) for _ in range(2)]  # waitpid: they are this process's children
    zygote.close()
    ended = not os.path.exists(f"/proc/{zygote.pid}")  # reaped by close()
    with open(out, "w") as f:
        json.dump({"codes": codes, "zygote_ended": ended}, f)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote hands workers over as a subreaper (Linux)")
def test_a_zygote_forks_workers_that_are_the_launchers_children_and_ends_when_closed(tmp_path):
    from wansync.runner.localgroup import rank_context

    out = str(tmp_path / "seen.json")
    probe = rank_context().Process(target=_from_a_zygote, args=(out,))
    probe.start()
    probe.join(120)
    assert probe.exitcode == 0
    seen = json.loads(open(out).read())
    err = open(out + ".err").read()
    assert seen == {"codes": [1, 1], "zygote_ended": True}
    # each ran the worker's code with its own environment, past the check that its parent is the launcher
    assert err.count("TOMLDecodeError") == 2
