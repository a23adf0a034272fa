"""Start M local worker processes (or adopt a torchrun environment) and watch them.

Locally, the launcher holds the rendezvous store itself, on a socket bound to 127.0.0.1
(no port race, nothing listening beyond loopback), and gives every worker the environment
torchrun would: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE.
The first worker to fail ends all of them: its one-line message is printed, every child is
reaped, and the exit status is non-zero. SIGINT and SIGTERM reach the launcher as exceptions,
raised between two polls (never inside the bookkeeping of a Popen), and end the workers the
same way; workers die by themselves if the launcher dies (interrupts).

With `--fault-tolerant` (docs/fault_tolerance.md) a failure does not end the run: the launcher
starts torchft's lighthouse on 127.0.0.1 (unless `--lighthouse HOST:PORT` names one), restarts a
dead worker up to `--max-restarts` times (it heals from a live peer), lets the others go on
without it, and adds `worker_failures`, `rejoins` and `heals` to summary.json.

A torchrun environment is adopted only when it is complete and consistent: a stale or partial
one must not silently turn `--workers 2` into one worker.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from ..config import Config
from ..errors import PEER_LOST, ConfigError
from . import workerproc
from .interrupts import LAUNCHER_PID_ENV, signals_deferred, sigint_blocked
from ..telemetry import peerwait
from ..ft.quorums import read_quorums, short_exchanges, steps_lost

ERR_DIR = "logs"
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    master_addr: str
    master_port: int

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size}, rendezvous {self.master_addr}:{self.master_port}"


def torchrun_env(workers: int | None = None, ranks_per_worker: int = 1) -> TorchrunEnv | None:
    """The torchrun environment of this process, None when there is none. A partial, malformed
    or inconsistent one is refused in one line, as is a contradiction with `workers` (an explicit
    --workers, or the worker count of the run being resumed) or a world that workers of
    `ranks_per_worker` ranks cannot fill."""
    present = [v for v in TORCHRUN_VARS if os.environ.get(v)]
    if not present:
        return None
    missing = [v for v in TORCHRUN_VARS if v not in present]
    if missing:
        raise ConfigError(f"incomplete torchrun environment: {', '.join(present)} set but {', '.join(missing)} not "
                          f"(unset {', '.join(present)} to launch local workers, or start under torchrun)")
    world = _env_int("WORLD_SIZE", 1, None)
    env = TorchrunEnv(_env_int("RANK", 0, world - 1), world, os.environ["MASTER_ADDR"],
                      _env_int("MASTER_PORT", 1, 65535))
    if os.environ.get("LOCAL_WORLD_SIZE"):
        local_world = _env_int("LOCAL_WORLD_SIZE", 1, world)
        if os.environ.get("LOCAL_RANK"):
            _env_int("LOCAL_RANK", 0, local_world - 1)
    if world % ranks_per_worker:
        raise ConfigError(f"the torchrun environment says WORLD_SIZE={world}, which workers of --ranks-per-worker "
                          f"{ranks_per_worker} cannot fill (under torchrun --nnodes N --nproc-per-node R, pass "
                          f"--ranks-per-worker R)")
    if workers is not None and workers * ranks_per_worker != world:
        per = f" x --ranks-per-worker {ranks_per_worker}" if ranks_per_worker > 1 else ""
        raise ConfigError(f"the torchrun environment says WORLD_SIZE={world} (RANK, WORLD_SIZE, MASTER_ADDR, "
                          f"MASTER_PORT are set) but this run has --workers {workers}{per}: drop --workers under "
                          f"torchrun, or unset those variables to launch {workers} local workers")
    return env


def _env_int(name: str, low: int, high: int | None) -> int:
    text = os.environ[name]
    try:
        value = int(text)
        fits = value >= low and (high is None or value <= high)
    except ValueError:
        fits = False
    if not fits:
        bound = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise ConfigError(f"torchrun environment: {name} must be {bound}, got {text!r}")
    return value


def error_file(run_dir: Path, rank: int) -> Path:
    return run_dir / ERR_DIR / f"rank{rank}.err"


def describe_exit(run_dir: Path, rank: int, code: int) -> str:
    f = error_file(run_dir, rank)
    if f.is_file() and f.read_text().strip():
        return f.read_text().strip().splitlines()[0]
    if code < 0:
        try:
            return f"rank {rank} was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"rank {rank} was killed by signal {-code}"
    log = run_dir / ERR_DIR / f"rank{rank}.log"
    if log.is_file() and log.stat().st_size > 0:
        return f"rank {rank} exited with status {code} (see {log})"
    return f"rank {rank} exited with status {code} and left no log (is {run_dir} writable, with space left?)"


def _terminate(procs: list[workerproc.Worker], grace: float = 3.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def spawn(cfg: Config, run_dir: Path, config: str, resume: bool = False) -> tuple[int, str]:
    """Run cfg.workers × cfg.ranks_per_worker processes (ranks w·R … w·R+R−1 are worker w);
    returns (exit status, message of the first failure).
    `config` (the resolved config as TOML) reaches the workers in their environment.
    KeyboardInterrupt and Terminated pass through, after every worker is ended and reaped."""
    with signals_deferred() as check_signals:
        return _spawn(cfg, Path(run_dir), config, resume, check_signals)


def _spawn(cfg: Config, run_dir: Path, config: str, resume: bool, check_signals: Callable[[], None]) -> tuple[int, str]:
    (run_dir / ERR_DIR).mkdir(parents=True, exist_ok=True)
    world = cfg.workers * cfg.ranks_per_worker
    for r in range(world):
        error_file(run_dir, r).unlink(missing_ok=True)
    # A fault-tolerant run's lighthouse serves from a child process (lighthouse.py), so this one
    # stays single-threaded and may fork its workers (workerproc); the store's threads start after
    # them, and a worker restarted later comes from a zygote forked before them.
    lighthouse, ft_env = start_lighthouse(cfg) if cfg.fault_tolerant else (None, {})
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)                     # workers may connect before the store serves: the kernel queues them
    port = sock.getsockname()[1]
    fork = workerproc.can_fork()
    store = None if fork else _serve_store(sock, cfg.peer_timeout)
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // world)
    procs: list[workerproc.Worker] = []
    zygote: workerproc.Zygote | None = None

    def start(rank: int, restarted: bool = False) -> workerproc.Worker:
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHELASTIC_USE_AGENT_STORE="True", GLOO_SOCKET_IFNAME=_loopback_ifname(),
                   OMP_NUM_THREADS=str(threads), WANSYNC_RUN_DIR=str(run_dir), WANSYNC_LAUNCHED="1",
                   WANSYNC_RESUME="1" if resume else "0", WANSYNC_CONFIG=config, **ft_env,
                   **{LAUNCHER_PID_ENV: str(os.getpid())})
        if restarted:                           # a fresh life: it heals from a peer, not from disk
            env.pop("WANSYNC_FAULT", None)
            env.update(WANSYNC_RESUME="0", WANSYNC_RESTARTED="1")
        forked = fork and store is None         # not once the store's threads run
        with sigint_blocked():                  # the worker starts with SIGINT blocked, then ignores it
            proc = workerproc.start(env, fork=forked, close=[sock.fileno()] if forked else [], zygote=zygote)
        workerproc.record_pid(run_dir / ERR_DIR, rank, proc)
        return proc

    try:
        for rank in range(world):
            procs.append(start(rank))
            check_signals()
        if store is None:
            if cfg.fault_tolerant and cfg.max_restarts > 0 and workerproc.Zygote.available():
                zygote = workerproc.Zygote(close=[sock.fileno()])
            store = _serve_store(sock, cfg.peer_timeout)
        if not cfg.fault_tolerant:
            code, message = _watch(procs, run_dir, check_signals)
        else:
            code, message, failures = _watch_tolerant(procs, run_dir, cfg.max_restarts, start, check_signals,
                                                      cfg.peer_timeout)
            record_failures(run_dir, failures, restarts=sum(min(n, cfg.max_restarts) for n in failures.values()),
                            workers=world, steps=cfg.steps)
        if code == 0:
            peerwait.record(run_dir, run_dir / ERR_DIR, world)
        return code, message
    finally:                                    # also on KeyboardInterrupt and Terminated
        _terminate(procs)
        if zygote is not None:
            zygote.close()
        if store is None:
            sock.close()
        store = None                            # the store stops serving
        if lighthouse is not None:
            lighthouse.shutdown()


def _serve_store(sock: socket.socket, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, serving on the bound and listening `sock` (which it takes over)."""
    store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], None, True, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.fileno())
    sock.detach()
    return store


