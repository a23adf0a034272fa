"""What a strategy adds on top of the work it wraps, measured side by side in one run.

1. `sync.step()` on a non-boundary step / a bare `optimizer.step()` (target <= 1.02).
2. a LocalSGD boundary / torch's `PeriodicModelAverager.average_parameters` on the same model
   and the same 2-rank gloo group (target <= 1.0), with and without drift telemetry.

Model: the tiny LM (1.8M parameters). Timings are interleaved (A, B, A, B, ...) and the
median per call is reported, so machine noise hits both sides alike.

    .venv/bin/python benchmarks/step_overhead.py [--reps 200]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch
import torch.distributed as dist

from wansync.runner.localgroup import run_ranks


def _tiny_lm() -> torch.nn.Module:
    from wansync.workloads.lm.model import TransformerLM, lm_shape

    torch.manual_seed(0)
    return TransformerLM(lm_shape("tiny"), 256)


def _fill_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_rank(rank: int, world: int, reps: int) -> dict[str, float]:
    import wansync as ws
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    # 1. non-boundary step vs bare optimizer.step()
    bare_model, sync_model = _tiny_lm(), _tiny_lm()
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-4)
    sync_opt = torch.optim.AdamW(sync_model.parameters(), lr=1e-4)
    sync = ws.strategy("local_sgd", sync_model, sync_opt, sync_every=10**9)
    _fill_grads(bare_model)
    _fill_grads(sync_model)
    for _ in range(5):
        bare_opt.step()
        sync.step()
    bare, wrapped = [], []
    for _ in range(reps):
        bare.append(_timed(bare_opt.step))
        wrapped.append(_timed(sync.step))

    # 2. boundary vs PeriodicModelAverager on the same model and group
    model = _tiny_lm()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    averager = PeriodicModelAverager(period=1, warmup_steps=0)
    lsgd = ws.strategy("local_sgd", model, opt, sync_every=1)
    lsgd_nodrift = ws.strategy("local_sgd", model, opt, sync_every=1, drift_telemetry=False)
    params = list(model.parameters())
    _fill_grads(model)  # the averager only averages parameters that have gradients
    for _ in range(3):
        averager.average_parameters(params)
        lsgd.boundary()
        lsgd_nodrift.boundary()
    pma, ours, ours_nodrift = [], [], []
    calls = [
        (pma, lambda: averager.average_parameters(params)),
        (ours, lsgd.boundary),
        (ours_nodrift, lsgd_nodrift.boundary),
    ]
    for i in range(max(30, reps // 4)):
        for j in range(3):  # rotate the order so no side always follows another
            times, fn = calls[(i + j) % 3]
            dist.barrier()
            times.append(_timed(fn))
    med = statistics.median
    return {
        "bare_step_ms": 1e3 * med(bare),
        "sync_step_ms": 1e3 * med(wrapped),
        "pma_ms": 1e3 * med(pma),
        "boundary_ms": 1e3 * med(ours),
        "boundary_nodrift_ms": 1e3 * med(ours_nodrift),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    results = run_ranks(bench_rank, 2, args.reps, timeout=900)
    r = results[0]
    print(
        f"# step_overhead  {datetime.date.today()}  {platform.machine()}  torch {torch.__version__}  "
        f"2 ranks (gloo, 127.0.0.1), tiny LM 1.82M params, 1 thread per rank"
    )
    print(
        f"non-boundary sync.step()     {r['sync_step_ms']:8.3f} ms   bare optimizer.step() {r['bare_step_ms']:8.3f} ms"
        f"   ratio {r['sync_step_ms'] / r['bare_step_ms']:.3f}  (target <= 1.02)"
    )
    print(
        f"LocalSGD boundary            {r['boundary_ms']:8.3f} ms   PeriodicModelAverager {r['pma_ms']:8.3f} ms"
        f"   ratio {r['boundary_ms'] / r['pma_ms']:.3f}  (with drift telemetry)"
    )
    print(
        f"LocalSGD boundary, no drift  {r['boundary_nodrift_ms']:8.3f} ms   PeriodicModelAverager {r['pma_ms']:8.3f} ms"
        f"   ratio {r['boundary_nodrift_ms'] / r['pma_ms']:.3f}  (target <= 1.0)"
    )
    print("reproduce: .venv/bin/python benchmarks/step_overhead.py")


if __name__ == "__main__":
    main()
