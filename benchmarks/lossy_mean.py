"""A lossy codec's mean over M workers, the all-gather path against the reduce-scatter path
(`comm.exchange.lossy_path`): what a rank puts on the wire per exchange (the ledger's `sent`), next to
fp32's ring all-reduce, and the error of the mean, on real gloo groups of 2, 4 and 8 ranks.

The values are real pseudo-gradients: every rank trains its own copy of the micro LM for a few
steps from the same start on its own data, and Δ_m = θ_start − θ_m is what DiLoCo would exchange.

    .venv/bin/python benchmarks/lossy_mean.py [--workers 2,4,8] [--steps 8]
    .venv/bin/python benchmarks/lossy_mean.py --wall [--wall-workers 8] [--wan cross-region]
    .venv/bin/python benchmarks/lossy_mean.py --blocks [--values 8e6]

`--wall` instead trains the same Streaming DiLoCo run with int8 twice under the emulated link, once
per path (`--codec-collective allgather | reduce_scatter`), one after the other in this one
invocation, and prints their wall clock, exposed communication, the emulator's modelled link time
and what a worker put on the wire, side by side.

`--blocks` times a codec's encode and decode of one buffer as the exchange runs them, block by block
(`codecs.encode_into`, `decode_into`, which keep their temporaries to one block), against the
whole-buffer `encode`/`decode`, side by side on one thread (best of 5; the bytes and bits are equal).

Beyond M = 8 the formula (codec chunk of 1024 values, 4-byte scale): the all-gather sends (M−1)·w per
rank, the reduce-scatter 2(M−1)/M·w (w: the encoded payload); the error of the all-gather path is one
quantization of each contribution averaged (it falls like 1/√M for independent errors), the
reduce-scatter path adds one quantization of the mean chunk (a floor that does not fall with M).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from typing import Any

import torch

from wansync.runner.localgroup import run_ranks

CODECS = ("bf16", "int8", "fp4")


def pseudo_gradient(rank: int, world: int, steps: int, model: str = "micro") -> tuple[torch.Tensor, Any]:
    """(Δ_m = θ_start − θ_m after `steps` local steps of this rank on its own data, the model): what
    DiLoCo would exchange, a real pseudo-gradient (also `sparse_exchange.py`'s)."""
    from wansync.config import Config
    from wansync.strategies.base import sync_tensors
    from wansync.trainer.optim import build_optimizer
    from wansync.workloads import build_workload

    cfg = Config(model=model, seq_len=32, batch_size=4, seed=0)
    torch.manual_seed(0)
    wl = build_workload(cfg, rank, world, 0, 1)
    start = torch.cat([t.detach().reshape(-1).clone() for t in sync_tensors(wl.model)])
    opt = build_optimizer(cfg, wl.model)
    for _ in range(steps):
        wl.loss(wl.model, wl.next_batch()).backward()
        opt.step()
        opt.zero_grad()
    return start - torch.cat([t.detach().reshape(-1) for t in sync_tensors(wl.model)]), wl.model


def measure(rank: int, world: int, steps: int) -> dict[str, Any]:
    from wansync.comm.exchange import Exchange

    delta, _ = pseudo_gradient(rank, world, steps)
    out: dict[str, Any] = {}
    ex = Exchange()
    exact = ex.mean(delta.clone(), "pseudo_grads").wait()
    out["fp32"] = {"sent": ex.ledger.snapshot()["pseudo_grads"]["sent"], "bytes": delta.numel() * 4, "err": 0.0}
    for codec in CODECS:
        for path in ("allgather", "reduce_scatter"):
            ex = Exchange()
            mean = ex.mean(delta.clone(), "pseudo_grads", codec, collective=path).wait()
            c = ex.ledger.snapshot()["pseudo_grads"]
            out[(codec, path)] = {
                "sent": c["sent"],
                "bytes": c["bytes"],
                "err": float((mean - exact).norm() / exact.norm()),
            }
    return out


WALL_RUN = [
    "--strategy",
    "streaming",
    "--codec",
    "int8",
    "--model",
    "tiny",
    "--steps",
    "30",
    "--sync-every",
    "10",
    "--fragments",
    "2",
    "--overlap",
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
    "2",
    "--quiet",
]


def wall_clock(workers: int, wan: str) -> None:
    """One streaming int8 run per lossy path under the same emulated link, side by side."""
    print(
        f"# {datetime.datetime.now():%Y-%m-%d %H:%M} on {platform.machine()}, {os.cpu_count()} CPUs, load "
        f"average {os.getloadavg()[0]:.1f}: wansync train {' '.join(WALL_RUN)} --workers {workers} --wan {wan}"
    )
    print("| path | wall s | exposed comm % | emulator's modelled comm s | sent per worker (ledger) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for path in ("allgather", "reduce_scatter"):
            out = os.path.join(root, path)
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "wansync",
                    "train",
                    *WALL_RUN,
                    "--workers",
                    str(workers),
                    "--wan",
                    wan,
                    "--codec-collective",
                    path,
                    "--out",
                    out,
                ],
                capture_output=True,
                text=True,
                timeout=3600,
            )
            if r.returncode != 0:
                print(f"| {path} | failed: {(r.stderr.strip().splitlines() or ['?'])[-1]} |")
                continue
            with open(os.path.join(out, "profile.json")) as f:
                prof = json.load(f)
            with open(os.path.join(out, "summary.json")) as f:
                grads = json.load(f)["comm"]["pseudo_grads"]  # rank 0's ledger: payload and wire
            print(
                f"| {path} | {prof['wall_clock_s']:.1f} | {prof['derived']['exposed_comm_pct']:.1f} | "
                f"{prof['derived']['comm_modelled_s']:.3f} | {grads['sent']:,} ({grads['sent'] / grads['bytes']:.2f} "
                f"x the payload) |",
                flush=True,
            )


