"""The boundary step of each strategy against its nearest peer, same model, same 2-rank gloo group.

- local_sgd `boundary()` / torch's `PeriodicModelAverager.average_parameters`, each right after its
  own model's forward, backward and inner step, as a boundary runs in training (only the averaging
  is timed) (target <= 1.0 with drift telemetry on; the drift rides on the parameter exchange).
- diloco `sync.step()` at H = 1 (every step an outer step) / torchft's `DiLoCo` optimizer step with
  one fragment; streaming over one period (2 fragments, H = 4, overlap 1, alpha 0) / torchft's
  `DiLoCo` with 2 fragments, `fragment_sync_delay=1`: the step calls of one period summed, forward
  and backward excluded (target <= 0.5). torchft rows need `pip install torchft` (the `bench` extra)
  and run its lighthouse in this process; without it they are skipped with a note.
- ddp: one training step (forward, backward with the reducer, optimizer step) / bare
  `DistributedDataParallel` (target <= 1.02).

Model: the tiny LM (1.82M parameters), batch 4 x 64 tokens, plain SGD inside. Every configuration
runs once per round, in an order shuffled anew each round (a rotation would keep each configuration
behind the same neighbour, and so in the same cache state, every round), a barrier before each. The
median per call over the rounds is printed, and the ratio is the median of the per-round ratios
(ours and the peer ran in the same round, so a slow round divides out), with its quartiles.

    .venv/bin/python benchmarks/sync_cost.py [--reps 15]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import socket
import statistics
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from wansync.runner.localgroup import run_ranks

BATCH, SEQ, VOCAB, LR = 4, 64, 256, 1e-3


def _tiny_lm() -> torch.nn.Module:
    from wansync.workloads.lm.model import TransformerLM, lm_shape

    torch.manual_seed(0)
    return TransformerLM(lm_shape("tiny"), VOCAB)


def _loss(model: torch.nn.Module, gen: torch.Generator) -> torch.Tensor:
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    logits = model(x[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _stepper(model, step: Callable[[], None], zero: Callable[[], None], gen) -> Callable[[int], float]:
    """n training steps; returns the time spent in `step` (the sync step), not forward/backward (a
    barrier after the backward: one rank's slower backward is not the other's sync cost)."""

    def run(n: int) -> float:
        total = 0.0
        for _ in range(n):
            _loss(model, gen).backward()
            dist.barrier()
            total += _timed(step)
            zero()
        return total

    return run


def _torchft_diloco(rank: int, lighthouse: str, fragments: int, sync_every: int, delay: int):
    """torchft's DiLoCo on a fresh tiny LM: one replica group per rank, world size 1 inside."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    model = _tiny_lm()
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=model.load_state_dict,
        state_dict=model.state_dict,
        min_replica_size=2,
        use_async_quorum=False,
        timeout=timedelta(seconds=60),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"bench{rank}_{fragments}",
    )
    if fragments == 1:
        parts = [model]
    else:
        blocks = list(model.blocks)
        half = len(blocks) // 2
        parts = [torch.nn.ModuleList([model.embed, *blocks[:half]]), torch.nn.ModuleList([*blocks[half:], model.norm])]
    outer = [torch.optim.SGD(p.parameters(), lr=0.7, momentum=0.9, nesterov=True) for p in parts]
    diloco = DiLoCo(manager, parts, inner, outer, sync_every=sync_every, fragment_sync_delay=delay)
    diloco.__enter__()
    return model, inner, (manager, diloco, store)


