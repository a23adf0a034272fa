"""Chaos on the namespace test bed: three hosts (network namespaces joined by a bridge, tests/netns.py),
each a torchrun node of one fault-tolerant worker of R ranks (FSDP inside by default), each with its
own run and checkpoint directory (no shared file system), under a seeded schedule of real faults
injected from outside the run:

  kill       kill -9 of one rank of a worker (its supervisor restarts the worker whole, it heals)
  stop-short SIGSTOP of a worker's ranks for less than --peer-timeout, then SIGCONT
  stop-long  SIGSTOP of a worker's ranks for longer than --peer-timeout, then SIGCONT
  link       the host's veth taken down (`ip link set ... down` in its namespace), then up again
  host       every process of a host killed (agent, supervisor, ranks); its torchrun command started
             again on the same run directory (its own checkpoints); host A's rank 0 then trains
             --host-wait seconds slower over the next steps, so that the host is back while the run trains
  disk-full  the host's checkpoint directory is a 10 MB tmpfs from the start: its third checkpoint
             fails (ENOSPC), and every one after its restarts (checkpoints of a fault-tolerant run are
             not pruned), until the worker leaves the run after --max-restarts

Faults strike hosts B and C only: host A is node 0, whose rank 0 runs the torchft lighthouse and
writes summary.json; its loss ends the run by design (docs/fault_tolerance.md).

After each run it checks: the run finished (every agent exits 0) or stopped with one clear
`wansync: error` line; every worker holds bit-identical anchors (the global model after an outer
step, and each fragment's global copy for streaming) at every checkpoint step they all wrote
(--checkpoint-every = H: one per outer step), compared local rank by local rank across the hosts'
own directories with wansync's own digest (`ft.quorum.digest`, as the quorum log's anchor_digest);
no committed step lost (worker 0, never faulted, only moves forward in its metrics and quorum log; every checkpoint on every host
passes `rundir.checkpoint.damage` and loads with `torch.load(weights_only=True)`, a .pt without
its .json, left by a writer killed between the two, counted apart as partial); final validation
loss within --tolerance of the fault-free run with the same seed; no process and no namespace left
behind; the longest quorum wait (any worker's log). One markdown table row per run.

Faults strike at rank 0's step (between 15 % and 60 % of the run, 8 steps apart); stops and link cuts
last 0.2-0.5 (short) or 1.3-1.8 (long) x --peer-timeout, link cuts 0.3-1.5 x. The first run of each
strategy and seed is the fault-free reference.

    sudo .venv/bin/python benchmarks/chaos.py         # short (~1.5 min): diloco, seed 0, 60 steps, 2 faults
                                                      # drawn from kill, stop-short, stop-long, link
    sudo .venv/bin/python benchmarks/chaos.py --long  # ~12-18 min: diloco, streaming, sparseloco x 3 seeds,
                                                      # 80 steps, 4 faults from all six kinds
        [--strategies diloco,...] [--kinds kill,...] [--faults N] [--steps N] [--seeds N]
        [--ranks-per-worker 2] [--inside fsdp|ddp] [--peer-timeout 4] [--max-restarts 3] [--host-wait 12]
        [--keep DIR] [--json FILE]

Needs root (namespaces, tmpfs). Ctrl-C or SIGTERM: every process of the bed is killed, its
namespaces deleted, the tmpfs unmounted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import netns  # noqa: E402 - the test suite's bed

MODEL = [
    "--model",
    "micro",
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--eval-batches",
    "2",
    "--threads",
    "1",
    "--eval-every",
    "1000",
    "--quiet",
]
STRATEGY_ARGS = {
    "diloco": ["--sync-every", "4"],
    "streaming": ["--sync-every", "4", "--fragments", "2", "--overlap", "1"],
    "sparseloco": ["--sync-every", "4"],
}
KINDS = ("kill", "stop-short", "stop-long", "link", "host", "disk-full")
TMPFS_SIZE = "10m"  # two checkpoints of the micro LM with FSDP inside (4.3 MB a step)
_stopping = False


@dataclass
class Fault:
    at: int  # rank 0's step at which it strikes
    kind: str
    host: int  # 1 or 2 (B or C)
    seconds: float = 0.0  # how long a stop or a link down lasts
    done: bool = False
    note: str = ""


@dataclass
class Result:
    strategy: str
    seed: int
    faults: list[Fault] = field(default_factory=list)
    codes: list[int | str | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    finished: bool = False
    loss: float | None = None
    first_loss: float | None = None  # worker 0's training loss at its first logged step
    steps_lost: object = None
    summary: dict = field(default_factory=dict)
    forward: bool = True
    same: str = "-"
    bad_ckpts: list[str] = field(default_factory=list)
    ckpts: int = 0
    partial: int = 0
    longest_wait: float = 0.0
    left_procs: int = 0
    left_ns: int = 0
    wall: float = 0.0


def schedule(seed: int, kinds: list[str], count: int, steps: int, peer_timeout: float) -> list[Fault]:
    """`count` faults drawn with `seed`: kind (each of `kinds` once before any repeats), host (B or C),
    the step of rank 0 at which it strikes, between 15 % and 60 % of the run (a host's restart between 10
    and 20 %), at least 8 steps apart
    so that a worker is back before the next fault; stops and link cuts last less (short) or more
    (long) than the peer timeout."""
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    faults = []
    for i in range(count):
        kind = order[i] if i < len(order) else rng.choice(kinds)
        seconds = {
            "stop-short": peer_timeout * rng.uniform(0.2, 0.5),
            "stop-long": peer_timeout * rng.uniform(1.3, 1.8),
            "link": peer_timeout * rng.uniform(0.3, 1.5),
        }.get(kind, 0.0)
        # a host's restart takes ~15 s here (torchrun, its wait for the gone node's heartbeat, the workers'
        # start): it strikes early, so that the run is still training when the host is back
        early, late = (0.1, 0.2) if kind == "host" else (0.15, 0.6)
        faults.append(
            Fault(
                at=rng.randint(int(steps * early), int(steps * late)),
                kind=kind,
                host=rng.choice((1, 2)),
                seconds=round(seconds, 1),
            )
        )
    faults.sort(key=lambda f: f.at)
    for a, b in zip(faults, faults[1:]):
        b.at = max(b.at, a.at + 8)
        if a.kind == "host" and b.host == a.host:  # that host is still coming back: the other one
            b.host = 3 - a.host
    return faults


def jsonl(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


class Run:
    """One chaos run: three torchrun nodes in the bed, the faults of its schedule, its checks."""

    def __init__(
        self,
        bed: netns.Bed,
        work: Path,
        corpus: Path,
        strategy: str,
        seed: int,
        args: argparse.Namespace,
        faults: list[Fault],
    ):
        self.bed, self.args, self.faults = bed, args, faults
        self.dirs = [work / h.name for h in bed.hosts]
        work.mkdir(parents=True, exist_ok=True)
        self.procs: dict[int, subprocess.Popen] = {}
        self.outputs: dict[int, list[str]] = {}
        self.mounts: list[Path] = []
        self.flags = [
            "train",
            "--strategy",
            strategy,
            *STRATEGY_ARGS[strategy],
            "--steps",
            str(args.steps),
            "--seed",
            str(seed),
            "--fault-tolerant",
            "--max-restarts",
            str(args.max_restarts),
            "--peer-timeout",
            str(args.peer_timeout),
            "--checkpoint-every",
            STRATEGY_ARGS[strategy][1],
            "--data",
            str(corpus),
            *MODEL,
        ]
        if args.ranks_per_worker > 1:
            self.flags += ["--ranks-per-worker", str(args.ranks_per_worker), "--inside", args.inside]
        self.result = Result(strategy, seed, faults)
        self._offset, self._step = 0, 0
        self.hung: set[int] = set()
        self.grace = 4 * args.peer_timeout + 20  # rank 0 waits up to a peer timeout for reports

    # ---- processes ----------------------------------------------------------------------------
    def start(self, i: int) -> None:
        h, a = self.bed.hosts[i], self.bed.hosts[0]
        log = open(self.dirs[i].parent / f"{h.name}.{len(self.outputs.get(i, []))}.log", "w")
        self.outputs.setdefault(i, []).append(log.name)
        self.procs[i] = self.bed.start(
            h,
            netns.torchrun_wansync(
                a.address,
                [*self.flags, "--out", str(self.dirs[i])],
                nnodes=len(self.bed.hosts),
                nproc=self.args.ranks_per_worker,
                python=self.args.python,  # torchrun's, and its workers' (PYTHON_EXEC)
            ),
            env=netns.host_env(
                {"PYTHON_EXEC": self.args.python} if self.args.python else {},
                {"WANSYNC_FAULT": self.hold()} if i == 0 and self.hold() else {},
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def hold(self) -> str:
        """After a host is killed, host A's rank 0 trains `--host-wait` seconds slower, spread over the
        steps that follow (a third of --peer-timeout per outer step, which the others wait for at each
        quorum, well within it): a host's restart takes longer than this benchmark's short runs have left
        to train, more so on an idle machine, and it is to rejoin while the run trains (a real run's
        steps take seconds, not a tenth of one)."""
        h = int(self.flags[self.flags.index("--sync-every") + 1])
        pause = self.args.peer_timeout / (3 * h)
        pauses = [
            f"rank=0,step={f.at + k},action=pause,seconds={pause:.3f}"
            for f in self.faults
            if f.kind == "host"
            for k in range(1, math.ceil(self.args.host_wait / pause) + 1)
        ]
        return ";".join(pauses)

    def worker_pids(self, i: int) -> dict[int, int]:
        """rank -> pid of host i's live rank processes (their launcher's pid files)."""
        found = {}
        for f in (self.dirs[i] / "logs").glob("rank*.pid"):
            try:
                pid = int(f.read_text() or 0)
                if pid and Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
                    found[int(f.stem[4:])] = pid
            except (OSError, ValueError):
                pass
        return found

    def step(self, metrics: Path) -> int:
        """Rank 0's last step in its metrics.jsonl (read from where the last call stopped)."""
        try:
            with open(metrics, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return self._step
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("type") == "step":
                self._step = rec["step"]
        return self._step

    def ns_pids(self, i: int) -> list[int]:
        out = netns.ip("netns", "pids", self.bed.hosts[i].ns, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    # ---- faults ---------------------------------------------------------------------------------
    def inject(self, f: Fault) -> None:
        h = self.bed.hosts[f.host]
        ranks = self.worker_pids(f.host)
        if f.kind == "kill":
            if not ranks:
                f.note = "no live rank"
                return
            rank = random.Random(f.at).choice(sorted(ranks))
            os.kill(ranks[rank], signal.SIGKILL)
            f.note = f"rank {rank}"
        elif f.kind in ("stop-short", "stop-long"):
            if not ranks:
                f.note = "no live rank"
                return
            for pid in ranks.values():
                os.kill(pid, signal.SIGSTOP)
            sleep(f.seconds)
            for pid in ranks.values():
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            f.note = f"ranks {','.join(map(str, sorted(ranks)))}"
        elif f.kind == "link":
            netns.ip("-n", h.ns, "link", "set", h.ifname, "down")
            try:
                sleep(f.seconds)
            finally:
                netns.ip("-n", h.ns, "link", "set", h.ifname, "up")
        elif f.kind == "host":
            for pid in self.ns_pids(f.host):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.procs[f.host].wait(timeout=30)
            self.start(f.host)
        f.done = True

    def mount_full_disk(self, i: int) -> None:
        ck = self.dirs[i] / "checkpoints"
        ck.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(ck)], check=True)
        self.mounts.append(ck)

    def unmount(self) -> None:
        for m in self.mounts:
            subprocess.run(["umount", "-l", str(m)], capture_output=True)
        self.mounts = []

    # ---- the run --------------------------------------------------------------------------------
    def go(self, timeout: float) -> Result:
        t0 = time.monotonic()
        for f in self.faults:
            if f.kind == "disk-full":
                self.mount_full_disk(f.host)
                f.done, f.note = True, f"{TMPFS_SIZE} tmpfs"
        try:
            for i in range(len(self.bed.hosts)):
                self.start(i)
            pending = [f for f in self.faults if f.kind != "disk-full"]
            summary_at = None
            metrics = self.dirs[0] / "metrics.jsonl"
            while time.monotonic() - t0 < timeout and not _stopping:
                if all(p.poll() is not None for p in self.procs.values()):
                    break
                if pending and self.step(metrics) >= pending[0].at:
                    self.inject(pending.pop(0))
                    continue
                if summary_at is None and (self.dirs[0] / "summary.json").is_file():
                    summary_at = time.monotonic()
                if summary_at is not None and time.monotonic() - summary_at > self.grace:
                    # the run is over (rank 0 wrote summary.json); an agent still running waits in
                    # torchrun's exit barrier (300 s) for a host whose agent died, or is a restarted
                    # host's agent that found the rendezvous closed: end it, and say so
                    for i, p in self.procs.items():
                        if p.poll() is None:
                            self.hung.add(i)
                            os.killpg(p.pid, signal.SIGKILL)
                    break
                time.sleep(0.1)
            for f in pending:
                f.note = f.note or "not injected: the run ended first"
            for p in self.procs.values():
                if p.poll() is None:
                    p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            self.result.errors.append(f"timed out after {timeout:.0f} s")
        finally:
            self.result.wall = time.monotonic() - t0
            for i, p in self.procs.items():
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.wait(timeout=10)
            self.result.codes = ["hung" if i in self.hung else self.procs[i].returncode for i in sorted(self.procs)]
        self.check()
        self.unmount()
        return self.result

    # ---- checks ---------------------------------------------------------------------------------
    def check(self) -> None:
        import torch

        from wansync.ft.quorum import digest
        from wansync.rundir import checkpoint

        r = self.result
        for i, logs in self.outputs.items():
            text = Path(logs[-1]).read_text(errors="replace")
            r.errors += [line.strip() for line in text.splitlines() if line.startswith("wansync: error")][:1]
        summary = self.dirs[0] / "summary.json"
        r.summary = json.loads(summary.read_text()) if summary.is_file() else {}
        r.loss, r.steps_lost = r.summary.get("final_val_loss"), r.summary.get("steps_lost")
        r.finished = all(c == 0 for c in r.codes) or (bool(r.summary) and all(c in (0, "hung") for c in r.codes))
        records = [m for m in jsonl(self.dirs[0] / "metrics.jsonl") if m.get("type") == "step"]
        steps = [m["step"] for m in records]
        r.first_loss = next((m["loss"] for m in records if "loss" in m), None)
        slots = [q["step"] for q in jsonl(self.dirs[0] / "logs" / "quorum_rank0.jsonl")]
        # worker 0 is never faulted: its step only moves forward, in its metrics and its quorums
        r.forward = all(b > a for a, b in zip(steps, steps[1:])) and all(b >= a for a, b in zip(slots, slots[1:]))
        if not r.forward:
            back = (
                next((a, b) for a, b in zip(slots, slots[1:]) if b < a)
                if any(b < a for a, b in zip(slots, slots[1:]))
                else None
            )
            r.errors.append(
                "worker 0's step went back" + (f" from {back[0]} to {back[1]} (its quorum log)" if back else "")
            )
        waits = [
            q.get("seconds", 0.0)
            for d in self.dirs
            for f in (d / "logs").glob("quorum_rank*.jsonl")
            for q in jsonl(f)[1:]
        ]
        r.longest_wait = max(waits, default=0.0)
        rpw = self.args.ranks_per_worker
        per_step: dict[int, dict[int, dict[int, str]]] = {}  # step -> local rank -> worker -> digest
        for w, d in enumerate(self.dirs):
            for sd in checkpoint.step_dirs(d):
                for local in range(rpw):
                    rank = w * rpw + local
                    if not (sd / f"rank{rank}.pt").exists() and not (sd / f"rank{rank}.json").exists():
                        continue
                    if not (sd / f"rank{rank}.json").exists():
                        # the .pt is renamed into place before its .json: a writer killed between the
                        # two leaves this, which `damage` passes over (not a committed checkpoint)
                        r.partial += 1
                        continue
                    r.ckpts += 1
                    why = checkpoint.damage(sd, rank)
                    if why is None:
                        try:
                            state = torch.load(sd / f"rank{rank}.pt", map_location="cpu", weights_only=True)
                        except Exception as e:  # noqa: BLE001 - any unreadable file is a failing checkpoint
                            why = f"{sd}/rank{rank}.pt does not load: {str(e).splitlines()[0][:120]}"
                    if why is not None:
                        r.bad_ckpts.append(why)
                        continue
                    strat = state.get("strategy") or {}
                    per_step.setdefault(int(sd.name[4:]), {}).setdefault(local, {})[w] = digest(
                        {k: strat[k] for k in ("anchor", "anchors") if k in strat}
                    )
        compared = differ = 0
        for step, locals_ in sorted(per_step.items()):
            for local, by_worker in locals_.items():
                if len(by_worker) > 1:
                    compared += 1
                    if len(set(by_worker.values())) > 1:
                        differ += 1
                        r.errors.append(f"step {step} local rank {local}: workers {sorted(by_worker)} differ")
        logged: dict[tuple[int, int], dict[int, str]] = {}  # (step, quorum id) -> worker -> digest
        for d in self.dirs:
            for f in (d / "logs").glob("quorum_rank*.jsonl"):
                for q in jsonl(f):
                    if "anchor_digest" in q:
                        logged.setdefault((q["step"], q.get("quorum_id")), {})[int(f.stem[11:])] = q["anchor_digest"]
        for (step, qid), by_worker in sorted(logged.items()):
            if len(by_worker) > 1:
                compared += 1
                if len(set(by_worker.values())) > 1:
                    differ += 1
                    r.errors.append(
                        f"quorum {qid} at step {step}: anchor digests of workers {sorted(by_worker)} differ"
                    )
        r.same = "NO" if differ else (f"yes ({compared})" if compared else "-")


