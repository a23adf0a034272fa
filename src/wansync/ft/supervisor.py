"""The launcher's side of a fault-tolerant run (docs/fault_tolerance.md): a failure does not end it.

The local launcher (`runner.launch`) hands its workers to a `Supervisor`, which
- starts torchft's lighthouse on 127.0.0.1 (`ft.lighthouse`), unless `--lighthouse HOST:PORT` names
  one, and tells every worker where it is (`ft.member.LIGHTHOUSE_ENV`);
- restarts a dead worker up to `--max-restarts` times, as a fresh life that heals from a live peer
  rather than resume from disk (`ft.member.RESTARTED_ENV`), and lets the others go on without it;
  a worker of several ranks lives and dies whole: when one of its ranks fails the others are ended
  at once, and all are restarted together, as the worker's next life (`ft.member.LIFE_ENV`);
- ends the workers left behind once the run has ended (below);
- adds to summary.json what the run went through: worker_failures, rejoins, heals, steps_lost and
  short_exchanges (`ft.quorums`).

Under torchrun a supervisor watches one worker (the process torchrun started for its first rank,
`runner.launch`), and the workers' supervisors meet through torchrun's store (`ft.nodes`): worker
0's starts the lighthouse for all of them, and adds up every worker's report into summary.json.

The run ends well when every worker still in it ends well. Once a worker has finished the run, the
ones still alive were left out of its end: a running one exits by itself within its start-up
deadline (3 peer timeouts, `ft.member`), so it gets LINGER_TIMEOUTS of them; a stopped one (SIGSTOP,
a hung host) cannot, so it gets one. Past that the supervisor ends it and says so in one line,
instead of waiting for it forever. Before any worker has finished, once a worker has failed for
good and every one left is stopped, nothing can go on: it ends them at once (`end_stopped`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..config import Config
from ..errors import PEER_LOST, PeerError, first_line
from ..rundir import files
from ..rundir.layout import LOGS_DIR, add_to_summary, has_summary
from ..runner.workerproc import Worker, describe_exit, error_file, is_stopped
from ..runner.torchrun import TorchrunEnv
from .member import LIFE_ENV, LIGHTHOUSE_ENV, RESTARTED_ENV
from .nodes import Nodes
from .quorum import require_torchft
from ..trust.settings import current
from .quorums import heals, read_quorums, short_exchanges, steps_lost

HEARTBEAT_TIMEOUT_MS = 2000  # a worker silent this long is left out of the next quorum
LINGER_TIMEOUTS = 4  # peer timeouts a running worker may outlive the run's end
POLL_S = 0.05


class Supervisor:
    """The fault-tolerant side of one local launch (see the module docstring); `close` ends the
    lighthouse it started."""

    def __init__(self, cfg: Config, run_dir: Path, torchrun: TorchrunEnv | None = None):
        require_torchft()
        self.cfg, self.run_dir = cfg, run_dir
        self.nodes = None if torchrun is None else Nodes(torchrun, cfg.peer_timeout, cfg.ranks_per_worker)
        self.lighthouse, self.address = start_lighthouse(cfg, self.nodes)
        self.lives: dict[int, int] = {}  # worker -> its restarts so far (its ranks' LIFE_ENV)

    @property
    def restarts_workers(self) -> bool:
        """Will it restart a worker? (The launcher then keeps a zygote to fork one quickly.)"""
        return self.cfg.max_restarts > 0

    def worker_env(self, env: dict[str, str], rank: int, restarted: bool) -> dict[str, str]:
        """A rank's environment (the launcher's, `Launch.worker_env`, which drops a restarted life's fault
        and resume): the lighthouse and which life of its worker it is (`LIFE_ENV`); a restarted one heals
        from a peer (`RESTARTED_ENV`)."""
        env = dict(env, **{LIGHTHOUSE_ENV: self.address, LIFE_ENV: str(self.lives.get(self.worker_of(rank), 0))})
        if restarted:
            env[RESTARTED_ENV] = "1"
        return env

    def worker_of(self, rank: int) -> int:
        return rank // self.cfg.ranks_per_worker

    def watch(
        self,
        procs: list[Worker],
        restart: Callable[[int], Worker],
        check_signals: Callable[[], None],
        ranks: list[int] | None = None,
    ) -> tuple[int, str]:
        """Until every worker still in the run has ended: (exit status, the first failure). A worker
        lives and dies whole: when one of its ranks fails, the others are ended, and the worker is
        restarted in place, every rank (`restart(rank)`); the failures, one per worker's death, go
        into summary.json. `ranks`: the global ranks of `procs` (default: 0, 1, ...)."""
        ranks = list(range(len(procs))) if ranks is None else ranks
        units: dict[int, list[int]] = {}  # worker -> its ranks' indices in procs
        for i, rank in enumerate(ranks):
            units.setdefault(self.worker_of(rank), []).append(i)
        failures: dict[int, int] = {}  # per worker
        left_behind: set[int] = set()  # workers ended by the supervisor after the run's end
        first = ""
        finished_at: float | None = None
        max_restarts = self.cfg.max_restarts

        def in_run(w: int) -> bool:
            return failures.get(w, 0) <= max_restarts and w not in left_behind

        while True:
            check_signals()  # a signal becomes an exception here, between polls
            for w, idx in units.items():
                codes = [procs[i].poll() for i in idx]
                failed = [(ranks[i], c) for i, c in zip(idx, codes) if c not in (None, 0)]
                if not failed or not in_run(w):
                    continue
                first = first or root_cause(self.run_dir, failed)
                end_worker([procs[i] for i in idx])  # its other ranks, whatever they are doing now
                failures[w] = failures.get(w, 0) + 1
                if failures[w] <= max_restarts and self.nodes is not None and self.nodes.ended():
                    failures[w] = max_restarts + 1  # the run ended without it: nothing to rejoin
                if failures[w] <= max_restarts:
                    self.lives[w] = self.lives.get(w, 0) + 1
                    for i in idx:
                        error_file(self.run_dir, ranks[i]).unlink(missing_ok=True)
                    for i in idx:
                        procs[i] = restart(ranks[i])
            ended = {w: worker_code([procs[i] for i in idx]) for w, idx in units.items() if in_run(w)}
            if all(c is not None for c in ended.values()):
                ok = bool(ended) and all(c == 0 for c in ended.values())
                if self.nodes is not None:
                    return self.end_across_nodes(failures, ok, first)
                record_failures(
                    self.run_dir,
                    failures,
                    restarts=sum(min(n, max_restarts) for n in failures.values()),
                    workers=len(units),
                    steps=self.cfg.steps,
                )
                return (0 if ok else 1), ("" if ok else first)
            if finished_at is None and 0 in ended.values():
                finished_at = time.monotonic()
            live = [i for w, idx in units.items() if in_run(w) for i in idx]
            if finished_at is not None:
                ended_late = end_left_behind(
                    [procs[i] for i in live],
                    self.run_dir,
                    time.monotonic() - finished_at,
                    self.cfg.peer_timeout,
                    [ranks[i] for i in live],
                )
                for w in sorted({self.worker_of(rank) for rank in ended_late}):
                    end_worker([procs[i] for i in units[w]])
                    left_behind.add(w)
                    failures[w] = failures.get(w, 0) + 1
            elif first:
                for rank in end_stopped([procs[i] for i in live], [ranks[i] for i in live], set()):
                    w = self.worker_of(rank)
                    if w not in left_behind:
                        left_behind.add(w)
                        failures[w] = failures.get(w, 0) + 1
                    first += f" (rank {rank} is stopped: it hung, and the launcher ended it)"
            time.sleep(POLL_S)

    def end_across_nodes(self, failures: dict[int, int], ok: bool, first: str) -> tuple[int, str]:
        """Under torchrun, once this rank's worker has ended: say so, report, and (rank 0) add every
        rank's report to summary.json. A rank whose worker left the run for good waits until another
        finished it (so that its torchrun agent ends with theirs; rank 0's lighthouse serves them on)
        and ends well: the run went on without it, as under the local launcher."""
        nodes, cfg = self.nodes, self.cfg
        assert nodes is not None
        rank, logs = nodes.worker, self.run_dir / LOGS_DIR
        if ok:
            nodes.end()
        # a node that took its own place again (runner.rendezvous.LateJoin): its worker died with it and came back
        back = int(nodes.env.rejoined)
        nodes.report(rank_report(logs, rank, cfg.workers, failures.get(rank, 0), cfg.max_restarts, back))
        if not ok:
            if not nodes.wait_for_end(cfg.workers):
                return 1, first
            print(f"wansync: warning: {first}; the run went on without worker {rank}", file=sys.stderr)
        if rank == 0:
            reports = nodes.reports(cfg.workers, cfg.peer_timeout)  # the others end with rank 0's worker
            record(self.run_dir, {r: rep or gone_report() for r, rep in reports.items()}, cfg.steps)
        return 0, ""

    def close(self) -> None:
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


def start_lighthouse(cfg: Config, nodes: Nodes | None = None) -> tuple[object | None, str]:
    """torchft's lighthouse on 127.0.0.1 (None when --lighthouse names one) and its address for the
    workers; under torchrun (`nodes`) rank 0's, on every interface, and the others learn its address.
    A quorum waits up to --peer-timeout for a live (heartbeating) worker that is late, so slow workers
    stay in lockstep; a dead one stops heartbeating and is left out after 2 s."""
    if cfg.lighthouse:
        return None, f"http://{cfg.lighthouse}"
    if nodes is not None and nodes.worker != 0:
        try:
            return None, nodes.lighthouse()
        except RuntimeError as e:
            raise PeerError(
                f"rank 0 did not start the fault-tolerant run's lighthouse within --peer-timeout "
                f"{cfg.peer_timeout:g} s: {first_line(e)[:200]}"
            ) from None
    from . import lighthouse

    trust = current()
    server = lighthouse.start(
        join_timeout_ms=int(cfg.peer_timeout * 1000),
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
        host="127.0.0.1" if nodes is None else (trust.listen.address or nodes.own_address()),
        trust=trust,
    )
    port = int(server.address().rsplit(":", 1)[1])
    if nodes is None:
        return server, f"http://127.0.0.1:{port}"
    # on --bind's address, the lighthouse's own; else node 0's, where torchrun met the others
    url = server.address() if trust.listen.address else nodes.lighthouse_url(port)
    url = url if url.startswith("http") else f"http://{url}"
    nodes.publish_lighthouse(url)
    return server, url


def worker_code(procs: list[Worker]) -> int | None:
    """How a worker ended: None while any of its ranks runs; 0 when all ended well; else the status
    of one that did not."""
    codes = [p.poll() for p in procs]
    if any(c is None for c in codes):
        return None
    return next((c for c in codes if c != 0), 0)


def end_worker(procs: list[Worker]) -> None:
    """End (SIGKILL) and reap a worker's ranks still alive: one of them failed, and the others would
    wait for it in their worker's collectives, or keep the dead worker heartbeating in the quorum."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def root_cause(run_dir: Path, failed: list[tuple[int, int]]) -> str:
    """A failed worker's line: a rank's own failure rather than the lost contact it caused in the
    worker's other ranks."""
    lines = [describe_exit(run_dir, rank, code) for rank, code in failed]
    return next((line for line in lines if PEER_LOST not in line), lines[0])


def end_stopped(procs: list[Worker], ranks: list[int], gone: set[int]) -> list[int]:
    """After a failure, before any worker finished: when every worker still in the run (not in
    `gone`) is stopped (SIGSTOP, a hung host), none can go on or end by itself, and nothing is left
    to wait for. Kill them and return their ranks; [] while any one of them runs."""
    alive = [(r, p) for r, p in zip(ranks, procs) if r not in gone and p.poll() is None]
    if not alive or not all(is_stopped(p.pid) for _, p in alive):
        return []
    for _, p in alive:
        p.kill()
        p.wait()
    return [r for r, _ in alive]


def end_left_behind(
    procs: list[Worker], run_dir: Path, since_end: float, peer_timeout: float, ranks: list[int] | None = None
) -> list[int]:
    """Kill the workers still alive too long after the run's end (module docstring), each with one
    line in its error file and on stderr; returns their ranks (a failure each, never restarted)."""
    ended = []
    for rank, p in zip(range(len(procs)) if ranks is None else ranks, procs):
        if p.poll() is not None:
            continue
        stopped = is_stopped(p.pid)
        if since_end < (1 if stopped else LINGER_TIMEOUTS) * peer_timeout:
            continue
        how = "stopped (it hung)" if stopped else "still running"
        line = (
            f"rank {rank} was {how} {since_end:.0f} s after the other workers ended the run; "
            "it was left out of the run's end and the launcher ended it"
        )
        files.write_text(error_file(run_dir, rank), line + "\n")
        print(f"wansync: warning: {line}", file=sys.stderr)
        p.kill()
        p.wait()
        ended.append(rank)
    return ended


def record_failures(run_dir: Path, failures: dict[int, int], restarts: int, workers: int, steps: int) -> None:
    """Add the run's failures, rejoins, heals, the steps each worker lost and the exchanges short of
    a worker (`ft.quorums`) to summary.json (written by rank 0's worker; nothing without it)."""
    reports = {w: rank_report(run_dir / LOGS_DIR, w, workers, failures.get(w, 0), 0) for w in range(workers)}
    record(run_dir, reports, steps, restarts=restarts)


def rank_report(
    log_dir: Path, rank: int, workers: int, failures: int, max_restarts: int, rejoined: int = 0
) -> dict[str, Any]:
    """What worker `rank` went through, from its host's logs: failures, restarts, heals, the slots
    it took part in and those it healed at; `rejoined`: lives its node lost whole and started again."""
    mine = read_quorums(log_dir, workers)[rank]
    return {
        "failures": failures + rejoined,
        "restarts": min(failures, max_restarts) + rejoined,
        "heals": heals(log_dir, rank),
        "present": [r["step"] for r in mine],
        "healed": [r["step"] for r in mine if r.get("healed")],
        "participants": {str(r["step"]): r["participants"] for r in mine},
    }


def gone_report() -> dict[str, Any]:
    """The report of a rank whose node never gave one: gone, one failure, no slot."""
    return {"failures": 1, "restarts": 0, "heals": 0, "present": [], "healed": [], "participants": {}}


def record(run_dir: Path, reports: dict[int, dict[str, Any]], steps: int, restarts: int | None = None) -> None:
    """Add up every worker's report into summary.json (nothing when rank 0's worker wrote none):
    worker_failures, rejoins, heals, steps_lost, and short_exchanges as rank 0's worker saw them."""
    if not has_summary(run_dir):
        return
    workers = len(reports)
    lost = steps_lost(
        {w: r["present"] for w, r in reports.items()}, end=steps, healed={w: r["healed"] for w, r in reports.items()}
    )
    quorums0 = [{"step": int(s), "participants": n} for s, n in reports[0]["participants"].items()]
    add_to_summary(
        run_dir,
        {
            "worker_failures": sum(r["failures"] for r in reports.values()),
            "rejoins": sum(r["restarts"] for r in reports.values()) if restarts is None else restarts,
            "heals": sum(r["heals"] for r in reports.values()),
            "steps_lost": [lost[w] for w in range(workers)],
            "short_exchanges": short_exchanges(quorums0, workers),
        },
    )
