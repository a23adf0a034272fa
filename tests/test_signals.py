"""Nothing orphaned: a signal to the launcher, or to a worker, ends the whole run in one line,
leaves no process behind, and the run resumes from its last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from cli_harness import TINY, no_process_left, start, wansync, worker_pids
from wansync.runner.interrupts import signals_deferred

pytestmark = pytest.mark.timeout(180)

CHECKPOINT_EVERY = 2


def steps_done(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:  # a line being written
            pass
    return max(steps)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def a_foreground_session() -> None:
    """`setup` of the launcher (cli_harness: forked, torch imported, no interpreter to start): a session
    of its own, so that a signal to its group reaches no one else, and Ctrl-C a KeyboardInterrupt, as in
    a command a user started. (A shell's background job, `make test &` or nohup, starts with SIGINT
    ignored, and an ignored SIGINT rightly stays ignored by everything below: the process the launcher
    is forked from may hold it so.)"""
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def long_run(tmp_path):
    """A 2-worker run that would take hours, in a session of its own (so a signal to its group
    reaches no one else), past its first checkpoint; everything it started is killed at the end."""
    run = tmp_path / "run"
    proc = start(
        "train",
        "--strategy",
        "ddp",
        "--workers",
        "2",
        "--steps",
        "100000",
        "--checkpoint-every",
        str(CHECKPOINT_EVERY),
        "--quiet",
        "--out",
        str(run),
        *TINY,
        setup=a_foreground_session,
    )
    try:
        wait_for(lambda: steps_done(run) > CHECKPOINT_EVERY or not proc.running(), 120, "a checkpoint")
        assert proc.running(), proc.stderr()
        assert len(worker_pids(run)) == 2
        yield run, proc
    finally:
        for pid in [proc.pid, *worker_pids(run).values()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.kill()


CASES = {  # case -> (exit status, stderr)
    "SIGINT to the process group": (130, "wansync: interrupted"),
    "SIGTERM to the launcher": (143, "wansync: terminated (SIGTERM)"),
    "SIGKILL to the launcher": (-signal.SIGKILL, ""),
    "SIGKILL to a worker": (1, "wansync: error: rank 1 was killed by SIGKILL"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_signal_ends_the_run_in_one_line_and_leaves_nothing_behind(long_run, case):
    run, proc = long_run
    if case == "SIGINT to the process group":
        os.killpg(proc.pid, signal.SIGINT)
    elif case == "SIGTERM to the launcher":
        os.kill(proc.pid, signal.SIGTERM)
    elif case == "SIGKILL to the launcher":
        os.kill(proc.pid, signal.SIGKILL)
    else:
        os.kill(worker_pids(run)[1], signal.SIGKILL)
    r = proc.result(timeout=60)  # the launcher exits (its stderr is a file: no child holding it open hides that)
    assert (r.returncode, r.stderr.strip()) == CASES[case], r.stderr
    wait_for(lambda: no_process_left(run), 15, "the workers to end")
    assert not (run / "summary.json").exists()
    if case == "SIGKILL to the launcher":  # the harshest end still resumes
        steps = max(int(d.name[4:]) for d in (run / "checkpoints").glob("step*")) + 1
        r = wansync("train", "--resume", str(run), "--steps", str(steps))
        assert r.returncode == 0, r.stderr
        assert json.loads((run / "summary.json").read_text())["steps"] == steps


class SignalInsidePoll:
    """A Popen's waitpid lock: SIGINT reaches the launcher the moment poll() has taken it (once)."""

    def __init__(self, fired: list[bool]):
        self.lock, self.fired = threading.Lock(), fired

    def acquire(self, *args, **kwargs):
        got = self.lock.acquire(*args, **kwargs)
        if got and not self.fired and threading.current_thread() is threading.main_thread():
            self.fired.append(True)
            print("SIGINT inside poll", flush=True)
            os.kill(os.getpid(), signal.SIGINT)
        return got

    def release(self):
        self.lock.release()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def signal_inside_poll() -> None:
    """`setup` of a launcher whose Popen.poll() gets SIGINT inside its waitpid lock, and which has a
    second thread (so that it starts its workers with Popen, not forked), in a foreground session."""
    a_foreground_session()
    fired: list[bool] = []

    class Popen(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._waitpid_lock = SignalInsidePoll(fired)

    subprocess.Popen = Popen
    threading.Thread(target=threading.Event().wait, daemon=True).start()  # not single-threaded: workers get Popen


def test_a_sigint_inside_the_launchers_bookkeeping_still_ends_the_run_in_one_line(tmp_path):
    """The window a loaded machine hits now and then, made certain: SIGINT just after Popen.poll()
    took its waitpid lock (a launcher with a second thread starts its workers with Popen). Raised there, it left the lock held and the launcher waited for ever to
    reap that worker; the launcher must take the signal between polls instead."""
    run = tmp_path / "run"
    proc = start(
        "train",
        "--strategy",
        "ddp",
        "--workers",
        "2",
        "--steps",
        "100000",
        "--quiet",
        "--out",
        str(run),
        *TINY,
        setup=signal_inside_poll,
    )
    try:
        r = proc.result(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the launcher hung after a SIGINT inside its bookkeeping of a worker")
    finally:
        for pid in [proc.pid, *worker_pids(run).values()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.kill()
    assert r.stdout.strip() == "SIGINT inside poll"  # the window was hit
    assert (r.returncode, r.stderr.strip()) == (130, "wansync: interrupted"), r.stderr
    wait_for(lambda: no_process_left(run), 15, "the workers to end")


def test_a_deferred_sigint_is_raised_where_the_launcher_checks_and_an_ignored_one_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a foreground job
    try:
        with signals_deferred() as check:
            os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt here, in the middle of anything
            with pytest.raises(KeyboardInterrupt):
                check()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with signals_deferred() as check:
            os.kill(os.getpid(), signal.SIGINT)
            check()  # a background job's ignored Ctrl-C stays ignored
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_stopped_worker_ends_on_the_launchers_sigterm_not_its_sigkill():
    """A hung peer (SIGSTOP) would hold the SIGTERM pending until the grace ran out and SIGKILL ended it;
    the launcher continues it, and it ends on the SIGTERM."""
    from wansync.runner.launch import _terminate
    from wansync.runner.workerproc import is_stopped

    proc = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not is_stopped(proc.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        _terminate([proc], grace=30)
        assert proc.returncode == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