# ---- fault-tolerant runs ------------------------------------------------------------------------
HEALS_FILE = "heals.jsonl"            # in logs/: one line per worker healed from a peer
LIGHTHOUSE_ENV = "WANSYNC_LIGHTHOUSE"
HEARTBEAT_TIMEOUT_MS = 2000           # a worker silent this long is left out of the next quorum


def start_lighthouse(cfg: Config) -> tuple[object | None, dict[str, str]]:
    """torchft's lighthouse on 127.0.0.1 (None when --lighthouse names one) and the workers' env.
    A quorum waits up to --peer-timeout for a live (heartbeating) worker that is late, so slow
    workers stay in lockstep; a dead one stops heartbeating and is left out after 2 s."""
    from ..ft.quorum import require_torchft
    require_torchft()
    if cfg.lighthouse:
        return None, {LIGHTHOUSE_ENV: f"http://{cfg.lighthouse}"}
    from ..ft import lighthouse
    server = lighthouse.start(join_timeout_ms=int(cfg.peer_timeout * 1000), heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    port = server.address().rsplit(":", 1)[1]
    return server, {LIGHTHOUSE_ENV: f"http://127.0.0.1:{port}"}


def _watch_tolerant(procs: list[workerproc.Worker], run_dir: Path, max_restarts: int,
                    start, check_signals: Callable[[], None], peer_timeout: float) -> tuple[int, str, dict[int, int]]:
    """Restart a failed worker up to `max_restarts` times, let the others go on; the run succeeds
    when every worker still in it ends well. Returns (status, first failure, failures per rank).

    Once a worker has finished the run, the ones still alive were left out of its end: a running one
    exits by itself within its start-up deadline (3 peer timeouts, `ft.quorum`), so it gets
    LINGER_TIMEOUTS of them; a stopped one (SIGSTOP, a hung host) cannot, so it gets one. Past that the
    launcher ends it and says so in one line, instead of waiting for it forever."""
    failures: dict[int, int] = {}
    left_behind: set[int] = set()               # ended by the launcher after the run's end
    first = ""
    finished_at: float | None = None
    while True:
        check_signals()                         # a signal becomes an exception here, between polls
        for rank, p in enumerate(procs):
            code = p.poll()
            if code in (None, 0) or failures.get(rank, 0) > max_restarts or rank in left_behind:
                continue
            first = first or describe_exit(run_dir, rank, code)
            failures[rank] = failures.get(rank, 0) + 1
            if failures[rank] <= max_restarts:
                error_file(run_dir, rank).unlink(missing_ok=True)
                procs[rank] = start(rank, restarted=True)
        ended = [p.poll() for r, p in enumerate(procs) if failures.get(r, 0) <= max_restarts and r not in left_behind]
        if all(c is not None for c in ended):
            ok = bool(ended) and all(c == 0 for c in ended)
            return (0 if ok else 1), ("" if ok else first), failures
        if finished_at is None and 0 in ended:
            finished_at = time.monotonic()
        if finished_at is not None:
            for rank in _end_left_behind(procs, run_dir, time.monotonic() - finished_at, peer_timeout):
                left_behind.add(rank)
                failures[rank] = failures.get(rank, 0) + 1
        time.sleep(0.05)


LINGER_TIMEOUTS = 4                   # peer timeouts a running worker may outlive the run's end


def _end_left_behind(procs: list[workerproc.Worker], run_dir: Path, since_end: float, peer_timeout: float
                     ) -> list[int]:
    """Kill the workers still alive too long after the run's end (see _watch_tolerant), each with one
    line in its error file and on stderr; returns their ranks (a failure each, never restarted)."""
    ended = []
    for rank, p in enumerate(procs):
        if p.poll() is not None:
            continue
        stopped = _is_stopped(p.pid)
        if since_end < (1 if stopped else LINGER_TIMEOUTS) * peer_timeout:
            continue
        how = "stopped (it hung)" if stopped else "still running"
        line = (f"rank {rank} was {how} {since_end:.0f} s after the other workers ended the run; "
                "it was left out of the run's end and the launcher ended it")
        error_file(run_dir, rank).write_text(line + "\n")
        print(f"wansync: warning: {line}", file=sys.stderr)
        p.kill()
        p.wait()
        ended.append(rank)
    return ended


def record_failures(run_dir: Path, failures: dict[int, int], restarts: int, workers: int, steps: int) -> None:
    """Add the run's failures, rejoins, heals, the steps each worker lost and the exchanges short of
    a worker (telemetry.quorums) to summary.json (written by rank 0's worker)."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return
    heals_file = run_dir / ERR_DIR / HEALS_FILE
    heals = len(heals_file.read_text().splitlines()) if heals_file.is_file() else 0
    quorums = read_quorums(run_dir / ERR_DIR, workers)
    lost = steps_lost({w: [r["step"] for r in rs] for w, rs in quorums.items()}, end=steps,
                      healed={w: [r["step"] for r in rs if r.get("healed")] for w, rs in quorums.items()})
    summary = json.loads(path.read_text())
    summary.update(worker_failures=sum(failures.values()), rejoins=restarts, heals=heals,
                   steps_lost=[lost[w] for w in range(workers)], short_exchanges=short_exchanges(quorums[0], workers))
    path.write_text(json.dumps(summary, indent=2))


# A peer's "lost contact" is a consequence; when it is all the launcher has seen so far, it waits
# this long for the cause (a crashed rank may still be writing its error file on a loaded machine).
ROOT_CAUSE_GRACE_S = 2.0


def _watch(procs: list[workerproc.Worker], run_dir: Path, check_signals: Callable[[], None]) -> tuple[int, str]:
    while True:
        check_signals()                         # a signal becomes an exception here, between polls
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            message = first_cause(run_dir, codes)
            deadline = time.monotonic() + ROOT_CAUSE_GRACE_S
            while PEER_LOST in message and time.monotonic() < deadline:
                time.sleep(0.05)
                message = first_cause(run_dir, [p.poll() for p in procs])
            stopped = [r for r, p in enumerate(procs) if _is_stopped(p.pid)]
            if stopped:
                message += f" (rank {stopped[0]} is stopped: it hung)"
            return 1, message
        if all(c == 0 for c in codes):
            return 0, ""
        time.sleep(0.05)


def first_cause(run_dir: Path, codes: list[int | None]) -> str:
    """The failure to report: a crash rather than the lost contact it caused in its peers, even
    when the peers exit first (the crashed rank writes its error file before its sockets close)."""
    failed = [describe_exit(run_dir, r, c) for r, c in enumerate(codes) if c not in (None, 0)]
    running = [error_file(run_dir, r) for r, c in enumerate(codes) if c is None]
    written = [f.read_text().strip() for f in running if f.is_file()]
    return next((m for m in failed + [w.splitlines()[0] for w in written if w] if PEER_LOST not in m), failed[0])


def _is_stopped(pid: int) -> bool:
    """A process stopped by a signal (state T in /proc): a hung peer."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("T", "t")


def _loopback_ifname() -> str:
    """Name of the loopback interface (gloo binds its sockets there)."""
    try:
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    except OSError:
        pass
    return "lo"