def blocks(values: int) -> None:
    """Blocked against whole-buffer encode and decode (decode: summed into an accumulator, as the mean does)."""
    import time
    from wansync.comm.codecs import Encoded, decode_into, encode_into, get_codec

    torch.set_num_threads(1)
    x = torch.randn(values, generator=torch.Generator().manual_seed(0))
    acc = torch.zeros(values)
    print(
        f"# {datetime.datetime.now():%Y-%m-%d %H:%M} on {platform.machine()}, 1 thread, load average "
        f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}: {values:,} values"
    )
    print(
        "| codec | encode whole ms | encode blocked ms | blocked / whole | decode whole ms | decode blocked ms | blocked / whole |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in CODECS:
        codec = get_codec(name)
        out = torch.empty(codec.wire_bytes(values), dtype=torch.uint8)
        data = codec.encode(x).data
        runs = {
            "ew": lambda: codec.encode(x),
            "eb": lambda: encode_into(codec, x, out),
            "dw": lambda: acc.add_(codec.decode(Encoded(name, values, data))),
            "db": lambda: decode_into(codec, data, values, acc, add=True),
        }
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(5):
            for key, fn in runs.items():  # interleaved: the same machine state for both
                t0 = time.perf_counter()
                fn()
                best[key] = min(best[key], time.perf_counter() - t0)
        print(
            f"| {name} | {best['ew'] * 1e3:.1f} | {best['eb'] * 1e3:.1f} | {best['eb'] / best['ew']:.2f} | "
            f"{best['dw'] * 1e3:.1f} | {best['db'] * 1e3:.1f} | {best['db'] / best['dw']:.2f} |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="2,4,8")
    ap.add_argument("--steps", type=int, default=8, help="local steps before the exchange")
    ap.add_argument("--wall", action="store_true", help="the two paths' wall clock on an emulated run instead")
    ap.add_argument("--wall-workers", type=int, default=8)
    ap.add_argument("--wan", default="cross-region")
    ap.add_argument("--blocks", action="store_true", help="blocked against whole-buffer encode and decode instead")
    ap.add_argument("--values", type=float, default=8e6, help="--blocks: the buffer's length")
    a = ap.parse_args()
    if a.blocks:
        blocks(int(a.values))
        return
    if a.wall:
        wall_clock(a.wall_workers, a.wan)
        return
    print(
        f"# {datetime.date.today()} on {platform.machine()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}: micro LM pseudo-gradients after {a.steps} local steps"
    )
    print("| M | codec | path | payload w | sent per rank | sent / w | sent / fp32's | relative error of the mean |")
    print("|---|---|---|---|---|---|---|---|")
    for m in (int(x) for x in a.workers.split(",")):
        r = run_ranks(measure, m, a.steps, timeout=600)[0]
        fp32 = r["fp32"]["sent"]
        print(
            f"| {m} | fp32 | all-reduce | {r['fp32']['bytes']:,} | {fp32:,} | {fp32 / r['fp32']['bytes']:.3f} | 1.000 | 0 |"
        )
        for codec in CODECS:
            for path in ("allgather", "reduce_scatter"):
                c = r[(codec, path)]
                print(
                    f"| {m} | {codec} | {path} | {c['bytes']:,} | {c['sent']:,} | {c['sent'] / c['bytes']:.3f} | "
                    f"{c['sent'] / fp32:.3f} | {c['err']:.2e} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
