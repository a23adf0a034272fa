"""A fault-tolerant run's lighthouse serves from a child of the launcher, so the launcher stays
single-threaded and forks its workers (a restarted one from its zygote); the child ends with the
launcher, whatever ends it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path

import pytest

from cli_harness import TINY, no_process_left, wansync
from wansync.ft import lighthouse
from wansync.runner import workerproc
from wansync.runner.localgroup import rank_context
from wansync.runner.workerproc import ForkedWorker

pytest.importorskip("torchft")


def _port_open(address: str) -> bool:
    host, port = address.split("//")[-1].rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, int(port))) == 0


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def _in_a_launcher(fn):
    """fn() in a process forked from the ranks' forkserver, as clean as a launcher (this test
    process runs pytest-xdist's thread); returns what fn returns."""
    ctx = rank_context()
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_call, args=(fn, send))
    proc.start()
    send.close()
    try:
        kind, value = receive.recv() if receive.poll(120) else ("error", "no answer within 120 s")
    finally:
        proc.kill()
        proc.join()
    assert kind == "ok", value
    return value


def _call(fn, send):
    try:
        send.send(("ok", fn()))
    except BaseException:  # noqa: BLE001 - reported to the test
        send.send(("error", traceback.format_exc()))


def _serve_and_end():
    forkable_before = workerproc.can_fork()
    served = lighthouse.start(join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    seen = {
        "forkable before": forkable_before,
        "served by a child": isinstance(served, lighthouse.ServedLighthouse),
        "forkable with it": workerproc.can_fork(),
        "reachable": _port_open(served.address()),
    }
    served.shutdown()
    seen.update(
        {
            "ended by SIGTERM": served.process.returncode == -signal.SIGTERM,
            "port closed": not _port_open(served.address()),
        }
    )
    return seen


def test_a_single_threaded_launcher_serves_it_from_a_child_it_ends():
    seen = _in_a_launcher(_serve_and_end)
    assert seen == {k: True for k in seen}, seen


def _host_with_another_thread():
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        hosted = lighthouse.start(join_timeout_ms=1000, heartbeat_timeout_ms=2000)
        seen = (type(hosted).__name__, _port_open(hosted.address()))
        hosted.shutdown()
        return seen
    finally:
        stop.set()
        other.join()


def test_a_launcher_with_another_thread_hosts_it_itself():
    assert _in_a_launcher(_host_with_another_thread) == ("Guarded", True)


def test_the_child_dies_with_a_launcher_killed_by_sigkill(tmp_path):
    script = textwrap.dedent("""
        import os, signal, sys
        from wansync.ft import lighthouse
        served = lighthouse.start(join_timeout_ms=1000, heartbeat_timeout_ms=2000)
        print(served.process.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert _gone(int(r.stdout.split()[0]), within=10)


def _record_starts() -> None:
    """In the CLI's process: note how each worker started, in the run's logs/started.txt."""
    real = workerproc.start

    def start(env, **how):
        worker = real(env, **how)
        with open(Path(env["WANSYNC_RUN_DIR"], "logs", "started.txt"), "a") as f:
            f.write(f"{env['RANK']} {'forked' if isinstance(worker, ForkedWorker) else 'fresh'}\n")
        return worker

    workerproc.start = start


def test_a_fault_tolerant_run_forks_its_first_workers_and_leaves_no_process(tmp_path):
    out = tmp_path / "run"
    r = wansync(
        "train",
        "--strategy",
        "diloco",
        "--sync-every",
        "2",
        "--workers",
        "2",
        "--steps",
        "4",
        "--eval-every",
        "1000",
        "--fault-tolerant",
        "--peer-timeout",
        "60",
        "--quiet",
        "--out",
        str(out),
        *TINY,
        timeout=240,
        setup=_record_starts,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted((out / "logs" / "started.txt").read_text().splitlines()) == ["0 forked", "1 forked"]
    assert no_process_left(out)


def test_a_restarted_worker_is_forked_by_the_launchers_zygote(tmp_path):
    """Once the store's threads run the launcher may not fork; the restart comes from its zygote."""
    out = tmp_path / "run"
    r = wansync(
        "train",
        "--strategy",
        "diloco",
        "--sync-every",
        "2",
        "--workers",
        "2",
        "--steps",
        "8",
        "--eval-every",
        "1000",
        "--fault-tolerant",
        "--peer-timeout",
        "60",
        "--max-restarts",
        "1",
        "--quiet",
        "--out",
        str(out),
        *TINY,
        timeout=240,
        setup=_record_starts,
        env={"WANSYNC_FAULT": "rank=1,step=3,action=kill"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted((out / "logs" / "started.txt").read_text().splitlines()) == ["0 forked", "1 forked", "1 forked"]
    assert no_process_left(out)
