"""DiLoCo with and without whole-round overlap (`--overlap-rounds`) on one emulated link, side by side.

For each seed, `wansync train` runs diloco twice on the same preset (tiny LM, 4 workers, gloo under the
WAN emulator), one after the other so they do not compete for the CPU: once as DiLoCo, once with
`--overlap-rounds`. From each run's profile.json and summary.json: the wall clock per outer round
(training time / rounds), the exposed-communication share of the wall clock, the share of the measured
communication hidden behind compute, and the final validation loss at equal steps. The table gives the mean over
seeds with half the range, and the overlap/plain ratio of the means.

    python benchmarks/round_overlap.py [--wan cross-continent] [--seeds 0,1,2] [--steps 48] [--sync-every 8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = [
    "--model",
    "tiny",
    "--batch-size",
    "8",
    "--seq-len",
    "64",
    "--threads",
    "1",
    "--eval-every",
    "1000",
    "--eval-batches",
    "2",
    "--quiet",
    "--checkpoint-every",
    "0",
]


def run_one(out: Path, wan: str, seed: int, steps: int, h: int, overlap: bool, workers: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "wansync",
        "train",
        "--strategy",
        "diloco",
        "--wan",
        wan,
        "--workers",
        str(workers),
        "--steps",
        str(steps),
        "--sync-every",
        str(h),
        "--seed",
        str(seed),
        "--out",
        str(out),
        *COMMON,
        *(["--overlap-rounds"] if overlap else []),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        sys.exit(f"round_overlap: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    profile = json.loads((out / "profile.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    wall, derived = profile["wall_clock_s"], profile["derived"]
    return {
        "round_s": wall / (steps / h),
        "exposed_pct": 100.0 * profile["categories_s"]["exposed_comm"] / wall,
        "hidden_pct": derived.get("hidden_comm_pct"),
        "loss": summary["final_val_loss"],
    }


def cell(values: list[float], fmt: str = "{:.3f}") -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.mean(values))} (±{fmt.format((max(values) - min(values)) / 2)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wan", default="cross-continent")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print(
        f"{datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
        f"diloco, --wan {args.wan}, {args.workers} workers, H = {args.sync_every}, {args.steps} steps, "
        f"seeds {args.seeds}",
        flush=True,
    )
    rows: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for overlap in (False, True):
                out = Path(tmp) / f"{seed}-{int(overlap)}"
                rows[overlap].append(run_one(out, args.wan, seed, args.steps, args.sync_every, overlap, args.workers))
    print("\n| diloco | wall clock per round (s) | exposed comm (% of wall) | comm hidden (%) | final loss |")
    print("|---|---|---|---|---|")
    for overlap in (False, True):
        r = rows[overlap]
        hidden = [x["hidden_pct"] for x in r if x["hidden_pct"] is not None]
        print(
            f"| {'--overlap-rounds' if overlap else 'plain'} | {cell([x['round_s'] for x in r])} | "
            f"{cell([x['exposed_pct'] for x in r], '{:.1f}')} | {cell(hidden, '{:.1f}') if hidden else '-'} | "
            f"{cell([x['loss'] for x in r], '{:.4f}')} |"
        )
    plain, over = (statistics.mean(x["round_s"] for x in rows[o]) for o in (False, True))
    print(f"\noverlap / plain, wall clock per round: {over / plain:.3f}")


if __name__ == "__main__":
    main()
