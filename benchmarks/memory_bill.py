"""The memory bill of each strategy: the bytes it holds beyond the model and the inner optimizer,
measured, next to the formula of docs/performance.md.

One rank (a 1-process gloo group), AdamW inside, one real forward/backward per step on a 1 x 16
token batch (150m: plain SGD inside and 1 x 4 tokens, to keep it quick on a CPU; the bill excludes
the inner optimizer either way). The model, its gradients, AdamW's state and every other tensor alive before the
strategy exists are the baseline (kept alive, so no new tensor can reuse their memory); after each
step of one period (and the strategy's `finish()`), every live tensor storage outside the baseline,
the model's parameters and gradients and the optimizer's state is counted once (a storage they live
in counts for the bytes they do not occupy: the buffer a periodic strategy moves the model into
carries the drift's element after the values). The bill is the
largest count over the period: what the strategy holds between steps, anchors, outer momentum,
fragments in flight, θ(t_p) copies, codec buffers. DDP's gradient buckets live in C++ where no
Python tensor points to them; their size comes from DDP's own logging data (`bucket_sizes`).

    .venv/bin/python benchmarks/memory_bill.py [--models tiny,small,150m]
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import warnings
from typing import Any

import torch

from wansync.runner.localgroup import run_ranks
from wansync.strategies.periodic import DRIFT_SIDE_BAND

STRATEGIES: dict[str, dict[str, Any]] = {          # options that reach every state within STEPS steps
    "ddp": {},
    "local_sgd": {"sync_every": 2},
    "post_local_sgd": {"sync_every": 2, "switch_step": 1},
    "slowmo": {"sync_every": 2},
    "cpdp": {"sync_every": 2},
    "diloco": {"sync_every": 2},
    "streaming": {"sync_every": 4, "fragments": 2, "overlap": 1},
    "cocodc": {"sync_every": 4, "fragments": 2, "overlap": 1, "compensation": "taylor"},
}
STEPS = 6


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            st = t.untyped_storage()
            if st.nbytes():
                out[st.data_ptr()] = st.nbytes()
    return out


def _live_tensors() -> list[torch.Tensor]:
    with warnings.catch_warnings():              # isinstance() on torch's deprecated module objects warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def _owned(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[int, int]:
    """The bytes the model, its gradients and the optimizer's state occupy, per storage they live in."""
    ts = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
    ts += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    out: dict[int, int] = {}
    for t in {id(t): t for t in ts if isinstance(t, torch.Tensor) and t.device.type == "cpu"}.values():
        ptr = t.untyped_storage().data_ptr()
        out[ptr] = out.get(ptr, 0) + t.numel() * t.element_size()
    return out


def _held(base: dict[int, int], owned: dict[int, int]) -> int:
    """Bytes of live storages outside the baseline: whole, or, for a storage the model or the
    optimizer lives in, the part they do not occupy (a strategy's buffer the model moved into: the
    drift's element after the values)."""
    return sum(n - owned.get(ptr, 0) for ptr, n in _storages(_live_tensors()).items() if ptr not in base)


def _ddp_bucket_bytes(sync: Any) -> int:
    from wansync.telemetry.commtime import ddp_modules
    grad_sync = getattr(getattr(sync, "grad_sync", None), "ddp", None)    # post_local_sgd's, after the switch
    total = 0
    for ddp in {id(d): d for d in [*ddp_modules(sync), *([grad_sync] if grad_sync is not None else [])]}.values():
        sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
        total += sum(int(s) for s in str(sizes).split(",") if s.strip())
    return total


def formula(name: str, opts: dict[str, Any], p_bytes: int, frag_bytes: list[int], in_flight: list[int]) -> int:
    """docs/performance.md's bill for these options; `in_flight`: the fragments in flight at the
    measured step (a fragment in flight holds Δ and the exchange's copy, plus θ(t_p) for taylor)."""
    ddp = p_bytes                                            # DDP's gradient buckets hold one gradient copy
    per_fragment = 3 if opts.get("compensation") == "taylor" else 2
    band = 4 * DRIFT_SIDE_BAND                               # the drift's element after the model's values
    return {"ddp": ddp, "local_sgd": band, "post_local_sgd": ddp + band,
            "slowmo": 2 * p_bytes + band, "cpdp": 2 * p_bytes + ddp + band, "diloco": 2 * p_bytes + band,
            "streaming": 2 * p_bytes + sum(per_fragment * frag_bytes[f] for f in in_flight),
            "cocodc": 2 * p_bytes + sum(per_fragment * frag_bytes[f] for f in in_flight)}[name]


def bill_rank(rank: int, world: int, model_name: str) -> dict[str, Any]:
    import wansync as ws
    from wansync.strategies.base import sync_tensors
    from wansync.workloads.lm.model import TransformerLM, lm_shape
    out: dict[str, Any] = {}
    for name, opts in STRATEGIES.items():
        gc.collect()
        torch.manual_seed(0)
        model = TransformerLM(lm_shape(model_name), 256)
        big = model_name == "150m"
        opt = torch.optim.SGD(model.parameters(), lr=1e-4) if big else torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, 256, (1, 5 if big else 17))

        def step(fwd) -> None:
            logits = fwd(x[:, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1)).backward()

        step(model)
        opt.step()                                           # AdamW's state exists: part of the baseline
        gc.collect()
        baseline = _live_tensors()                           # kept alive: their memory cannot be reused
        base = _storages(baseline)
        sync = ws.strategy(name, model, opt, **opts)
        p_bytes = sum(t.numel() * t.element_size() for t in sync_tensors(model))
        frag_bytes = [a.flat.nbytes for a in getattr(sync, "anchors", [])]
        worst = (0, [])
        for t in range(STEPS + 1):
            if t < STEPS:
                step(sync.model)
                sync.step()
                sync.zero_grad()
            else:
                sync.finish()
            gc.collect()
            held = _held(base, _owned(model, opt))
            flying = [x.fragment for x in getattr(sync.timetable, "in_flight", [])] if t < STEPS else []
            if held > worst[0]:
                worst = (held, flying)
        buckets = _ddp_bucket_bytes(sync)
        out[name] = {"p_bytes": p_bytes, "held": worst[0] + buckets, "python_held": worst[0], "buckets": buckets,
                     "formula": formula(name, opts, p_bytes, frag_bytes, worst[1]), "in_flight": len(worst[1])}
        del sync, model, opt, baseline
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,small,150m")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    print(f"# memory_bill  {datetime.datetime.now():%Y-%m-%d %H:%M}  {platform.machine()}  {os.cpu_count()} CPUs  "
          f"torch {torch.__version__}; load average {load0:.1f} at the start")
    print("| model | P (param bytes) | strategy | held MB | of which DDP buckets MB | formula MB | held − formula (bytes) "
          "| held / P | fragments in flight | target |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for model in args.models.split(","):
        for name, r in run_ranks(bill_rank, 1, model, timeout=3600)[0].items():
            p = r["p_bytes"]
            target = "<= 2P + in flight" if name in ("streaming", "cocodc") else ("<= 2P" if name != "ddp" else "-")
            print(f"| {model} | {p / 1e6:.1f} MB | {name} | {r['held'] / 1e6:.2f} | {r['buckets'] / 1e6:.2f} | "
                  f"{r['formula'] / 1e6:.2f} | {r['held'] - r['formula']} | {r['held'] / p:.2f} | {r['in_flight']} | "
                  f"{target} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print(f"reproduce: .venv/bin/python benchmarks/memory_bill.py --models {args.models}")


if __name__ == "__main__":
    main()
