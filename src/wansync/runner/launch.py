"""Start M local worker processes and watch them (under torchrun, `runner.run` adopts its ranks instead).

Locally, the launcher holds the rendezvous store itself, on a socket bound to 127.0.0.1
(no port race, nothing listening beyond loopback), and gives every worker the environment
torchrun would: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE.
The first worker to fail ends all of them: its one-line message is printed, every child is
reaped, and the exit status is non-zero. Under an asynchronous strategy (`async_diloco`: learners that
never meet) a learner other than rank 0's, which holds the syncer, ends alone: one line, and the run
goes on with the others; with `--max-restarts N` the launcher starts it again, up to N times, into the
running run (`async_diloco.JOIN_ENV`, the address rank 0 wrote to logs/syncer.address), where it takes
the newest version and contributes again. SIGINT and SIGTERM reach the launcher as exceptions,
raised between two polls (never inside the bookkeeping of a Popen), and end the workers the
same way; workers die by themselves if the launcher dies (interrupts).

With `--fault-tolerant` (docs/fault_tolerance.md) a failure does not end the run: the launcher
hands its workers to the run's `ft.supervisor.Supervisor`, which starts torchft's lighthouse,
restarts a dead worker (it heals from a live peer), lets the others go on without it, and adds
what the run went through to summary.json. Under torchrun a fault-tolerant worker is launched the
same way, alone (`spawn(..., torchrun=env)`): the process torchrun started for its first rank
supervises the worker's ranks and restarts them, so torchrun's agents never re-rendezvous (which
would restart every node's workers).

A launch is a short pipeline (`Launch`): prepare the log directory, open the rendezvous, start
every worker, watch them, tear everything down.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from ..config import Config
from ..errors import PEER_LOST
from ..ft.supervisor import Supervisor
from ..rundir import files
from ..rundir.layout import LOGS_DIR, SYNCER_ADDRESS_FILE
from ..strategies.async_diloco import JOIN_ENV, LEARNER_ENV
from . import workerproc
from .interrupts import LAUNCHER_PID_ENV, signals_deferred, sigint_blocked
from .torchrun import GLOO_IFNAME, TorchrunEnv
from .workerproc import describe_exit, error_file, is_stopped
from ..telemetry import peerwait


def _terminate(procs: list[workerproc.Worker], grace: float = 3.0) -> None:
    """SIGTERM to each live worker, SIGKILL to those still alive after `grace`. A stopped worker (a hung
    peer: SIGSTOP, a debugger let go) holds the SIGTERM pending until it runs again: it is continued,
    and ends on it at once rather than after the grace."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
            if is_stopped(p.pid):
                p.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def spawn(
    cfg: Config, run_dir: Path, config: str, resume: bool = False, torchrun: TorchrunEnv | None = None
) -> tuple[int, str]:
    """Run cfg.workers × cfg.ranks_per_worker processes (ranks w·R … w·R+R−1 are worker w), or
    under torchrun (fault tolerant) the worker whose first rank is torchrun's; returns (exit status,
    message of the first failure).
    `config` (the resolved config as TOML) reaches the workers in their environment.
    KeyboardInterrupt and Terminated pass through, after every worker is ended and reaped."""
    with signals_deferred() as check_signals:
        launch = Launch(cfg, Path(run_dir), config, resume, torchrun)
        try:
            launch.prepare_logs()
            launch.open_rendezvous()
            launch.start_all(check_signals)
            return launch.watch(check_signals)
        finally:  # also on KeyboardInterrupt and Terminated
            launch.teardown()


