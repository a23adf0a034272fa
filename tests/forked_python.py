"""A `python` whose processes are forks of an interpreter that imported torch already: the stand-in the
multi-host tests give torchrun (its `PYTHON_EXEC`) and the bed's hosts, where each fresh interpreter
spent ~2.5 CPU-seconds importing torch and torch._dynamo before it did anything (three quarters of
what those tests cost on 2 cores).

`ForkedPython.executable` is a small script (`python -IS`, no torch) that behaves as
`python [-u] (-m MODULE | -c CODE | SCRIPT) ARGS...`: it sends its arguments, working directory,
environment and file descriptors 0-2 to the zygote (a process forked from the ranks' forkserver,
`wansync.runner.localgroup.rank_context`: torch and torch._dynamo imported, no thread), which forks a
child for it. The child enters the script's network, UTS and mount namespaces (a bed host's: its
addresses, its host name, its /etc/hosts), starts a session of its own (as torchrun starts its
workers), takes over the descriptors, the directory and the environment, and runs the command as the
interpreter would, exiting as it would (non-daemon threads joined, atexit run, an uncaught
KeyboardInterrupt ending it by SIGINT). The script stays beside it for whoever started it: it
forwards the signals a process is sent (TERM, INT, HUP, QUIT, USR1, USR2), exits with the child's
status (killing itself with the child's signal), and the child is killed if the script is. Its
command line names what the child runs, so searches of /proc by command line still find the run.

What differs from a fresh interpreter: the child's parent is the zygote (no one here asks for its
parent: torchrun's workers are sessions of their own), a child's /proc/PID/cmdline is the zygote's
(the script's names the command), and modules the zygote imported are not imported again. Fresh
interpreters stay elsewhere: test_stall's torchrun run, test_vision_cli's warnings at start-up,
test_net_backend's exit, test_workerproc's fresh workers; benchmarks/chaos.py starts them unless given
`--python`. tests/test_forked_python.py holds this stand-in to the interpreter's behaviour."""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

SOCKET_ENV = "FORKED_PYTHON_SOCKET"
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
NAMESPACES = (("net", 0x40000000), ("uts", 0x04000000), ("mnt", 0x00020000))  # CLONE_NEWNET, NEWUTS, NEWNS

# The script: stdlib only, started with -I -S (no site-packages, nothing of the environment), ~20 ms.
SCRIPT = """\
import json, os, signal, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.connect(os.environ["{socket_env}"])
child, pending = None, []
def forward(signum, frame):
    if child is None:
        pending.append(signum)
        return
    try:
        os.kill(child, signum)
    except ProcessLookupError:
        pass
for name in {forwarded!r}:
    signal.signal(getattr(signal, name), forward)
request = {{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}
socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):  # the child holds them now: a pipe's end is seen when the child's copy closes
    os.dup2(null, fd)
while True:
    said = sock.recv(64).decode().split()
    if not said:
        os._exit(70)  # the zygote is gone (EX_SOFTWARE)
    if said[0] == "pid":
        child = int(said[1])
        for signum in pending:
            forward(signum, None)
        continue
    code = int(said[1])
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)
"""


class ForkedPython:
    """The zygote (a daemon process of the caller's) and the script that asks it for a process."""

    def __init__(self, root: Path):
        from wansync.runner.localgroup import rank_context

        root.mkdir(parents=True, exist_ok=True)
        self.socket = str(root / "zygote.sock")
        self.executable = str(root / "python")
        Path(self.executable).write_text(
            f"#!{sys.executable} -IS\n" + SCRIPT.format(socket_env=SOCKET_ENV, forwarded=FORWARDED)
        )
        os.chmod(self.executable, 0o755)
        self.process = rank_context().Process(target=serve, args=(self.socket,), daemon=True)
        self.process.start()
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if not self.process.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the forked python's zygote did not start")
            time.sleep(0.01)

    @property
    def env(self) -> dict[str, str]:
        """What a command's environment needs: the script's socket, and torchrun's interpreter."""
        return {SOCKET_ENV: self.socket, "PYTHON_EXEC": self.executable}

    def close(self) -> None:
        if self.process.is_alive():
            self.process.terminate()  # it kills the processes it forked
        self.process.join(10)


