"""Every tensor a rank holds, by category, for workers of R = 1, 2, 4 ranks with DDP or FSDP inside,
measured, next to the planner's formula (`planner.memory`).

2 workers x R ranks on gloo (`run_ranks`), the LM built as the trainer builds it (FSDP2 over the
worker's ranks with `--inside fsdp`), AdamW inside, one real forward/backward per step on a 1 x 16
token batch, the strategy from the registry with options that reach every state within STEPS
steps. After each step's `sync.step()` (the gradients still held: `zero_grad` comes next) and
after `finish()`, `telemetry.memory.memory_per_rank` counts what the rank holds by category; the
bill is the step with the largest total. Two checks that nothing is missed:

- **unaccounted**: every live tensor storage of the process (found through the garbage
  collector) that is not in the baseline (what lived before the model was built) and not in the
  bill; DDP's buckets live in C++, where no Python object points to them, and come from DDP's
  logging data;
- **transient**: the peak resident memory during `sync.step()` (the inner step and the exchange)
  above what the rank holds before and after it (Linux's VmHWM, reset before each step through
  /proc/self/clear_refs; glibc's mmap threshold lowered to 64 KiB so that freed buffers leave
  the resident set): the buffers an exchange allocates and frees within the step.

The planner's bill is for the same model, options, workers, R and inside; "planner - measured" is
over the total held (the transient is compared on its own, being a resident-memory figure). Every
row is also written to benchmarks/memory_bill.json, which tests/test_memory.py holds the planner's
formula to (within 2 % in every row).

A lossy exchange's state (`--lossy`): local_sgd, diloco and streaming with the int8 codec, with and
without error feedback, on both of its collectives (`codec_collective` allgather and reduce_scatter),
and local_sgd and streaming with bf16 and fp4 (whose decode temporaries differ): cases named
`STRATEGY+CODEC[+ef]+{ag,rs}` (`--strategies` takes those names too). `--add` merges the
rows into the JSON (a row of the same model, R, inside, strategy and options replaced) instead of
writing it anew.

    .venv/bin/python benchmarks/memory_bill.py [--models tiny,small] [--ranks 1,2,4] [--strategies ...]
    .venv/bin/python benchmarks/memory_bill.py --models tiny --ranks 1,2 --lossy --add
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import re
import warnings
from typing import Any

import torch

from wansync.runner.localgroup import run_ranks
from wansync.telemetry.memory import CATEGORIES, memory_per_rank

STRATEGIES: dict[str, dict[str, Any]] = {  # options that reach every state within STEPS steps
    "ddp": {},
    "local_sgd": {"sync_every": 2},
    "post_local_sgd": {"sync_every": 2, "switch_step": 1},
    "slowmo": {"sync_every": 2},
    "cpdp": {"sync_every": 2},
    "diloco": {"sync_every": 2},
    "streaming": {"sync_every": 4, "fragments": 2, "overlap": 1},
    "cocodc": {
        "sync_every": 4,
        "fragments": 2,
        "overlap": 1,
        "compensation": "taylor",
        "syncs_per_period": 2,
        "schedule": "round_robin",
    },
}
PATHS = {"allgather": "ag", "reduce_scatter": "rs"}
LOSSY = {
    f"{name}+int8{'+ef' * ef}+{short}": (
        name,
        {**STRATEGIES[name], "codec": "int8", "error_feedback": ef, "codec_collective": path},
    )
    for name in ("local_sgd", "diloco", "streaming")
    for ef in (False, True)
    for path, short in PATHS.items()
}
LOSSY.update(
    {
        f"{name}+{codec}+{short}": (name, {**STRATEGIES[name], "codec": codec, "codec_collective": path})
        for codec in ("bf16", "fp4")
        for name in ("local_sgd", "streaming")
        for path, short in PATHS.items()
    }
)
CASES: dict[str, tuple[str, dict[str, Any]]] = {**{n: (n, o) for n, o in STRATEGIES.items()}, **LOSSY}
STEPS = 8  # two periods of streaming and cocodc: every fragment merged twice
WARM = 6  # the transient: steps WARM + 1 .. STEPS (every fragment merged once before)
WORKERS = 2
SHRINKS = ("parameters", "gradients", "inner_optimizer", "outer_state")  # what sharding divides by R
M_MMAP_THRESHOLD = -3


def _resident() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    text = open("/proc/self/status").read()
    return tuple(int(re.search(k + r":\s+(\d+)", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM"))


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _resident()[0]


def _live_storages() -> dict[int, int]:
    with warnings.catch_warnings():  # isinstance() on torch's deprecated module objects warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    out = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        if t.device.type == "cpu" and not t.is_meta:
            st = t.untyped_storage()
            if st.nbytes():
                out[st.data_ptr()] = st.nbytes()
    return out


def bill_rank(rank: int, world: int, model_name: str, r: int, inside: str, names: list[str]) -> dict[str, Any]:
    from wansync import strategies
    from wansync.comm.replicas import replica_groups
    from wansync.trainer.sharding import shard_worker
    from wansync.workloads.lm.model import TransformerLM, lm_shape

    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 16)
    replicas = replica_groups(r, shard_inside=inside == "fsdp")
    gc.collect()
    gc.freeze()  # what lives now (torch, the groups) is left out of every collection and scan: faster
    out: dict[str, Any] = {}
    for name in names:
        gc.collect()
        x = torch.randint(0, 256, (1, 17))
        baseline = _live_storages()
        keep = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]  # their memory cannot be reused
        torch.manual_seed(0)
        model = TransformerLM(lm_shape(model_name), 256)
        if inside == "fsdp":
            shard_worker(
                model, replicas.mesh, "fp32", hybrid=not strategies.strategy_class(CASES[name][0]).steps_inside_workers
            )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        mark: list[int] = []  # resident bytes after the inner step: the exchange's transient starts there
        opt.register_step_post_hook(lambda *_: mark.append(_reset_peak()))
        strategy, options = CASES[name]
        sync = strategies.build(
            strategy, model, opt, replicas=replicas, **strategies.resolve_options(strategy, options)
        )
        worst: dict[str, int] = {"total": -1}
        transient = unaccounted = 0
        for t in range(STEPS + 1):
            if t < STEPS:
                logits = sync.model(x[:, :-1])
                torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1)).backward()
                del logits
                gc.collect()
            mark[:] = [_reset_peak()]
            if t < STEPS:
                sync.step()
            else:
                sync.finish()
            gc.collect()
            after, peak = _resident()
            if WARM <= t < STEPS:  # steady state: first allocations behind
                transient = max(transient, peak - max(mark[-1], after))
            bill = memory_per_rank(model, opt, sync)
            live = sum(n for ptr, n in _live_storages().items() if ptr not in baseline)
            unaccounted = max(unaccounted, live - (bill["total"] - bill["ddp_buckets"]))
            if bill["total"] > worst["total"]:
                worst = bill
            if t < STEPS:
                sync.zero_grad()
        out[name] = {
            **worst,
            "transient": transient,
            "unaccounted": unaccounted,
            "p_bytes": 4 * sum(p.numel() for p in model.parameters()),
        }
        if inside == "fsdp":  # the whole model's parameter bytes, not this rank's shard
            out[name]["p_bytes"] = 4 * sum(p.full_tensor().numel() for p in model.parameters())
        del sync, model, opt, keep
    return out


def planned(model: str, name: str, r: int, inside: str) -> dict[str, int]:
    from wansync.net.wan import PRESETS
    from wansync.planner import of_name, predict, setting

    strategy, options = CASES[name]
    s = setting(strategy, options, of_name(model), WORKERS, PRESETS["lan"], 0.1, ranks_per_worker=r, inside=inside)
    return predict(s).memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--lossy", action="store_true", help="the lossy cases (LOSSY) instead of --strategies")
    ap.add_argument("--add", action="store_true", help="merge the rows into --json instead of replacing it")
    ap.add_argument(
        "--json",
        default=os.path.join(os.path.dirname(__file__), "memory_bill.json"),
        help="where the rows go (for tests/test_memory.py)",
    )
    args = ap.parse_args()
    rows = []
    names = list(LOSSY) if args.lossy else args.strategies.split(",")
    load0 = os.getloadavg()[0]
    print(
        f"# memory_bill  {datetime.datetime.now():%Y-%m-%d %H:%M}  {platform.machine()}  {os.cpu_count()} CPUs  "
        f"torch {torch.__version__}; load average {load0:.1f} at the start"
    )
    heads = [
        "model",
        "R",
        "inside",
        "strategy",
        *CATEGORIES,
        "total MB",
        "planner MB",
        "planner − measured",
        "shrinking four / R=1's",
        "transient MB (planner)",
        "unaccounted B",
    ]
    print("| " + " | ".join(heads) + " |\n|" + "---|" * len(heads), flush=True)
    for model in args.models.split(","):
        base: dict[str, int] = {}
        for r in map(int, args.ranks.split(",")):
            for inside in ("ddp", "fsdp") if r > 1 else ("ddp",):
                ranks = run_ranks(bill_rank, WORKERS * r, model, r, inside, names, timeout=3600)
                for name, m in ranks[0].items():
                    p = planned(model, name, r, inside)
                    four = sum(m[c] for c in SHRINKS)
                    base.setdefault(name, four)
                    rows.append(
                        {
                            "model": model,
                            "ranks_per_worker": r,
                            "inside": inside,
                            "strategy": CASES[name][0],
                            "workers": WORKERS,
                            "options": CASES[name][1],
                            "measured": {k: m[k] for k in (*CATEGORIES, "total", "transient", "unaccounted")},
                        }
                    )
                    cells = [f"{m[c] / 1e6:.3f}" for c in CATEGORIES]
                    print(
                        f"| {model} | {r} | {inside} | {name} | "
                        + " | ".join(cells)
                        + f" | {m['total'] / 1e6:.3f} | {p['total'] / 1e6:.3f} | "
                        f"{100 * (p['total'] - m['total']) / m['total']:+.2f} % | "
                        f"{four / base[name]:.3f} (1/R = {1 / r:.3f}) | {m['transient'] / 1e6:.2f} "
                        f"({p['transient'] / 1e6:.2f}) | {m['unaccounted']} |",
                        flush=True,
                    )
    command = (
        f".venv/bin/python benchmarks/memory_bill.py --models {args.models} --ranks {args.ranks}"
        + (
            " --lossy"
            if args.lossy
            else ""
            if args.strategies == ap.get_default("strategies")
            else f" --strategies {args.strategies}"
        )
        + (" --add" if args.add else "")
    )
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print(f"reproduce: {command}")
    record = {
        "date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
        "machine": platform.machine(),
        "torch": torch.__version__,
        "command": command,
    }
    if args.add and os.path.exists(args.json):
        with open(args.json) as f:
            old = json.load(f)
        same = {_key(row) for row in rows}
        rows = [row for row in old["rows"] if _key(row) not in same] + rows
        record = {**{k: old[k] for k in record}, "added": [*old.get("added", []), record]}
    with open(args.json, "w") as f:
        json.dump({**record, "rows": rows}, f, indent=1)
        f.write("\n")


def _key(row: dict[str, Any]) -> str:
    return json.dumps([row[k] for k in ("model", "ranks_per_worker", "inside", "strategy", "options")], sort_keys=True)


if __name__ == "__main__":
    main()
