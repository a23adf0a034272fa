"""tests/forked_python.py's stand-in for `python` behaves as the interpreter where the multi-host tests
use it: the same output, exit status and environment for each kind of command line, signals passed
on, a killed stand-in taking its process with it, and inside a bed host the host's name, addresses and
/etc/hosts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import netns

WHY = netns.unavailable()

CODE = "import os, sys; print(__name__, sys.argv[1:], os.getcwd(), os.environ.get('PROBE')); sys.stdout.flush()"
SCRIPT = "import sys\nprint('script', sys.argv, sys.path[0])\nsys.exit(int(sys.argv[1]))\n"


def both(python, args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    env = dict(os.environ, PROBE="seen", **python.env)
    run = [
        subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
        for cmd in ([sys.executable, *args], [python.executable, *args])
    ]
    return run[0], run[1]


@pytest.mark.parametrize(
    "args",
    [
        ["-c", CODE, "a", "b c"],
        ["-u", "-c", CODE],
        ["-c", "import sys; sys.exit(3)"],
        ["-c", "import sys; sys.exit('a message')"],
        ["-c", "raise ValueError('boom')"],
        ["-c", "raise KeyboardInterrupt"],
        ["-c", "import atexit, threading, time; atexit.register(print, 'atexit'); "
               "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()"],
        ["-m", "wansync", "--version"],
        ["script.py", "4", "x"],
        ["-X", "dev", "-c", "pass"],
    ],
)  # fmt: skip
def test_the_stand_in_gives_what_the_interpreter_gives(forked_python, tmp_path, args):
    (tmp_path / "script.py").write_text(SCRIPT)
    real, forked = both(forked_python, args, tmp_path)
    if args[0] == "-X":  # an option it does not take: refused in one line, not run otherwise
        assert real.returncode == 0 and forked.returncode == 2, forked
        assert forked.stderr.count("\n") == 1 and "unsupported command line" in forked.stderr
        return
    assert forked.returncode == real.returncode, (real, forked)
    assert forked.stdout == real.stdout
    assert forked.stderr.splitlines()[-1:] == real.stderr.splitlines()[-1:]


def test_a_request_that_is_not_the_scripts_starts_nothing_and_the_zygote_goes_on(forked_python):
    for junk, fds in ((b"not json", []), (b'{"argv": []}', [0])):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(forked_python.socket)
            socket.send_fds(s, [junk], fds)
            assert s.recv(64) == b""  # closed, nothing forked
    r = subprocess.run(
        [forked_python.executable, "-c", "print('still here')"],
        env=dict(os.environ, **forked_python.env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode, r.stdout) == (0, "still here\n"), r.stderr


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_to_the_stand_in_ends_its_process(forked_python, tmp_path, sent):
    """SIGTERM is passed on (the status says the child's signal); SIGKILL, which cannot be, ends the
    stand-in and the zygote kills the child it leaves."""
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    proc = subprocess.Popen([forked_python.executable, "-c", code], env=dict(os.environ, **forked_python.env))
    deadline = time.monotonic() + 30
    while not (pid_file.is_file() and pid_file.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    child = int(pid_file.read_text())
    assert child != proc.pid and alive(child)
    proc.send_signal(sent)
    assert proc.wait(timeout=10) == -sent
    while alive(child):
        assert time.monotonic() < deadline, "the child outlived its stand-in"
        time.sleep(0.02)


PROBE_HOST = (
    "import os, socket; print(socket.gethostname(), sorted(n for _, n in socket.if_nameindex()), "
    "sorted(os.listdir('/sys/class/net')), open('/etc/hosts').read().split())"
)


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_in_a_bed_host_the_process_has_the_hosts_name_links_and_hosts_file(forked_python):
    with netns.Bed(2, names=("loopback", "address")) as bed:
        for host in bed.hosts:
            env = dict(os.environ, **forked_python.env)
            real = bed.run(host, [sys.executable, "-c", PROBE_HOST])
            forked = bed.run(host, [forked_python.executable, "-c", PROBE_HOST], env=env)
            assert real.returncode == forked.returncode == 0, (real.stderr, forked.stderr)
            assert forked.stdout == real.stdout and host.name in real.stdout