def started(root: Path | None = None) -> ForkedPython:
    return ForkedPython(root or Path(tempfile.mkdtemp(prefix="forked-python-")))


# ---- the zygote ---------------------------------------------------------------------------------


def serve(path: str) -> None:
    """Accept requests on `path`, fork a child for each, tell each script its child's pid and then its
    exit status; a script that goes away takes its child with it. SIGTERM kills every child."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".new")
    listener.listen(128)
    os.rename(path + ".new", path)  # seen only once it listens
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)

    def end(signum: int, frame: object) -> None:
        for pid in children:
            _kill(pid)
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    while True:
        for key, _ in selector.select(0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                try:
                    request = json.loads(message)
                except ValueError:
                    request = None
                if request is None or len(fds) != 3:  # not the script's: nothing is started for it
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for other in children.values():
                        other.close()
                    _child(conn, request, fds)  # never returns
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                try:
                    conn.send(f"pid {pid}".encode())
                except OSError:  # the script is gone already: the next pass kills its child
                    pass
                selector.register(conn, selectors.EVENT_READ, pid)
            elif not _said(key.fileobj):  # the script ended (killed): its child goes with it
                selector.unregister(key.fileobj)
                _kill(key.data)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid)
            try:
                selector.unregister(conn)
            except (KeyError, ValueError):
                pass
            try:
                conn.send(f"exit {os.waitstatus_to_exitcode(status)}".encode())
            except OSError:
                pass
            conn.close()


def _said(conn: socket.socket) -> bytes:
    try:
        return conn.recv(64)
    except OSError:
        return b""


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """The forked child: the script's namespaces, session, descriptors, directory and environment,
    then its command; never returns."""
    code = 1
    try:
        peer = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        conn.close()
        _enter_namespaces(peer)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for name in ("SIGINT", "SIGTERM", "SIGCHLD", *FORWARDED):
            signum = getattr(signal, name)
            signal.signal(signum, signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL)
        code = _run(request["argv"])
    except BaseException:  # noqa: BLE001 - a failure of the stand-in itself, said where the command's stderr goes
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _enter_namespaces(pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, flag in NAMESPACES:
        theirs = f"/proc/{pid}/ns/{kind}"
        if os.stat(theirs).st_ino == os.stat(f"/proc/self/ns/{kind}").st_ino:
            continue
        fd = os.open(theirs, os.O_RDONLY)
        try:
            if libc.setns(fd, flag) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {theirs}")
        finally:
            os.close(fd)


def _streams(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr on descriptors 0-2, buffered as the interpreter buffers them (-u:
    stdout and stderr written through)."""
    import io

    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw),
            encoding="utf-8",
            errors="backslashreplace" if name == "stderr" else "strict",
            line_buffering=name == "stderr" and not unbuffered,
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _run(argv: list[str]) -> int:
    """`python ARGV` in this process: its exit status."""
    import atexit
    import runpy
    import threading

    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    while argv and argv[0] == "-u":
        unbuffered, argv = True, argv[1:]
    _streams(unbuffered)
    if "OMP_NUM_THREADS" in os.environ:  # what torch read at its import, in a fresh interpreter
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    code = 0
    try:
        if argv[:1] == ["-m"] and len(argv) > 1:
            sys.argv = ["-m", *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[:1] == ["-c"] and len(argv) > 1:
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv and not argv[0].startswith("-"):
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        else:
            print(
                f"forked python: unsupported command line {argv!r} (-u, -m MODULE, -c CODE or SCRIPT)", file=sys.stderr
            )
            code = 2
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        code = -int(signal.SIGINT)
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback, status 1
        import traceback

        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's exit: non-daemon threads, then atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _exit_code(exc: SystemExit) -> int:
    """The status the interpreter gives a SystemExit: None 0, an int itself, anything else printed, 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1