def record(r: Result, chaos: bool, reference: float | None) -> dict:
    """One run's result and checks, for --json."""
    return {
        "strategy": r.strategy,
        "seed": r.seed,
        "chaos": chaos,
        "codes": r.codes,
        "finished": r.finished,
        "errors": r.errors,
        "same_anchors": r.same,
        "forward": r.forward,
        "checkpoints": r.ckpts,
        "bad_checkpoints": r.bad_ckpts,
        "processes_left": r.left_procs,
        "longest_wait_s": r.longest_wait,
        "loss": r.loss,
        "fault_free_loss": reference,
        "first_loss": r.first_loss,
        "steps_lost": r.steps_lost,
        "wall_s": r.wall,
        "faults": [{"kind": f.kind, "at": f.at, "host": f.host, "done": f.done, "note": f.note} for f in r.faults],
        "summary": {k: r.summary.get(k) for k in ("worker_failures", "rejoins", "heals", "steps_lost")},
    }


def sleep(seconds: float) -> None:
    end = time.monotonic() + seconds
    while not _stopping and time.monotonic() < end:
        time.sleep(min(0.2, end - time.monotonic()))


def leftovers(base: Path, bed_token: str | None = None) -> tuple[int, int]:
    """Processes of this invocation's runs still alive anywhere (their command line names a path under
    `base`: another chaos run on the machine, a second test suite's, is not counted) and namespaces of
    this script's beds still listed."""
    mine = {(str(path) + os.sep).encode() for path in (base, base.resolve())}  # as given, and absolute
    procs = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if any(path in cmd for path in mine):
            procs += 1
    ns = sum(
        1
        for line in netns.ip("netns", "list", check=False).stdout.splitlines()
        if bed_token and line.startswith(f"{netns.PREFIX}{bed_token}")
    )
    return procs, ns


