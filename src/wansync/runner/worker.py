"""Entry point of one worker process (spawned by the launcher or by torchrun).

A worker turns any failure into one line: into logs/rank{R}.err for the launcher to print,
or, under torchrun, raised for the CLI to print (once). The traceback, bounded, goes to logs/rank{R}.log.
A step stuck on this rank, which no peer's timeout may end (every rank stuck at once), is the stall
watchdog's (`trainer.stall`): the same one line, where the training thread is stuck in the log, and
the process ends at once.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import threading
import tomllib
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from .. import net
from ..config import Config, from_sections
from ..errors import PEER_LOST, ConfigError, WansyncError
from ..rundir import files
from .interrupts import Terminated, become_launched_worker, exit_status
from .torchrun import interface_hint
from ..ft.member import LIFE_ENV
from ..strategies.async_diloco import joins_running_run
from ..trainer.loop import Phase, train_worker
from ..trainer.stall import Watchdog


def init_distributed(cfg: Config) -> None:
    """The process group from the torchrun-style environment, under the emulator if asked.
    `--backend nccl` means NCCL for CUDA tensors and gloo for the few CPU ones (metrics, the
    schedule's agreement), one rank per GPU (LOCAL_RANK picks it). A fault-tolerant worker is a
    process group of its own (its ranks, `worker_store`): its exchanges run over torchft's quorum, its
    metrics are its own; under --wan its group carries the emulator, which the quorum's all-reduces
    run under (ft.quorum). So is an asynchronous learner the launcher restarted into its run
    (`async_diloco.JOIN_ENV`): it talks to the syncer only, over its own connection."""
    backend, emulator = ("cpu:gloo,cuda:nccl" if cfg.backend == "nccl" else cfg.backend), None
    if cfg.backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError("--backend nccl needs CUDA GPUs, and torch sees none here (use --backend gloo)")
        local = int(os.environ.get("LOCAL_RANK", 0))
        if local >= torch.cuda.device_count():
            raise ConfigError(
                f"--backend nccl: local rank {local} has no GPU ({torch.cuda.device_count()} visible; "
                f"one rank per GPU)"
            )
        torch.cuda.set_device(local)
    if cfg.topology is not None:
        backend, emulator = net.install(), net.Emulator(cfg.topology, seed=cfg.seed, timeout=cfg.peer_timeout)
    timeout = datetime.timedelta(seconds=cfg.peer_timeout)
    if cfg.fault_tolerant or joins_running_run():  # no world group: a dead worker must not be on any
        # collective's path (ft.quorum); an asynchronous learner restarted into its run meets no one
        dist.init_process_group(
            backend=backend,
            store=worker_store(cfg),
            rank=int(os.environ.get("RANK", 0)) % cfg.ranks_per_worker,
            world_size=cfg.ranks_per_worker,
            pg_options=emulator,
            timeout=timeout,
        )
        return
    dist.init_process_group(backend=backend, init_method="env://", pg_options=emulator, timeout=timeout)


def worker_store(cfg: Config) -> dist.Store:
    """Where a fault-tolerant worker's ranks meet to form its process group: nowhere for a worker of
    one rank; else the launcher's store (MASTER_ADDR:MASTER_PORT, on this host: a worker's ranks are
    started together by one launcher), under keys of this worker and this life of it, so that a
    restarted worker's ranks meet each other and nothing of the last life."""
    if cfg.ranks_per_worker == 1:
        return dist.HashStore()
    worker = int(os.environ.get("RANK", 0)) // cfg.ranks_per_worker
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        None,
        False,
        datetime.timedelta(seconds=cfg.peer_timeout),
    )
    return dist.PrefixStore(f"wansync/ft/worker{worker}/life{os.environ.get(LIFE_ENV, '0')}", store)


PEER_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "timed out",
    "timeout",
    "broken pipe",
    "connection refused",
    "socket closed",
    "end of file",
)


def one_line(exc: BaseException, rank: int, phase: Phase) -> str:
    """The failure as one line naming the rank and what it was doing."""
    if isinstance(exc, WansyncError):
        return f"rank {rank}: {exc}"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)  # drop C++ source locations
    if isinstance(exc, (RuntimeError, dist.DistError)) and any(m in str(exc).lower() for m in PEER_MARKERS):
        return (f"rank {rank} {PEER_LOST} during {phase.now}: " f"{type(exc).__name__}: {text}")[:500]
    return f"rank {rank} failed during {phase.now}: {type(exc).__name__}: {text}"[:500]


