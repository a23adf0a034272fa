"""What wansync's training loop costs on top of a hand-written torch loop, and what the emulator
costs per collective.

1. One process, no synchronization (local_sgd with H beyond the run). Three loops over the same
   model (same init), the same data (the workload's batches), the same optimizer (AdamW, grad clip
   1.0 as the trainer's default) and batch, run in interleaved blocks:
   - `bare`: `loss = workload.loss(model, batch); backward; clip_grad_norm_; opt.step(); zero_grad`;
   - `strategy`: the same through `ws.strategy(...)`: `sync.model`, `sync.step()`, `sync.zero_grad()`;
   - `trainer`: `wansync train`'s loop body (`Trainer.train_step`, the metrics record, the profiler
     lap, the progress line), i.e. with the profiler and metrics on.
   cnn trains on Fashion-MNIST when installed, else on random images of its shape.
   Throughput ratio = bare time / loop time (targets: strategy >= 0.97, trainer >= 0.95).
2. 4 ranks: one all-reduce of the tiny LM's gradients (7.3 MB) and of 1 KB over plain gloo and
   over the emulator with a zero-cost link (rtt 0, 1 Pbit/s), interleaved; the difference
   is the emulator's own overhead per collective, also as a share of a DDP training step (tiny LM,
   batch 8 x 64, one gradient all-reduce per step) on plain gloo. With 4 ranks on few cores the
   difference drowns in scheduling noise, so the same 1 KB all-reduce is also timed on a one-rank
   group, where nothing is on the wire and no peer is waited for: what is left is the emulator's
   own work (dispatch, link reservation, record, Future, completer thread) per collective.

    .venv/bin/python benchmarks/framework_overhead.py [--models tiny,small,cnn] [--rounds 8] [--block 3]
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from wansync.runner.localgroup import run_ranks

LM_BATCH, LM_SEQ, CNN_BATCH = 8, 64, 64


def _images(d: Path) -> str:
    """Fashion-MNIST when installed, else random images in its file format (speed only)."""
    from wansync.workloads.vision.datasets import FASHION_MNIST_DIR

    if (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        return "fashion-mnist"
    g = torch.Generator().manual_seed(0)
    for name, shape in (
        ("train-images-idx3-ubyte", (2048, 28, 28)),
        ("train-labels-idx1-ubyte", (2048,)),
        ("t10k-images-idx3-ubyte", (256, 28, 28)),
        ("t10k-labels-idx1-ubyte", (256,)),
    ):
        arr = torch.randint(0, 10 if "labels" in name else 256, shape, generator=g, dtype=torch.uint8)
        header = bytes([0, 0, 8, arr.dim()]) + b"".join(int(s).to_bytes(4, "big") for s in shape)
        with gzip.open(d / f"{name}.gz", "wb") as f:
            f.write(header + arr.numpy().tobytes())
    return f"fashion-mnist:{d}"


def _config(model: str, out: str) -> Any:
    from wansync.config import build_config

    lm = model not in ("cnn", "resnet18", "resnet50", "vit_s")
    data = {} if lm else {"data": _images(Path(out))}
    return build_config(
        overrides={
            **data,
            "strategy": "local_sgd",
            "sync_every": 10**9,
            "model": model,
            "steps": 10**6,
            "batch_size": LM_BATCH if lm else CNN_BATCH,
            "seq_len": LM_SEQ,
            "out": out,
            "eval_every": 10**6,
            "log_every": 10**6,
            "quiet": True,
            "threads": 1,
            "lr_schedule": "constant",
            "warmup_steps": 0,
        }
    )


def _loops(model_name: str, out: str) -> dict[str, Callable[[int], float]]:
    """Three loops over the same model, data and optimizer; each runs n steps and returns seconds."""
    import wansync as ws
    from wansync.trainer.optim import build_optimizer
    from wansync.trainer.loop import Trainer
    from wansync.workloads import build_workload

    cfg = _config(model_name, out)
    trainer = Trainer(cfg, Path(out), 0, 1)

    def fresh():
        torch.manual_seed(cfg.seed)
        workload = build_workload(cfg, 0, 1)
        return workload, build_optimizer(cfg, workload.model)

    bare_wl, bare_opt = fresh()
    lib_wl, lib_opt = fresh()
    sync = ws.strategy("local_sgd", lib_wl.model, lib_opt, sync_every=10**9)
    state = {"trainer_step": 0}

    def bare(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            loss = bare_wl.loss(bare_wl.model, bare_wl.next_batch())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(bare_wl.model.parameters(), cfg.grad_clip)
            bare_opt.step()
            bare_opt.zero_grad()
        return time.perf_counter() - t0

    def strategy(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            loss = lib_wl.loss(sync.model, lib_wl.next_batch())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lib_wl.model.parameters(), cfg.grad_clip)
            sync.step()
            sync.zero_grad()
        return time.perf_counter() - t0

    def trained(n: int) -> float:  # Trainer.run's loop body, evaluation never due
        t0 = time.perf_counter()
        for _ in range(n):
            rec = trainer.train_step(state["trainer_step"])
            state["trainer_step"] += 1
            trainer.writer.write(rec)
            trainer.profiler.lap("other")
            trainer.progress.update(rec["step"], f"loss {rec['loss']:.3f}")
        return time.perf_counter() - t0

    return {"bare": bare, "strategy": strategy, "trainer": trained}


def overhead_rank(rank: int, world: int, models: list[str], rounds: int, block: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in models:
        with tempfile.TemporaryDirectory() as tmp:
            loops = _loops(model, tmp)
            names = list(loops)
            for k in names:
                loops[k](1)  # warm-up
            times: dict[str, list[float]] = {k: [] for k in names}
            for i in range(rounds):
                for j in range(len(names)):
                    k = names[(i + j) % len(names)]
                    times[k].append(loops[k](block) / block)
            out[model] = {k: statistics.median(v) for k, v in times.items()}
    return out


def emulator_rank(rank: int, world: int, reps: int) -> dict[str, float]:
    import wansync as ws
    from wansync import net
    from wansync.workloads.lm.model import TransformerLM, lm_shape

    net.install()
    zero = net.Topology(sites=1, intra_link=net.Link(0.0, 1e15), inter_link=net.Link(0.0, 1e15), name="zero-cost")
    emulated = dist.new_group(backend=net.BACKEND_NAME, pg_options=net.Emulator(zero))
    plain = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = TransformerLM(lm_shape("tiny"), 256)
    grads = torch.zeros(sum(p.numel() for p in model.parameters()))
    small = torch.zeros(256)
    calls = {
        "plain_grads": lambda: dist.all_reduce(grads, group=plain),
        "emulated_grads": lambda: dist.all_reduce(grads, group=emulated),
        "plain_1KB": lambda: dist.all_reduce(small, group=plain),
        "emulated_1KB": lambda: dist.all_reduce(small, group=emulated),
    }
    sync = ws.strategy("ddp", model, torch.optim.AdamW(model.parameters(), lr=1e-4), group=plain)
    gen = torch.Generator().manual_seed(rank)

    def ddp_step() -> None:
        x = torch.randint(0, 256, (LM_BATCH, LM_SEQ + 1), generator=gen)
        logits = sync.model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1)).backward()
        sync.step()
        sync.zero_grad()

    calls["ddp_step"] = ddp_step
    names = list(calls)
    times: dict[str, list[float]] = {k: [] for k in names}
    for k in names:
        calls[k]()
    for i in range(reps):
        for j in range(len(names)):
            k = names[(i + j) % len(names)]
            dist.barrier(group=plain)
            t0 = time.perf_counter()
            calls[k]()
            times[k].append(time.perf_counter() - t0)
    out = {k: statistics.median(v) for k, v in times.items()}
    for key in ("grads", "1KB"):  # paired: both calls of a round, then the median
        out[f"diff_{key}"] = statistics.median(e - p for p, e in zip(times[f"plain_{key}"], times[f"emulated_{key}"]))
    return out


def emulator_solo(rank: int, world: int, blocks: int, calls: int) -> dict[str, float]:
    """The emulator's own cost per collective, with nothing on the wire and no peer to wait for: a
    1 KB all-reduce on a one-rank group, plain gloo vs emulated with a zero-cost link, `calls` calls
    per block, blocks interleaved; median µs per call over the blocks."""
    from wansync import net

    net.install()
    zero = net.Topology(sites=1, intra_link=net.Link(0.0, 1e15), inter_link=net.Link(0.0, 1e15), name="zero-cost")
    groups = {
        "plain": dist.new_group(backend="gloo"),
        "emulated": dist.new_group(backend=net.BACKEND_NAME, pg_options=net.Emulator(zero)),
    }
    small = torch.zeros(256)
    per_call: dict[str, list[float]] = {k: [] for k in groups}
    for i in range(blocks + 1):  # block 0 warms up and is dropped
        for k in list(groups) if i % 2 else list(groups)[::-1]:
            t0 = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(small, group=groups[k])
            if i:
                per_call[k].append((time.perf_counter() - t0) / calls)
    return {k: statistics.median(v) for k, v in per_call.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,small,cnn")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=3, help="steps per timed block")
    ap.add_argument("--emulator-reps", type=int, default=15)
    args = ap.parse_args()
    models = args.models.split(",")
    load0 = os.getloadavg()[0]
    loops = run_ranks(overhead_rank, 1, models, args.rounds, args.block, timeout=3600)[0]
    load1 = os.getloadavg()[0]
    emu = run_ranks(emulator_rank, 4, args.emulator_reps, timeout=1800)[0]
    solo = run_ranks(emulator_solo, 1, 21, 200, timeout=600)[0]
    load2 = os.getloadavg()[0]
    print(
        f"# framework_overhead  {datetime.datetime.now():%Y-%m-%d %H:%M}  {platform.machine()}  {os.cpu_count()} CPUs  "
        f"torch {torch.__version__}; load average {load0:.1f} / {load1:.1f} / {load2:.1f} (start / after loops / end)"
    )
    print(
        f"\nOne process, no sync, 1 thread, median ms per step over {args.rounds} interleaved blocks of {args.block}:"
    )
    print(
        "| model | bare torch loop ms | ws.strategy loop ms | ratio (>= 0.97) | wansync train loop ms | ratio (>= 0.95) |"
    )
    print("|---|---|---|---|---|---|")
    for model, r in loops.items():
        print(
            f"| {model} | {1e3 * r['bare']:.1f} | {1e3 * r['strategy']:.1f} | {r['bare'] / r['strategy']:.3f} | "
            f"{1e3 * r['trainer']:.1f} | {r['bare'] / r['trainer']:.3f} |"
        )
    step = emu["ddp_step"]
    print(
        "\nThe emulator's own cost, nothing on the wire: a 1 KB all-reduce on a one-rank group, "
        "median µs per call over 21 interleaved blocks of 200 calls:"
    )
    print("| plain gloo µs | emulated, zero-cost link µs | emulator overhead µs | share of a 4-rank DDP step |")
    print("|---|---|---|---|")
    d = solo["emulated"] - solo["plain"]
    print(f"| {1e6 * solo['plain']:.1f} | {1e6 * solo['emulated']:.1f} | {1e6 * d:.1f} | {d / step:+.4%} |")
    print(
        f"\n4 ranks (gloo, 127.0.0.1), {args.emulator_reps} interleaved rounds, a barrier before each call; "
        "medians, and the median of the rounds' paired differences:"
    )
    print(
        "| collective | plain gloo µs | emulated, zero-cost link µs | emulator overhead µs (paired) | share of a DDP step |"
    )
    print("|---|---|---|---|---|")
    for label, key in (("all-reduce 7.3 MB (tiny LM grads)", "grads"), ("all-reduce 1 KB", "1KB")):
        p, e, d = emu[f"plain_{key}"], emu[f"emulated_{key}"], emu[f"diff_{key}"]
        print(f"| {label} | {1e6 * p:.0f} | {1e6 * e:.0f} | {1e6 * d:.0f} | {d / step:+.2%} |")
    print(f"DDP training step on plain gloo (tiny LM, batch {LM_BATCH} x {LM_SEQ}, 4 ranks): {1e3 * step:.1f} ms")
    print(
        f"reproduce: .venv/bin/python benchmarks/framework_overhead.py --models {args.models} --rounds {args.rounds} "
        f"--block {args.block} --emulator-reps {args.emulator_reps}"
    )


if __name__ == "__main__":
    main()
