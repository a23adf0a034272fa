"""Every registered strategy under emulated WAN links: wall clock and exposed-communication share.

For each preset and each strategy in ``wansync.strategies.STRATEGIES`` this runs ``wansync train``
(tiny LM, 4 local workers, gloo under the WAN emulator) one after the other and reads the run's
``profile.json``: wall clock, the share of it the training thread spent blocked on communication
(``exposed_comm``), the share of measured communication time hidden behind compute, bytes per step
and sync events. Runs are sequential so that they do not compete for the CPU; the table compares
strategies measured side by side in one invocation (ratios, not absolute times).

All strategies share ``--sync-every 8`` (where they have it) and ``--switch-step 8`` (post-local
SGD's DDP phase, scaled to a short run); every other option is the strategy's default.

    python benchmarks/wan_strategies.py [--presets two-site,cross-region] [--strategies ddp,local_sgd]
                                        [--steps 40] [--workers 4] [--out runs/bench_wan]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
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
    "--sync-every",
    "8",
    "--switch-step",
    "8",
    "--quiet",
]


def run_one(strategy: str, preset: str, steps: int, workers: int, out: Path) -> dict:
    run_dir = out / f"{preset}-{strategy}"
    cmd = [
        sys.executable,
        "-m",
        "wansync",
        "train",
        "--strategy",
        strategy,
        "--wan",
        preset,
        "--workers",
        str(workers),
        "--steps",
        str(steps),
        "--out",
        str(run_dir),
        *COMMON,
    ]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    elapsed = time.monotonic() - t0
    if r.returncode != 0:
        return {"strategy": strategy, "preset": preset, "error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    prof = json.loads((run_dir / "profile.json").read_text())
    summ = json.loads((run_dir / "summary.json").read_text())
    d, cats = prof["derived"], prof["categories_s"]
    return {
        "strategy": strategy,
        "preset": preset,
        "wall_s": prof["wall_clock_s"],
        "process_s": elapsed,
        "exposed_pct": d["exposed_comm_pct"],
        "hidden_pct": d["hidden_comm_pct"],
        "compute_s": cats["compute"],
        "exposed_s": cats["exposed_comm"],
        "mb_per_step": d["bytes_per_step"] / 1e6,
        "events": d["sync_events"],
        "residual_pct": prof["residual_pct"],
        "val_loss": summ.get("final_val_loss"),
    }


def fmt(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    head = (
        "| preset | strategy | wall s | exposed comm % | hidden comm % | compute s | MB/step | sync events "
        "| residual % | final val loss |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['strategy']} | failed: {r['error']} ||||||||")
            continue
        lines.append(
            f"| {r['preset']} | {r['strategy']} | {r['wall_s']:.1f} | {r['exposed_pct']:.1f} | "
            f"{fmt(r['hidden_pct'], '.1f')} | {r['compute_s']:.1f} | {r['mb_per_step']:.2f} | {r['events']} | "
            f"{r['residual_pct']:.4f} | {fmt(r['val_loss'], '.3f')} |"
        )
    return "\n".join(lines)


def main() -> None:
    from wansync.strategies import STRATEGIES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="two-site,cross-region")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", default="runs/bench_wan")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args()
    out = Path(args.out)
    rows = []
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]  # other jobs on the machine inflate compute: say so
    for preset in args.presets.split(","):
        for strategy in args.strategies.split(","):
            row = run_one(strategy, preset, args.steps, args.workers, out)
            rows.append(row)
            print(
                f"  {preset:>14} {strategy:>15}: "
                + (
                    f"wall {row['wall_s']:.1f} s, exposed {row['exposed_pct']:.1f} %"
                    if "error" not in row
                    else row["error"]
                ),
                flush=True,
            )
    import torch

    print()
    print(
        f"{datetime.date.today()} · {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} · "
        f"tiny LM, {args.workers} workers, {args.steps} steps, batch 8 × seq 64 per worker · "
        f"total {time.monotonic() - t0:.0f} s · load average at start {load0:.1f}, at end {os.getloadavg()[0]:.1f}"
    )
    print()
    print(table(rows))
    print()
    argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
    print(f"reproduce: .venv/bin/python benchmarks/wan_strategies.py {argv}".rstrip())
    print(
        "each run:  wansync train --strategy S --wan PRESET --workers "
        f"{args.workers} --steps {args.steps} " + " ".join(COMMON)
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
