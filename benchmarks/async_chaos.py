"""Asynchronous DiLoCo under a site that stops: does anyone else stop, and how long does the run go
without a new version?

Three runs of `wansync train --strategy async_diloco --max-restarts 1` on the uneven world (topology
`uneven-speeds`: four workers at speeds 1, 1, 0.5 and 0.33, one per region, cross-region links), side by
side: one without faults; one in which the benchmark stops one site's processes (SIGSTOP, the slow site
by default) for `--stop` seconds once the run is `--at` seconds in, then continues them (SIGCONT); one in
which it kills that site's learner (SIGKILL) mid-round at `--at` and the launcher starts it again into
the running run. For each run it prints
the longest interval without a published version (the syncer's merge events in rank 0's metrics, the
run's last merge left out: the slowest learner's final round after the others ended), the same before
the fault and across it (the stop; for the kill, the interval the kill fell in), the goodput (tokens merged / tokens computed; summary.json's `asynchronous`), the
largest wait of a learner that was not stopped, the lives that joined, and the wall clock.

What to expect: the longest interval stays under the grace window plus one merge interval, the running
learners' waits do not grow, and the stopped learner's stale round is dropped (goodput below 1).

    python benchmarks/async_chaos.py [--stop 30] [--at 8] [--site 3] [--steps 400] [--quorum 2] [--grace 0.5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def train(out: Path, args: argparse.Namespace, site: int | None, fault: str = "stop") -> float:
    """One run; with `site`, that worker's process stopped for args.stop seconds at args.at, or killed there
    (`fault` "kill": the launcher restarts it)."""
    cmd = [
        sys.executable, "-m", "wansync", "train", "--strategy", "async_diloco", "--wan", "uneven-speeds",
        "--workers", "4", "--steps", str(args.steps), "--sync-every", str(args.h),
        "--merge-quorum", str(args.quorum), "--grace", str(args.grace), "--max-staleness", "2",
        "--model", "tiny", "--batch-size", "8", "--seq-len", "64", "--threads", "1",
        "--eval-every", "100000", "--eval-batches", "2", "--max-restarts", "1", "--quiet", "--out", str(out),
    ]  # fmt: skip
    began = time.perf_counter()
    proc = subprocess.Popen(cmd)
    if site is not None:
        pid_file = out / "logs" / f"rank{site}.pid"
        while not pid_file.is_file() and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(max(0.0, args.at - (time.perf_counter() - began)))
        pid = int(pid_file.read_text().split()[0])
        if fault == "kill":
            os.kill(pid, signal.SIGKILL)
            print(f"  killed worker {site} (pid {pid}) at {time.perf_counter() - began:.1f} s")
        else:
            os.kill(pid, signal.SIGSTOP)
            print(f"  stopped worker {site} (pid {pid}) at {time.perf_counter() - began:.1f} s for {args.stop:g} s")
            time.sleep(args.stop)
            os.kill(pid, signal.SIGCONT)
    if proc.wait() != 0:
        raise SystemExit(f"the run in {out} failed")
    return time.perf_counter() - began


def figures(out: Path, stopped: int | None, at: float, stop: float) -> dict[str, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # the last merge is the run's end: the slowest learner's final round after the others finished, not a
    # publication interval of the running run
    times = [r["time"] for r in records if r.get("type") == "merge"][:-1]
    gaps = [(b - a, a) for a, b in zip(times, times[1:])]
    summary = json.loads((out / "summary.json").read_text())
    waits = []
    for rank in range(4):
        if rank == stopped:
            continue
        profile = out / "logs" / f"profile_rank{rank}.json"
        if profile.is_file():
            waits.append(json.loads(profile.read_text()).get("categories_s", {}).get("exposed_comm", 0.0))
    return {
        "median_gap_s": statistics.median(g for g, _ in gaps),
        "longest_gap_s": max(g for g, _ in gaps),
        "longest_gap_before_s": max((g for g, t in gaps if t < at), default=float("nan")),
        "longest_gap_during_s": max((g for g, t in gaps if at <= t + g and t <= at + stop), default=float("nan")),
        "goodput": summary["asynchronous"]["goodput"],
        "versions": summary["asynchronous"]["versions"],
        "staleness_max": summary["asynchronous"]["staleness_max"],
        "joins": summary["asynchronous"]["joins"],
        "exposed_max_s": max(waits, default=float("nan")),
        "wall_clock_s": summary["wall_clock_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stop", type=float, default=30.0)
    ap.add_argument("--at", type=float, default=8.0)
    ap.add_argument("--site", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--h", type=int, default=25)
    ap.add_argument("--quorum", type=int, default=2)
    ap.add_argument("--grace", type=float, default=0.5)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="async_chaos_"))
    rows = {}
    runs = (
        ("no fault", None, "stop"),
        (f"worker {args.site} stopped {args.stop:g} s", args.site, "stop"),
        (f"worker {args.site} killed, restarted", args.site, "kill"),
    )
    for name, site, fault in runs:
        out = root / name.replace(" ", "_").replace(",", "")
        print(f"{name}: {out}")
        train(out, args, site, fault)
        rows[name] = figures(out, site if fault == "stop" else None, args.at, args.stop if fault == "stop" else 0.0)
    print(
        f"\n{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.machine()}, {os.cpu_count()} cores; grace {args.grace:g} s"
    )
    bound = args.grace + rows["no fault"]["median_gap_s"]
    for name, row in list(rows.items())[1:]:
        verdict = "under" if row["longest_gap_s"] < bound else "NOT under"
        print(
            f"{name}: longest interval without a version {row['longest_gap_s']:.2f} s, {verdict} the grace window "
            f"plus one merge interval of the fault-free run ({args.grace:g} + {bound - args.grace:.2f} = {bound:.2f} s)"
        )
    keys = list(next(iter(rows.values())))
    print("| run | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main()
