"""A worker with a silent fault, with and without the robust mean (`--robust-mean median`).

For each seed, `wansync train` runs DiLoCo on the tiny LM with 4 workers, one run after the other
(niced, so that they do not compete for the CPU with each other): fault-free; fault-free with the
robust mean (it must clip nothing, and end bit for bit where the plain run does); and with worker 1's
pseudo-gradient multiplied by 1000 at one outer step (`WANSYNC_FAULT=...,action=scale`), without and
with the robust mean. The table gives each setting's final validation loss, mean over seeds with half
the range, and the clips the runs logged (`robust_clip` events in metrics.jsonl). `--probe` adds one
fault-free run at κ = 1, which clips about half the workers at every exchange: the largest norm / median
it sees is how close healthy workers' norms sit, which is what κ's default must clear.

    python benchmarks/robust_mean.py [--seeds 0,1,2] [--steps 200] [--sync-every 25] [--fault-step 50] [--probe]
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
    "--strategy",
    "diloco",
    "--model",
    "tiny",
    "--data",
    "shakespeare",
    "--workers",
    "4",
    "--batch-size",
    "8",
    "--seq-len",
    "64",
    "--threads",
    "1",
    "--eval-every",
    "1000",
    "--eval-batches",
    "8",
    "--checkpoint-every",
    "0",
    "--quiet",
]
SETTINGS = {  # name: (faulty, extra flags)
    "fault-free": (False, []),
    "fault-free, --robust-mean median": (False, ["--robust-mean", "median"]),
    "faulty, off": (True, []),
    "faulty, --robust-mean median": (True, ["--robust-mean", "median"]),
}


def train(out: Path, seed: int, args: argparse.Namespace, faulty: bool, extra: list[str]) -> dict:
    """One run; its final validation loss and the clips it logged."""
    cmd = ["nice", "-n", "10", sys.executable, "-m", "wansync", "train", *COMMON]
    cmd += ["--steps", str(args.steps), "--sync-every", str(args.sync_every), "--seed", str(seed), "--out", str(out)]
    env = dict(os.environ)
    env.pop("WANSYNC_FAULT", None)
    if faulty:
        env["WANSYNC_FAULT"] = f"rank=1,step={args.fault_step},action=scale,factor={args.factor:g}"
    done = subprocess.run(cmd + extra, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    after = [r["loss"] for r in records if r["type"] == "step" and r["step"] == args.fault_step + 10]
    run = {
        "loss": None,
        "after": after[0] if after else None,  # the training loss 10 steps after the fault's step
        "clips": [r for r in records if r["type"] == "robust_clip"],
        "error": None,
    }
    if done.returncode == 0:
        run["loss"] = json.loads((out / "summary.json").read_text())["final_val_loss"]
    else:  # the run ended in one line: that is the damage
        run["error"] = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[-200:])
    return run


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} ± {(max(values) - min(values)) / 2:.4f}" if values else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sync-every", type=int, default=25)
    ap.add_argument("--fault-step", type=int, default=50, help="an outer step (a multiple of --sync-every)")
    ap.add_argument("--factor", type=float, default=1000.0)
    ap.add_argument("--probe", action="store_true", help="one fault-free run at kappa 1 (the healthy norms' spread)")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for i, (name, (faulty, extra)) in enumerate(SETTINGS.items()):
                results[name].append(train(Path(tmp) / f"s{seed}-{i}", seed, args, faulty, extra))
                print(f"seed {seed} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
        probe = None
        if args.probe:
            probe = train(
                Path(tmp) / "probe", seeds[0], args, False, ["--robust-mean", "median", "--robust-kappa", "1"]
            )
    import torch

    print(f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(
        f"diloco, tiny LM, 4 workers, {args.steps} steps, H {args.sync_every}, seeds {args.seeds}; "
        f"faulty: worker 1's pseudo-gradient x {args.factor:g} at step {args.fault_step}\n"
    )
    print(
        f"| setting | final val_loss (mean ± half range) | per seed | train loss at step {args.fault_step + 10} "
        "| clips logged |"
    )
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        losses = [r["loss"] for r in runs if r["loss"] is not None]
        per_seed = ", ".join(f"{r['loss']:.4f}" if r["error"] is None else f"failed: {r['error']}" for r in runs)
        after = ", ".join("-" if r["after"] is None else f"{r['after']:.3f}" for r in runs)
        clips = sorted({f"step {c['step']} worker {c['worker']} x {c['factor']:.2g}" for r in runs for c in r["clips"]})
        print(
            f"| {name} | {spread(losses)} | {per_seed} | {after} | "
            f"{sum(len(r['clips']) for r in runs)}{': ' + '; '.join(clips) if clips else ''} |"
        )
    if probe is not None:
        ratios = [1 / c["factor"] for c in probe["clips"]]
        print(
            f"\nkappa 1 probe (seed {seeds[0]}): {len(ratios)} clips, largest norm / median {max(ratios, default=1):.3f}"
        )


if __name__ == "__main__":
    main()