def fmt_faults(faults: list[Fault]) -> tuple[str, str]:
    injected: dict[str, int] = {}
    for f in faults:
        if f.done:
            injected[f.kind] = injected.get(f.kind, 0) + 1
    detail = "; ".join(
        (
            f"{f.kind} host{'abc'[f.host]} from the start"
            if f.kind == "disk-full"
            else f"{f.kind}@step{f.at} host{'abc'[f.host]}"
        )
        + (f" {f.seconds:.0f}s" if f.seconds else "")
        + (f" ({f.note})" if f.note else "")
        for f in faults
    )
    return ", ".join(f"{k}×{n}" for k, n in injected.items()) or "none", detail


def main() -> None:
    global _stopping
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", action="store_true", help="3 seeds, more steps and faults (<= 30 min)")
    ap.add_argument("--seeds", type=int)
    ap.add_argument("--strategies", help="default: short diloco, long diloco,streaming,sparseloco")
    ap.add_argument(
        "--kinds",
        help=f"fault kinds to draw from (default: short kill,stop-short,stop-long,link; "
        f"long all of {','.join(KINDS)})",
    )
    ap.add_argument("--faults", type=int, help="faults per run")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--ranks-per-worker", type=int, default=2)
    ap.add_argument("--inside", default="fsdp")
    ap.add_argument("--peer-timeout", type=float, default=4.0)
    ap.add_argument("--max-restarts", type=int, default=3)
    ap.add_argument("--tolerance", type=float, default=0.1, help="|final loss - fault-free| allowed")
    ap.add_argument(
        "--no-fault-free",
        action="store_true",
        help="skip each seed's fault-free run (its column reads -): the survival checks alone, in half the time",
    )
    ap.add_argument("--timeout", type=float, help="seconds per run before it is ended")
    ap.add_argument(
        "--host-wait", type=float, default=12.0, help="seconds host A's rank 0 trains slower after a host is killed"
    )
    ap.add_argument(
        "--python",
        help="the interpreter each host runs torchrun with, and torchrun its workers with (PYTHON_EXEC); "
        "default: this one (the suite's test gives tests/forked_python.py's stand-in)",
    )
    ap.add_argument("--keep", help="keep run directories under this path")
    ap.add_argument("--json", help="also write every run's result and checks to this file (the suite's test reads it)")
    args = ap.parse_args()
    args.seeds = args.seeds or (3 if args.long else 1)
    args.strategies = args.strategies or ("diloco,streaming,sparseloco" if args.long else "diloco")
    args.steps = args.steps or (80 if args.long else 60)
    args.faults = args.faults if args.faults is not None else (4 if args.long else 2)
    args.timeout = args.timeout or (240 if args.long else 150)
    kinds = (args.kinds or (",".join(KINDS) if args.long else "kill,stop-long,stop-short,link")).split(",")
    if args.python and not (os.path.isfile(args.python) and os.access(args.python, os.X_OK)):
        sys.exit(f"chaos: --python {args.python}: not an executable file")
    if unknown := [k for k in kinds if k not in KINDS]:
        sys.exit(f"chaos: unknown fault kind {unknown[0]!r} (choose from {', '.join(KINDS)})")
    why = netns.unavailable()
    if why:
        sys.exit(f"chaos: {why}")

    def stop(signum, _frame):
        global _stopping
        _stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)

    from wansync.workloads.lm.corpus import shakespeare_text

    started = time.monotonic()
    print(f"command: {' '.join(sys.argv)}")
    print(
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: {platform.machine()}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; 3 hosts x R={args.ranks_per_worker} "
        f"({args.inside} inside), {args.steps} steps, --peer-timeout {args.peer_timeout:g}, "
        f"--max-restarts {args.max_restarts}, tolerance {args.tolerance:g}\n",
        flush=True,
    )
    header = (
        "| strategy | seed | faults injected | faults survived | exit (A,B,C) | steps lost | checkpoints failing "
        "to load | same anchors at every checkpoint step | step counter forward | processes "
        "left | longest wait s | final loss | vs fault-free | wall s |"
    )
    rows, details, records = [header, "|" + "---|" * 14], [], []
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="wansync-chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    corpus = base / "plays.txt"
    corpus.write_text(shakespeare_text()[:100_000])
    bed = None
    token = None
    try:
        bed = netns.Bed(3)
        token = bed.token
        for strategy in args.strategies.split(","):
            if strategy not in STRATEGY_ARGS:
                sys.exit(f"chaos: strategy {strategy!r}: choose from {', '.join(STRATEGY_ARGS)}")
            clean: dict[int, float | None] = {}
            for seed in range(args.seeds):
                for chaos in (True,) if args.no_fault_free else (False, True):
                    if _stopping:
                        break
                    faults = schedule(seed, list(kinds), args.faults, args.steps, args.peer_timeout) if chaos else []
                    work = base / f"wansync-chaos-{strategy}-{seed}-{'chaos' if chaos else 'clean'}"
                    r = Run(bed, work, corpus, strategy, seed, args, faults).go(args.timeout)
                    bed.procs = [p for p in bed.procs if p.poll() is None]
                    r.left_procs, _ = leftovers(base)
                    if not chaos:
                        clean[seed] = r.loss
                    injected, detail = fmt_faults(faults)
                    survived = sum(f.done for f in faults) if r.finished and r.same != "NO" else 0
                    ref = clean.get(seed)
                    delta = f"{r.loss - ref:+.4f}" if r.loss is not None and ref is not None else "-"
                    within = (
                        "" if delta == "-" or not chaos else (" ok" if abs(r.loss - ref) <= args.tolerance else " OUT")
                    )
                    rows.append(
                        f"| {strategy} | {seed} | {injected if chaos else 'fault-free'} | "
                        f"{survived}/{sum(f.done for f in faults)} | {','.join(map(str, r.codes))} | "
                        f"{r.steps_lost} | {len(r.bad_ckpts)} of {r.ckpts}{f' ({r.partial} partial)' if r.partial else ''} | {r.same} | "
                        f"{'yes' if r.forward else 'NO'} | {r.left_procs} | {r.longest_wait:.1f} | "
                        f"{'-' if r.loss is None else f'{r.loss:.4f}'} | {delta}{within} | {r.wall:.0f} |"
                    )
                    print(rows[-1], flush=True)
                    records.append(record(r, chaos, ref))
                    if chaos or r.errors:
                        details.append(
                            f"- {strategy} seed {seed} {'chaos' if chaos else 'fault-free'}: "
                            f"{detail or 'no faults'}"
                            + (
                                f"; summary: failures {r.summary.get('worker_failures')}, rejoins "
                                f"{r.summary.get('rejoins')}, heals {r.summary.get('heals')}"
                                if r.summary
                                else ""
                            )
                            + "".join(f"\n  - {e}" for e in dict.fromkeys(r.errors + r.bad_ckpts[:3]))
                        )
    except KeyboardInterrupt:
        _stopping = True
        print("chaos: interrupted; cleaning up", file=sys.stderr)
    finally:
        if bed is not None:
            bed.close()
        for m in Path("/proc/mounts").read_text().splitlines():
            point = m.split()[1]
            if point.startswith(str(base)):
                subprocess.run(["umount", "-l", point], capture_output=True)
        procs, ns = leftovers(base, token)
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {"runs": records, "processes_left": procs, "namespaces_left": ns, "tolerance": args.tolerance},
                    indent=1,
                )
            )
        if not args.keep:
            import shutil

            shutil.rmtree(base, ignore_errors=True)
    print("\n" + "\n".join(rows[:2] + rows[2:]))
    grace = f"{4 * args.peer_timeout + 20:g}"
    print(
        f'\nfaults (rank 0\'s step when injected, host, duration; exit "hung": the agent was still running '
        f"{grace} s after rank 0 wrote summary.json, and was ended):\n" + "\n".join(details)
    )
    print(
        f"\nafter the bed was closed: {procs} processes of the runs and {ns} namespaces left; "
        f"total wall {time.monotonic() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
