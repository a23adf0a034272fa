"""MuLoCo against DiLoCo: Muon or AdamW as the inner optimizer, at two values of H and under SparseLoCo's exchange.

For each seed, `wansync train` runs the tiny LM (the default model, bytes of Shakespeare) with 2 workers,
one run after the other (niced, so that they do not compete with each other for the CPU): diloco at a
small and a large H, and sparseloco (its exchange at its defaults: top-k density 1/128, 2 bits, error
feedback) at the small H, each once with `--optimizer adamw` (DiLoCo, SparseLoCo) and once with
`--optimizer muon` (MuLoCo: Muon on the hidden matrices, AdamW on the rest; docs/muon.md). Everything
else is the same: the lr (Muon's groups through Moonlight's shape rule), its warmup and cosine, the outer
optimizer at the strategy's defaults. The table gives the final validation loss, mean ± standard
deviation over seeds, and Welch's p-value of muon against adamw (`wansync.analysis.stats`).

    python benchmarks/muloco.py [--seeds 0,1,2] [--steps 40] [--h 5,20] [--lr 3e-3]
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
    "--data",
    "shakespeare",
    "--workers",
    "2",
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
OPTIMIZERS = ("adamw", "muon")


def settings(h: list[int]) -> list[tuple[str, str, int]]:
    """(label, strategy, H): diloco at each H, sparseloco at the smallest."""
    return [(f"diloco, H = {x}", "diloco", x) for x in h] + [(f"sparseloco, H = {min(h)}", "sparseloco", min(h))]


def command(strategy: str, h: int, optimizer: str, seed: int, args: argparse.Namespace, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "wansync",
        "train",
        "--strategy",
        strategy,
        "--sync-every",
        str(h),
        "--optimizer",
        optimizer,
        "--lr",
        f"{args.lr:g}",
        "--warmup-steps",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--seed",
        str(seed),
        "--out",
        str(out),
        *COMMON,
    ]


def train(cmd: list[str], out: Path) -> float:
    """One run's final validation loss (the run's one-line error ends the benchmark)."""
    done = subprocess.run(["nice", "-n", "10", *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"muloco: {' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    return float(json.loads((out / "summary.json").read_text())["final_val_loss"])


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}" if len(values) > 1 else f"{values[0]:.4f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--h", default="5,20", help="diloco's values of H (sparseloco runs at the smallest)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=4)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    h = sorted(int(x) for x in args.h.split(","))
    loss: dict[tuple[str, str], list[float]] = {}
    started, load = datetime.datetime.now(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for label, strategy, sync_every in settings(h):
                for optimizer in OPTIMIZERS:
                    out = Path(tmp) / f"{strategy}-{sync_every}-{optimizer}-{seed}"
                    cmd = command(strategy, sync_every, optimizer, seed, args, out)
                    loss.setdefault((label, optimizer), []).append(train(cmd, out))
                    print(f"seed {seed}, {label}, {optimizer}: {loss[(label, optimizer)][-1]:.4f}", file=sys.stderr)
    import torch

    from wansync.analysis.stats import interval, p_text, welch_p

    minutes = (datetime.datetime.now() - started).total_seconds() / 60
    print(
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"1-minute load {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
        f"{len(loss) * len(seeds)} runs in {minutes:.1f} min"
    )
    example = command("diloco", h[0], "muon", seeds[0], args, Path("OUT"))
    print(f"each run: {' '.join(['wansync', *example[3:]])} (per setting: --strategy, --sync-every, --optimizer)\n")
    print("| setting | DiLoCo / SparseLoCo: adamw | MuLoCo: muon | muon − adamw | Welch |")
    print("|---|---|---|---|---|")
    for label, _, _ in settings(h):
        a, m = loss[(label, "adamw")], loss[(label, "muon")]
        p = welch_p(interval(m), interval(a)) if len(seeds) > 1 else None
        print(
            f"| {label} | {spread(a)} | {spread(m)} | {statistics.mean(m) - statistics.mean(a):+.4f} | "
            f"{p_text(p) if p is not None else '-'} |"
        )
    print(
        f"\nfinal validation loss (nats per byte) after {args.steps} steps, mean ± standard deviation over seeds {args.seeds}"
    )


if __name__ == "__main__":
    main()
