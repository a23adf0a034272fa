"""The launcher's side of a fault-tolerant run (docs/fault_tolerance.md): a failure does not end it.

The local launcher (`runner.launch`) hands its workers to a `Supervisor`, which
- starts torchft's lighthouse on 127.0.0.1 (`ft.lighthouse`), unless `--lighthouse HOST:PORT` names
  one, and tells every worker where it is (`ft.member.LIGHTHOUSE_ENV`);
- restarts a dead worker up to `--max-restarts` times, as a fresh life that heals from a live peer
  rather than resume from disk (`ft.member.RESTARTED_ENV`), and lets the others go on without it;
- ends the workers left behind once the run has ended (below);
- adds to summary.json what the run went through: worker_failures, rejoins, heals, steps_lost and
  short_exchanges (`ft.quorums`).

The run ends well when every worker still in it ends well. Once a worker has finished the run, the
ones still alive were left out of its end: a running one exits by itself within its start-up
deadline (3 peer timeouts, `ft.member`), so it gets LINGER_TIMEOUTS of them; a stopped one (SIGSTOP,
a hung host) cannot, so it gets one. Past that the supervisor ends it and says so in one line,
instead of waiting for it forever.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

from ..config import Config
from ..rundir.layout import LOGS_DIR, add_to_summary, has_summary
from ..runner.workerproc import Worker, describe_exit, error_file, is_stopped
from .member import LIGHTHOUSE_ENV, RESTARTED_ENV
from .quorum import require_torchft
from .quorums import heals, read_quorums, short_exchanges, steps_lost

HEARTBEAT_TIMEOUT_MS = 2000           # a worker silent this long is left out of the next quorum
LINGER_TIMEOUTS = 4                   # peer timeouts a running worker may outlive the run's end
POLL_S = 0.05


class Supervisor:
    """The fault-tolerant side of one local launch (see the module docstring); `close` ends the
    lighthouse it started."""

    def __init__(self, cfg: Config, run_dir: Path):
        require_torchft()
        self.cfg, self.run_dir = cfg, run_dir
        self.lighthouse, self.address = start_lighthouse(cfg)

    @property
    def restarts_workers(self) -> bool:
        """Will it restart a worker? (The launcher then keeps a zygote to fork one quickly.)"""
        return self.cfg.max_restarts > 0

    def worker_env(self, env: dict[str, str], restarted: bool) -> dict[str, str]:
        """A worker's environment: the lighthouse; for a restarted one, a fresh life that heals from
        a peer (not from disk) and without the fault that ended the first one."""
        env = dict(env, **{LIGHTHOUSE_ENV: self.address})
        if restarted:
            env.pop("WANSYNC_FAULT", None)
            env.update({"WANSYNC_RESUME": "0", RESTARTED_ENV: "1"})
        return env

    def watch(self, procs: list[Worker], restart: Callable[[int], Worker],
              check_signals: Callable[[], None]) -> tuple[int, str]:
        """Until every worker still in the run has ended: (exit status, the first failure). A failed
        worker is restarted in place (`restart(rank)`); the failures go into summary.json."""
        failures: dict[int, int] = {}
        left_behind: set[int] = set()           # ended by the supervisor after the run's end
        first = ""
        finished_at: float | None = None
        max_restarts = self.cfg.max_restarts
        while True:
            check_signals()                     # a signal becomes an exception here, between polls
            for rank, p in enumerate(procs):
                code = p.poll()
                if code in (None, 0) or failures.get(rank, 0) > max_restarts or rank in left_behind:
                    continue
                first = first or describe_exit(self.run_dir, rank, code)
                failures[rank] = failures.get(rank, 0) + 1
                if failures[rank] <= max_restarts:
                    error_file(self.run_dir, rank).unlink(missing_ok=True)
                    procs[rank] = restart(rank)
            ended = [p.poll() for r, p in enumerate(procs) if failures.get(r, 0) <= max_restarts and r not in left_behind]
            if all(c is not None for c in ended):
                ok = bool(ended) and all(c == 0 for c in ended)
                record_failures(self.run_dir, failures, restarts=sum(min(n, max_restarts) for n in failures.values()),
                                workers=len(procs), steps=self.cfg.steps)
                return (0 if ok else 1), ("" if ok else first)
            if finished_at is None and 0 in ended:
                finished_at = time.monotonic()
            if finished_at is not None:
                for rank in end_left_behind(procs, self.run_dir, time.monotonic() - finished_at,
                                            self.cfg.peer_timeout):
                    left_behind.add(rank)
                    failures[rank] = failures.get(rank, 0) + 1
            time.sleep(POLL_S)

    def close(self) -> None:
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


def start_lighthouse(cfg: Config) -> tuple[object | None, str]:
    """torchft's lighthouse on 127.0.0.1 (None when --lighthouse names one) and its address for the
    workers. A quorum waits up to --peer-timeout for a live (heartbeating) worker that is late, so
    slow workers stay in lockstep; a dead one stops heartbeating and is left out after 2 s."""
    if cfg.lighthouse:
        return None, f"http://{cfg.lighthouse}"
    from . import lighthouse
    server = lighthouse.start(join_timeout_ms=int(cfg.peer_timeout * 1000), heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    port = server.address().rsplit(":", 1)[1]
    return server, f"http://127.0.0.1:{port}"


def end_left_behind(procs: list[Worker], run_dir: Path, since_end: float, peer_timeout: float) -> list[int]:
    """Kill the workers still alive too long after the run's end (module docstring), each with one
    line in its error file and on stderr; returns their ranks (a failure each, never restarted)."""
    ended = []
    for rank, p in enumerate(procs):
        if p.poll() is not None:
            continue
        stopped = is_stopped(p.pid)
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
    a worker (`ft.quorums`) to summary.json (written by rank 0's worker; nothing without it)."""
    if not has_summary(run_dir):
        return
    quorums = read_quorums(run_dir / LOGS_DIR, workers)
    lost = steps_lost({w: [r["step"] for r in rs] for w, rs in quorums.items()}, end=steps,
                      healed={w: [r["step"] for r in rs if r.get("healed")] for w, rs in quorums.items()})
    add_to_summary(run_dir, {"worker_failures": sum(failures.values()), "rejoins": restarts,
                             "heals": heals(run_dir / LOGS_DIR), "steps_lost": [lost[w] for w in range(workers)],
                             "short_exchanges": short_exchanges(quorums[0], workers)})