def bench_rank(rank: int, world: int, reps: int, lighthouses: list[str] | None) -> dict[str, Any]:
    import wansync as ws
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.nn.parallel import DistributedDataParallel

    gen = torch.Generator().manual_seed(rank)
    calls: dict[str, Callable[[], float]] = {}
    keep = []

    # local_sgd boundary vs PeriodicModelAverager, each on its own copy of the model (both re-point
    # parameters into new buffers, so a shared model would make one side page-fault for the other),
    # each right after its own model's inner step, as in training (only the averaging is timed)
    def after_inner_step(m: torch.nn.Module, opt: torch.optim.Optimizer, average: Callable[[], Any]):
        def run() -> float:
            _loss(m, gen).backward()
            opt.step()
            dist.barrier()
            t = _timed(average)
            opt.zero_grad()
            return t

        return run

    model = _tiny_lm()
    params = list(model.parameters())
    averager = PeriodicModelAverager(period=1, warmup_steps=0)
    m_on, m_off = _tiny_lm(), _tiny_lm()
    on = ws.strategy("local_sgd", m_on, torch.optim.SGD(m_on.parameters(), lr=LR), sync_every=1)
    off = ws.strategy(
        "local_sgd", m_off, torch.optim.SGD(m_off.parameters(), lr=LR), sync_every=1, drift_telemetry=False
    )
    calls["pma"] = after_inner_step(model, torch.optim.SGD(params, lr=LR), lambda: averager.average_parameters(params))
    calls["local_sgd"] = after_inner_step(m_on, on.optimizer, on.boundary)
    calls["local_sgd_nodrift"] = after_inner_step(m_off, off.optimizer, off.boundary)

    # diloco at H = 1 and streaming over one period, telemetry on and off
    for key, name, opts, n in (
        ("diloco", "diloco", {"sync_every": 1}, 1),
        ("diloco_nodrift", "diloco", {"sync_every": 1, "drift_telemetry": False}, 1),
        (
            "streaming",
            "streaming",
            {"sync_every": 4, "fragments": 2, "overlap": 1, "alpha": 0.0, "partition": "sequential"},
            4,
        ),
    ):
        m = _tiny_lm()
        sync = ws.strategy(name, m, torch.optim.SGD(m.parameters(), lr=LR), **opts)
        run = _stepper(m, sync.step, sync.zero_grad, gen)
        calls[key] = lambda run=run, n=n: run(n)
        keep.append(sync)

    # ddp vs bare DDP: whole training steps
    m = _tiny_lm()
    sync = ws.strategy("ddp", m, torch.optim.SGD(m.parameters(), lr=LR))
    calls["ddp"] = lambda: _timed(lambda: (_loss(sync.model, gen).backward(), sync.step(), sync.zero_grad()))
    m2 = _tiny_lm()
    bare = DistributedDataParallel(m2)
    bare_opt = torch.optim.SGD(m2.parameters(), lr=LR)
    calls["bare_ddp"] = lambda: _timed(lambda: (_loss(bare, gen).backward(), bare_opt.step(), bare_opt.zero_grad()))
    keep += [sync, bare]

    note = None
    if lighthouses is not None:
        try:
            for lighthouse, (key, frags, h, delay, n) in zip(
                lighthouses, (("torchft_diloco", 1, 1, 0, 1), ("torchft_streaming", 2, 4, 1, 4))
            ):
                m, inner, handles = _torchft_diloco(rank, lighthouse, frags, h, delay)
                run = _stepper(m, inner.step, inner.zero_grad, gen)
                calls[key] = lambda run=run, n=n: run(n)
                keep.append(handles)
        except Exception as e:  # noqa: BLE001 - the note says why the rows are missing
            note = f"torchft rows skipped: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            calls.pop("torchft_diloco", None)
    else:
        note = "torchft rows skipped: torchft is not installed (pip install -e '.[bench]')"

    names = sorted(calls)
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(2):  # warm-up (torchft: first quorum)
        for k in names:
            dist.barrier()
            calls[k]()
    order = random.Random(0)  # the same on every rank: the barriers pair up
    for _ in range(reps):
        for k in order.sample(names, len(names)):
            dist.barrier()
            times[k].append(calls[k]())
    return {"ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}, "times": times, "note": note}


def paired_ratio(ours: list[float], peer: list[float]) -> tuple[float, float, float]:
    """The median and quartiles of the per-round ratios ours/peer: both ran in the same round, so
    whatever slowed the machine during that round divides out."""
    q = statistics.quantiles([a / b for a, b in zip(ours, peer)], n=4)
    return q[1], q[0], q[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    os.environ.setdefault("RUST_LOG", "error")  # torchft's lighthouse and managers log every quorum
    servers = []  # one torchft lighthouse per torchft configuration
    try:
        from torchft._torchft import LighthouseServer

        servers = [LighthouseServer(bind=f"127.0.0.1:{_free_port()}", min_replicas=2) for _ in range(2)]
    except ImportError:
        pass
    lighthouses = [s.address() for s in servers] or None
    load = os.getloadavg()
    try:
        results = run_ranks(bench_rank, 2, args.reps, lighthouses, timeout=1200)
    finally:
        for s in servers:
            s.shutdown()
    r, times, note = results[0]["ms"], results[0]["times"], results[0]["note"]
    print(
        f"# sync_cost  {datetime.datetime.now():%Y-%m-%d %H:%M}  {platform.machine()}  {os.cpu_count()} CPUs  "
        f"torch {torch.__version__}  2 ranks (gloo, 127.0.0.1), tiny LM 1.82M params, 1 thread per rank, "
        f"{args.reps} rounds, load average {load[0]:.1f} before / {os.getloadavg()[0]:.1f} after"
    )
    rows = [
        ("local_sgd boundary, drift on", "local_sgd", "PeriodicModelAverager", "pma", "<= 1.0"),
        ("local_sgd boundary, drift off", "local_sgd_nodrift", "PeriodicModelAverager", "pma", "<= 1.0"),
        ("diloco sync step (H=1), drift on", "diloco", "torchft DiLoCo", "torchft_diloco", "<= 0.5"),
        ("diloco sync step (H=1), drift off", "diloco_nodrift", "torchft DiLoCo", "torchft_diloco", "<= 0.5"),
        ("streaming steps of a period (P=2, H=4)", "streaming", "torchft DiLoCo P=2", "torchft_streaming", "<= 0.5"),
        ("ddp training step", "ddp", "bare DistributedDataParallel", "bare_ddp", "<= 1.02"),
    ]
    print(f"| {'ours':40s} | ms | {'peer':28s} | ms | ratio | quartiles | target |")
    print("|---|---|---|---|---|---|---|")
    for label, ours, peer_label, peer, target in rows:
        if peer not in r:
            print(f"| {label:40s} | {r[ours]:.2f} | {peer_label:28s} | - | - | - | {target} |")
            continue
        mid, lo, hi = paired_ratio(times[ours], times[peer])
        print(
            f"| {label:40s} | {r[ours]:.2f} | {peer_label:28s} | {r[peer]:.2f} | {mid:.3f} | {lo:.3f}–{hi:.3f} | {target} |"
        )
    if note:
        print(note)
    print(f"reproduce: .venv/bin/python benchmarks/sync_cost.py --reps {args.reps}")


if __name__ == "__main__":
    main()