TRACEBACK_FRAMES = 64  # per exception of a chain: an exception re-raised on every retry gathers frames
MAX_TRACEBACK = 256 * 1024  # characters; the end, where the cause is, is kept


def bounded_traceback(exc: BaseException) -> str:
    """`exc`'s traceback for the rank's log, bounded in frames and size (a log must not grow without
    bound: a quorum retried for minutes once left a 300 MB traceback)."""
    text = "".join(traceback.format_exception(exc, limit=-TRACEBACK_FRAMES))
    return text if len(text) <= MAX_TRACEBACK else "...\n" + text[-MAX_TRACEBACK:]


def record_failure(log_dir: Path, rank: int, msg: str, detail: str) -> bool:
    """The one line in logs/rank{R}.err, for the launcher to print, then `detail` (a traceback) in
    logs/rank{R}.log, after the libraries' lines (ft.member); whether the one line was written. The
    line first: on a full disk the traceback may not fit."""
    try:
        files.write_text(log_dir / f"rank{rank}.err", msg + "\n")
    except WansyncError:  # a full disk, a hard link there (`rundir.files`): the caller prints the line
        return False
    try:
        with files.append(log_dir / f"rank{rank}.log") as log:
            log.write(detail)
    except (OSError, WansyncError):
        pass
    return True


def stalled(line: str, rank: int, log_dir: Path, launched: bool) -> None:
    """The stall watchdog's end of this process (`trainer.stall`): the one line as any failure's, with
    where the training thread is stuck in the log, and an exit at once (that thread cannot be
    interrupted; the launcher, or torchrun, ends the other ranks)."""
    main = sys._current_frames().get(threading.main_thread().ident or 0)
    stack = "".join(traceback.format_stack(main, limit=TRACEBACK_FRAMES)) if main is not None else ""
    told_launcher = record_failure(log_dir, rank, line, f"{line}\nthe training thread, stuck:\n{stack}") and launched
    if not told_launcher:  # under torchrun every rank says its own
        print(f"wansync: error: {line}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def run(cfg: Config, run_dir: Path, resume: bool = False) -> int:
    rank = int(os.environ.get("RANK", 0))
    launched = os.environ.get("WANSYNC_LAUNCHED") == "1"
    log_dir = run_dir / "logs"
    phase = Phase()
    watchdog = Watchdog(phase, cfg.peer_timeout, rank, lambda line: stalled(line, rank, log_dir, launched))
    try:
        files.directory(log_dir)
        init_distributed(cfg)
        rank_world = (
            (rank, int(os.environ.get("WORLD_SIZE", 1)))
            if cfg.fault_tolerant or joins_running_run()
            else (dist.get_rank(), dist.get_world_size())
        )
        watchdog.start()
        train_worker(cfg, run_dir, *rank_world, resume=resume, phase=phase)
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure becomes one line
        watchdog.stop()  # this failure is the one to report
        if isinstance(exc, (KeyboardInterrupt, Terminated)):
            if not launched:
                raise  # under torchrun the CLI says it in one line
            return exit_status(exc)
        msg = one_line(exc, rank, phase)
        if not launched and phase.now == "start-up" and PEER_LOST in msg:  # torchrun's nodes never met
            msg += interface_hint()
        told_launcher = record_failure(log_dir, rank, msg, bounded_traceback(exc)) and launched
        if not launched:  # under torchrun the CLI says it, once
            raise WansyncError(msg) from None
        if not told_launcher:
            print(f"wansync: error: {msg}", file=sys.stderr)
        return 1
    finally:
        watchdog.stop()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def main() -> None:
    become_launched_worker()
    run_dir = Path(os.environ["WANSYNC_RUN_DIR"])
    cfg = from_sections(tomllib.loads(os.environ["WANSYNC_CONFIG"]))  # from the launcher, not a file
    code = run(cfg, run_dir, resume=os.environ.get("WANSYNC_RESUME") == "1")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
