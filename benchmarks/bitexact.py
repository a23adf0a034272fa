"""Bit-exactness of a refactor: train a fixed set of cases through the CLI, keep each run's final
state, and compare it with the same cases trained on another tree.

    python benchmarks/bitexact.py --save /tmp/before          # on the tree before the change
    python benchmarks/bitexact.py --compare /tmp/before       # on the tree after it

A case is one `wansync train` of 13 steps (2 workers, tiny LM, seed 3): the eight strategies, the
int8 and fp4 codecs, `--on-nonfinite skip`, optimizer-state sync, workers of two ranks, and a
fault-tolerant run. What is compared, per rank: every tensor of the final checkpoint's model,
optimizer and strategy state (max |diff|, which is 0 when the bits agree) and summary.json's
`bytes_sent`. Only the CLI is used, so the script runs unchanged on both trees.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

COMMON = [
    "--workers",
    "2",
    "--model",
    "tiny",
    "--steps",
    "13",
    "--seed",
    "3",
    "--eval-every",
    "50",
    "--quiet",
    "--threads",
    "1",
]
CASES = {
    "ddp": ["--strategy", "ddp"],
    "local_sgd": ["--strategy", "local_sgd", "--sync-every", "4"],
    "post_local_sgd": ["--strategy", "post_local_sgd", "--sync-every", "4", "--switch-step", "5"],
    "slowmo": ["--strategy", "slowmo", "--sync-every", "4"],
    "cpdp": ["--strategy", "cpdp", "--sync-every", "4"],
    "diloco": ["--strategy", "diloco", "--sync-every", "4"],
    "streaming": ["--strategy", "streaming", "--sync-every", "8", "--fragments", "2", "--overlap", "2"],
    "cocodc": [
        "--strategy",
        "cocodc",
        "--sync-every",
        "8",
        "--fragments",
        "2",
        "--overlap",
        "2",
        "--syncs-per-period",
        "4",
    ],
    "streaming_int8": [
        "--strategy",
        "streaming",
        "--sync-every",
        "8",
        "--fragments",
        "2",
        "--overlap",
        "2",
        "--codec",
        "int8",
    ],
    "cocodc_fp4": [
        "--strategy",
        "cocodc",
        "--sync-every",
        "8",
        "--fragments",
        "2",
        "--overlap",
        "2",
        "--syncs-per-period",
        "4",
        "--codec",
        "fp4",
    ],
    "diloco_skip": ["--strategy", "diloco", "--sync-every", "4", "--on-nonfinite", "skip"],
    "local_sgd_optim_state": ["--strategy", "local_sgd", "--sync-every", "4", "--sync-optimizer-state"],
    "streaming_r2": [
        "--strategy",
        "streaming",
        "--sync-every",
        "8",
        "--fragments",
        "2",
        "--overlap",
        "2",
        "--ranks-per-worker",
        "2",
    ],
    "diloco_ft": ["--strategy", "diloco", "--sync-every", "4", "--fault-tolerant"],
}


def final_state(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    """rank -> flat name -> tensor, from the newest checkpoint (model, optimizer, strategy)."""
    step = sorted((run / "checkpoints").glob("step*"))[-1]
    out = {}
    for f in sorted(step.glob("rank*.pt")):
        state = torch.load(f, weights_only=True)
        flat: dict[str, torch.Tensor] = {}

        def visit(prefix: str, x: object) -> None:
            if torch.is_tensor(x):
                flat[prefix] = x
            elif isinstance(x, dict):
                for k, v in x.items():
                    visit(f"{prefix}.{k}", v)
            elif isinstance(x, (list, tuple)):
                for i, v in enumerate(x):
                    visit(f"{prefix}.{i}", v)

        for part in ("model", "optimizer", "strategy"):
            visit(part, state[part])
        out[f.stem] = flat
    return out


def train(name: str, args: list[str], root: Path) -> Path:
    out = root / name
    cmd = [sys.executable, "-m", "wansync", "train", *COMMON, *args, "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONHASHSEED="0"))
    if r.returncode != 0:
        raise SystemExit(f"{name}: exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", type=Path, help="train every case and keep its final state here")
    mode.add_argument("--compare", type=Path, help="train every case and compare with a --save directory")
    ap.add_argument("--only", default="", help="comma-separated case names")
    a = ap.parse_args()
    names = [n for n in CASES if not a.only or n in a.only.split(",")]
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            run = train(name, CASES[name], Path(tmp))
            state = final_state(run)
            sent = json.loads((run / "summary.json").read_text())["bytes_sent"]
            if a.save:
                a.save.mkdir(parents=True, exist_ok=True)
                torch.save({"state": state, "bytes_sent": sent}, a.save / f"{name}.pt")
                print(f"{name:24s} saved ({len(state)} ranks, bytes_sent {sent})", flush=True)
                continue
            ref = torch.load(a.compare / f"{name}.pt", weights_only=True)
            diff = 0.0
            keys_differ = set(ref["state"]) != set(state)
            for rank, tensors in ref["state"].items():
                mine = state.get(rank, {})
                keys_differ |= set(mine) != set(tensors)
                for k, t in tensors.items():
                    if k in mine and mine[k].shape == t.shape:
                        d = (mine[k].double() - t.double()).abs().max().item() if t.numel() else 0.0
                        diff = max(diff, d)
                    else:
                        keys_differ = True
            worst = max(worst, diff)
            ok = diff == 0 and not keys_differ and sent == ref["bytes_sent"]
            print(
                f"{name:24s} max|diff| {diff:.3g}  bytes_sent {sent} vs {ref['bytes_sent']}"
                f"{'  (state keys differ)' if keys_differ else ''}  {'ok' if ok else 'DIFFERS'}",
                flush=True,
            )
    if a.compare:
        print(f"worst max|diff| over {len(names)} cases: {worst:.3g}")


if __name__ == "__main__":
    main()