class Launch:
    """One local launch, step by step (`spawn`): the run's workers, the rendezvous they meet at (a
    socket bound to 127.0.0.1, then the store serving on it), and, fault tolerant, their supervisor."""

    def __init__(self, cfg: Config, run_dir: Path, config: str, resume: bool, torchrun: TorchrunEnv | None = None):
        self.cfg, self.run_dir, self.config, self.resume = cfg, run_dir, config, resume
        self.world = cfg.workers * cfg.ranks_per_worker
        self.torchrun = torchrun
        # the ones started here: every rank, or under torchrun this rank's worker (its first rank's process
        # supervises the worker's ranks, `runner.run.run_rank`)
        self.ranks = range(self.world) if torchrun is None else [torchrun.rank + i for i in range(cfg.ranks_per_worker)]
        self.threads = cfg.threads or max(1, (os.cpu_count() or 1) // self.world)  # torch's, per worker
        self.procs: list[workerproc.Worker] = []
        self.supervisor: Supervisor | None = None
        self.sock: socket.socket | None = None
        self.port = 0  # the rendezvous's, on 127.0.0.1
        self.store: dist.TCPStore | None = None
        self.zygote: workerproc.Zygote | None = None
        self.fork = False  # this process may fork its workers (until the store serves)
        self.lives: dict[int, int] = {}  # an asynchronous learner -> the times it was restarted

    def prepare_logs(self) -> None:
        """logs/, without the error files of an earlier attempt: a failure reported is this run's. A
        pid file no one may replace (`rundir.files.check`) is refused before a worker starts."""
        logs = files.directory(self.run_dir / LOGS_DIR)
        for r in self.ranks:
            error_file(self.run_dir, r).unlink(missing_ok=True)
            files.check(logs / f"rank{r}.pid")
        (logs / SYNCER_ADDRESS_FILE).unlink(missing_ok=True)  # an earlier run's syncer: not this one's

    def open_rendezvous(self) -> None:
        """The supervisor first: a fault-tolerant run's lighthouse serves from a child process
        (`ft.lighthouse`), so this one stays single-threaded and may fork its workers (`workerproc`).
        Then the socket the store serves on; the store's threads start once the workers are forked
        (at once when this process cannot fork them anyway)."""
        if self.cfg.fault_tolerant:
            self.supervisor = Supervisor(self.cfg, self.run_dir, self.torchrun)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(512)  # workers may connect before the store serves: the kernel queues them
        self.port = self.sock.getsockname()[1]
        self.fork = workerproc.can_fork()
        if self.fork:
            workerproc.warm(self.cfg)
        else:
            self.store = _serve_store(self.sock, self.cfg.peer_timeout)

    def worker_env(self, rank: int, restarted: bool = False) -> dict[str, str]:
        """Rank `rank`'s environment: torchrun's variables, the run's own, and the supervisor's. Under
        torchrun the rank keeps its place on its node and gloo the interface torchrun's route chose."""
        local, local_world = (
            (rank, self.world)
            if self.torchrun is None
            else (self.torchrun.local_rank + rank - self.torchrun.rank, self.torchrun.local_world_size)
        )
        gloo = _loopback_ifname() if self.torchrun is None else os.environ.get(GLOO_IFNAME, _loopback_ifname())
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(local),
            WORLD_SIZE=str(self.world),
            LOCAL_WORLD_SIZE=str(local_world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            GLOO_SOCKET_IFNAME=gloo,
            OMP_NUM_THREADS=str(self.threads),
            WANSYNC_RUN_DIR=str(self.run_dir),
            WANSYNC_LAUNCHED="1",
            WANSYNC_RESUME="1" if self.resume else "0",
            WANSYNC_CONFIG=self.config,
            **{LAUNCHER_PID_ENV: str(os.getpid())},
        )
        if restarted:  # a fresh life: without the fault (WANSYNC_FAULT) that ended the last one, not from disk
            env.pop("WANSYNC_FAULT", None)
            env["WANSYNC_RESUME"] = "0"
        return env if self.supervisor is None else self.supervisor.worker_env(env, rank, restarted)

    def start(self, rank: int, restarted: bool = False, join: str = "") -> workerproc.Worker:
        """Start rank `rank`: forked while no store thread runs, later from the zygote (or fresh).
        `join`: the syncer's address, for an asynchronous learner restarted into the running run."""
        forked = self.fork and self.store is None
        env = self.worker_env(rank, restarted)
        if join:  # its place in the run, the version and its data position: the syncer's word
            env.update({JOIN_ENV: join, LEARNER_ENV: str(rank)})
        with sigint_blocked():  # the worker starts with SIGINT blocked, then ignores it
            proc = workerproc.start(
                env,
                fork=forked,
                close=[self.sock.fileno()] if forked else [],
                zygote=self.zygote,
            )
        workerproc.record_pid(self.run_dir / LOGS_DIR, rank, proc)
        return proc

    def start_all(self, check_signals: Callable[[], None]) -> None:
        """Every rank; after the forked ones, the zygote that forks a restarted worker later, and the store."""
        rejoined = self.torchrun is not None and self.torchrun.rejoined  # its first life heals, as a restart's
        for rank in self.ranks:
            self.procs.append(self.start(rank, restarted=rejoined))
            check_signals()
        if self.store is None:
            restarts = self.restarts_learners() or (self.supervisor is not None and self.supervisor.restarts_workers)
            if restarts and workerproc.Zygote.available():
                self.zygote = workerproc.Zygote(close=[self.sock.fileno()])
            self.store = _serve_store(self.sock, self.cfg.peer_timeout)

    def watch(self, check_signals: Callable[[], None]) -> tuple[int, str]:
        """Until the run ends: (exit status, the first failure). The first failure ends it, unless a
        supervisor restarts the worker or lets the others go on without it."""
        if self.supervisor is None:
            restart = self.restart_learner if self.restarts_learners() else None
            code, message = _watch(self.procs, self.run_dir, check_signals, self.survivable(), restart)
        else:
            code, message = self.supervisor.watch(
                self.procs, lambda rank: self.start(rank, restarted=True), check_signals, ranks=list(self.ranks)
            )
        if code == 0 and self.torchrun is None:  # every rank's profile is on this host
            peerwait.record(self.run_dir, self.run_dir / LOGS_DIR, self.world)
        return code, message

    def survivable(self) -> set[int]:
        """The ranks whose end does not end the run: an asynchronous strategy's learners but rank 0's
        (its process holds the syncer); none for a lock-step one, or when rank 0 is not started here."""
        from ..strategies import strategy_class

        if strategy_class(self.cfg.strategy).lock_step or 0 not in self.ranks:
            return set()
        return {i for i, rank in enumerate(self.ranks) if rank != 0}

    def restarts_learners(self) -> bool:
        """Does a dead asynchronous learner come back (`--max-restarts` without `--fault-tolerant`)?"""
        return self.supervisor is None and self.cfg.max_restarts > 0 and bool(self.survivable())

    def restart_learner(self, rank: int) -> tuple[workerproc.Worker | None, str]:
        """Start the asynchronous learner `rank`, which died, again into the running run: (its process, the
        end of the launcher's line), or (None, why not) when its restarts are spent or there is no run
        to rejoin (rank 0, the syncer's process, ended; the syncer not listening yet)."""
        lives, most = self.lives.get(rank, 0), self.cfg.max_restarts
        if lives >= most:
            return None, f"the others go on without it (--max-restarts {most} spent)"
        if self.procs[0].poll() is not None:
            return None, "not restarted: the run's syncer (rank 0) has ended"
        try:
            address = (self.run_dir / LOGS_DIR / SYNCER_ADDRESS_FILE).read_text().strip()
        except OSError:
            address = ""
        if not address:
            return None, "not restarted: the run's syncer was not listening yet; the others go on without it"
        error_file(self.run_dir, rank).unlink(missing_ok=True)  # its last life's line is told
        self.lives[rank] = lives + 1
        return self.start(rank, restarted=True, join=address), f"restarted ({lives + 1} of {most}): it rejoins the run"

    def teardown(self) -> None:
        """End and reap every worker; close the zygote, the store (or the socket it never took
        over) and the supervisor's lighthouse."""
        _terminate(self.procs)
        if self.zygote is not None:
            self.zygote.close()
        if self.store is None and self.sock is not None:
            self.sock.close()
        self.store = None  # the store stops serving
        if self.supervisor is not None:
            self.supervisor.close()


def _serve_store(sock: socket.socket, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, serving on the bound and listening `sock` (which it takes over)."""
    store = dist.TCPStore(
        "127.0.0.1",
        sock.getsockname()[1],
        None,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    sock.detach()
    return store


# A peer's "lost contact" is a consequence; when it is all the launcher has seen so far, it waits
# this long for the cause (a crashed rank may still be writing its error file on a loaded machine).
ROOT_CAUSE_GRACE_S = 2.0


def _watch(
    procs: list[workerproc.Worker],
    run_dir: Path,
    check_signals: Callable[[], None],
    survivable: set[int] = frozenset(),
    restart: Callable[[int], tuple[workerproc.Worker | None, str]] | None = None,
) -> tuple[int, str]:
    """Until every worker ended (0) or one failed (1, its one line). The failure of a worker in
    `survivable` is told in one line and the others go on (an asynchronous run's learners); `restart`
    may start it again (its process in `procs`, and the line says so) or say why not."""
    told: set[int] = set()
    while True:
        check_signals()  # a signal becomes an exception here, between polls
        codes = [p.poll() for p in procs]
        ended = any(c not in (None, 0) for r, c in enumerate(codes) if r not in survivable)  # the run failed
        for r, c in enumerate(codes):
            if r in survivable and c not in (None, 0) and r not in told and not ended:
                line = describe_exit(run_dir, r, c)
                proc, then = restart(r) if restart is not None else (None, "the others go on without it")
                if proc is not None:
                    procs[r], codes[r] = proc, None
                else:
                    told.add(r)
                print(f"wansync: {line}; {then}", file=sys.stderr, flush=True)
        codes = [0 if r in told else c for r, c in enumerate(codes)]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            message = first_cause(run_dir, codes)
            stopped = [r for r, p in enumerate(procs) if is_stopped(p.pid)]
            deadline = time.monotonic() + (0.0 if stopped else ROOT_CAUSE_GRACE_S)  # a stopped rank is the cause
            while PEER_LOST in message and time.monotonic() < deadline:
                time.sleep(0.05)
                message = first_cause(run_dir, [p.poll() for p in procs])
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


def _loopback_ifname() -> str:
    """Name of the loopback interface (gloo binds its sockets there)."""
    try:
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    except OSError:
        pass
    return "lo"
