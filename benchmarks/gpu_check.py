"""`make gpu-check`: what a GPU machine does with wansync, in under 5 minutes, in one JSON and one table.

CI and the development machines have no GPU, so the CUDA paths (NCCL, bf16, FSDP2 inside a worker, the
codecs' and sparse kernels on device, the planner's throughput and memory assumptions) are only ever
exercised by hand. This script is that hand: five parts, each timed and guarded (a part or row that fails is
recorded with its one-line reason and the others still run), all of it against one wall-clock budget:

1. `strategies`: every registered strategy, `wansync train --backend nccl` on `min(2, GPUs)` workers, the
   `tiny` LM for a few steps (one GPU: one worker, NCCL at world size 1, as tests/test_nccl.py runs it);
2. `precision_fsdp`: `--precision bf16`, and FSDP2 inside a worker (`--inside fsdp`; 2 ranks per worker
   with 2 workers where there are 4 GPUs, else as many as there are);
3. `kernels`: the codecs (bf16, int8, fp4 encode and decode) and the sparse exchange's kernels (chunked
   top-k, the DCT, bit packing, the statistical quantizer) on CUDA tensors: GB/s of input;
4. `throughput`: forward + backward + AdamW of a ~1B-parameter LLaMA-style LM (`TransformerLM`) under bf16
   autocast, and the FLOP/s that implies by the planner's rule 6·N·tokens/time, beside the planner's
   assumption `FLOPS_PER_ACCELERATOR["bf16"]`;
5. `memory`: what a strategy holds on the CUDA allocator (`torch.cuda.memory_allocated` after `sync.step()`,
   and the peak), beside the planner's memory bill (`planner.memory`), as benchmarks/memory_bill.py does on CPU.

Without CUDA it prints one line and exits 0, writing nothing.

    .venv/bin/python benchmarks/gpu_check.py [--out runs/gpu-check] [--budget 290]
    .venv/bin/python benchmarks/gpu_check.py --render runs/gpu-check/gpu_check.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

STRATEGY_FLAGS: dict[str, list[str]] = {  # options that reach each strategy's exchange within STEPS steps
    "ddp": [],
    "demo": [],
    "local_sgd": ["--sync-every", "4"],
    "post_local_sgd": ["--sync-every", "4", "--switch-step", "4"],
    "slowmo": ["--sync-every", "4"],
    "cpdp": ["--sync-every", "4"],
    "diloco": ["--sync-every", "4"],
    "sparseloco": ["--sync-every", "4"],
    "streaming": ["--sync-every", "4", "--fragments", "2", "--overlap", "1"],
    "cocodc": ["--sync-every", "4", "--fragments", "2", "--overlap", "1"],
}
STEPS = 10
TRAIN_FLAGS = ["--model", "tiny", "--batch-size", "8", "--seq-len", "64", "--eval-batches", "2", "--quiet"]
RUN_TIMEOUT_S = 90  # one CLI run: a hung NCCL group must not eat the whole budget
KERNEL_VALUES = 64 * 2**20  # 64M float32 values: 256 MB of input
KERNEL_REPEATS = 5
# ~1.0B parameters with a 32,000-token vocabulary and the tied head (LMShape.param_count): LLaMA-1B-like.
BIG_SHAPE = dict(dim=2048, n_layers=18, n_heads=16, ffn_hidden=5632, max_seq_len=2048)
BIG_VOCAB, BIG_SEQ, BIG_BATCH = 32000, 2048, 8
MEMORY_CASES = {"ddp": {}, "diloco": {"sync_every": 2}, "streaming": {"sync_every": 4, "fragments": 2, "overlap": 1}}
MEMORY_MODEL = "small"
DEFAULT_OUT = "runs/gpu-check"


class Budget:
    """The wall clock left: each row checks it before starting, so the whole check ends in about `seconds`."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def check(self, need: float = 5.0) -> None:
        if self.left() < need:
            raise TimeoutError("skipped: the check's time budget is spent")


def one_line(e: BaseException) -> str:
    """An exception as one line (a CLI's last stderr line is already in its message)."""
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " | ")
    return text[:300]


def guarded(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """Run one part: its figures, status and seconds; a failure becomes a status with its reason."""
    t0 = time.monotonic()
    try:
        part = fn(*args)
        rows = part.get("rows", [])
        bad = [r for r in rows if r.get("status") != "ok"]
        part.setdefault("status", "failed" if bad else "ok")
        if bad:
            part.setdefault("reason", f"{len(bad)} of {len(rows)} failed: " + ", ".join(str(r["name"]) for r in bad))
    except Exception as e:  # noqa: BLE001 - the point is to keep going and record why
        part = {"status": "failed", "reason": one_line(e), "rows": []}
    part["seconds"] = round(time.monotonic() - t0, 2)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return part


def row(name: str, fn: Callable[[], dict[str, Any]], budget: Budget) -> dict[str, Any]:
    """One row of a part, guarded and timed like a part."""
    t0 = time.monotonic()
    try:
        budget.check()
        out = {"name": name, "status": "ok", **fn()}
    except Exception as e:  # noqa: BLE001
        out = {"name": name, "status": "failed", "reason": one_line(e)}
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


# -- parts 1 and 2: the CLI on NCCL -------------------------------------------------------------------


def run_group(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`cmd` in a session of its own, so that a run past `timeout` is ended with its worker processes (a
    hung NCCL worker would otherwise keep its GPU for the parts after it)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise TimeoutError(f"no result within {timeout:.0f} s (its processes killed)") from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def train(flags: list[str], budget: Budget) -> dict[str, Any]:
    """One `wansync train --backend nccl` in a fresh process (as a user runs it); its summary's figures."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as d:
        cmd = [
            sys.executable,
            "-m",
            "wansync",
            "train",
            "--backend",
            "nccl",
            "--steps",
            str(STEPS),
            *TRAIN_FLAGS,
            *flags,
            "--out",
            os.path.join(d, "run"),
        ]
        timeout = max(5.0, min(RUN_TIMEOUT_S, budget.left()))
        r = run_group(cmd, timeout)
        if r.returncode:
            tail = (r.stderr.strip() or r.stdout.strip() or f"exit {r.returncode}").splitlines()[-1]
            raise RuntimeError(f"exit {r.returncode}: {tail}")
        summary = json.loads(Path(d, "run", "summary.json").read_text())
    loss = summary.get("final_val_loss")
    if loss is None or not loss == loss or loss > 6:
        raise RuntimeError(f"trained but did not learn: final_val_loss {loss}")
    return {"final_val_loss": round(float(loss), 4), "workers": summary.get("workers")}


def part_strategies(gpus: int, budget: Budget) -> dict[str, Any]:
    """Every registered strategy a few steps on NCCL: 2 workers where there are 2 GPUs, else 1."""
    from wansync.strategies import STRATEGIES

    workers = str(min(2, gpus))
    rows = [
        row(
            name,
            lambda n=name: train(["--strategy", n, "--workers", workers, *STRATEGY_FLAGS.get(n, [])], budget),
            budget,
        )
        for name in STRATEGIES
    ]
    return {"workers": int(workers), "steps": STEPS, "rows": rows}


def part_precision_fsdp(gpus: int, budget: Budget) -> dict[str, Any]:
    """bf16, and FSDP2 inside a worker (fp32 and bf16): the layouts test_nccl.py runs, sized to the GPUs."""
    workers = 2 if gpus >= 2 else 1
    per_worker = max(1, gpus // 2) if gpus >= 4 else (2 if gpus >= 2 else 1)
    fsdp_workers = 2 if gpus >= 4 else 1
    base = ["--strategy", "diloco", "--sync-every", "4"]
    cases = {
        f"diloco bf16, {workers} worker(s)": [*base, "--workers", str(workers), "--precision", "bf16"],
        f"diloco fsdp fp32, {fsdp_workers}x{per_worker}": [
            *base,
            "--workers",
            str(fsdp_workers),
            "--inside",
            "fsdp",
            "--ranks-per-worker",
            str(per_worker),
            "--precision",
            "fp32",
            "--outer-state-device",
            "cpu",
        ],
        f"diloco fsdp bf16, {fsdp_workers}x{per_worker}": [
            *base,
            "--workers",
            str(fsdp_workers),
            "--inside",
            "fsdp",
            "--ranks-per-worker",
            str(per_worker),
            "--precision",
            "bf16",
            "--outer-state-device",
            "cpu",
        ],
    }
    return {"rows": [row(name, lambda f=flags: train(f, budget), budget) for name, flags in cases.items()]}


# -- part 3: the kernels on CUDA tensors -------------------------------------------------------------


def timed_gbps(fn: Callable[[], Any], input_bytes: int) -> dict[str, Any]:
    """GB/s of input of `fn` on the GPU: one warm-up call, then the median of KERNEL_REPEATS, synchronized."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(KERNEL_REPEATS):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t = sorted(times)[len(times) // 2]
    return {"ms": round(1e3 * t, 3), "GB/s": round(input_bytes / t / 1e9, 2)}


def kernel_cases(x: torch.Tensor) -> dict[str, tuple[Callable[[], Any], int]]:
    """Each kernel as the strategies call it, on 64M values, and the bytes of its input."""
    from wansync.comm import bitpack, codecs, quantize
    from wansync.comm.dct import BlockDCT
    from wansync.comm.topk import chunk_topk, kept_per_chunk

    n = x.numel()
    cases: dict[str, tuple[Callable[[], Any], int]] = {}
    for name in ("bf16", "int8", "fp4"):
        codec = codecs.get_codec(name)
        enc = codec.encode(x)
        cases[f"codec {name} encode"] = (lambda c=codec: c.encode(x), 4 * n)
        cases[f"codec {name} decode"] = (lambda c=codec, e=enc: c.decode(e), enc.nbytes)
    chunk = 4096  # SparseLoCo's 64 x 64 blocks, 32 of 4096 kept
    chunks = x.view(-1, chunk)
    k = kept_per_chunk(chunk, 32 / 4096)
    cases[f"top-k {k} of {chunk} per chunk"] = (lambda: chunk_topk(chunks, k), 4 * n)
    dct = BlockDCT(64, 64, device=x.device)
    cases["DCT forward, 64x64 blocks"] = (lambda: dct.forward(chunks), 4 * n)
    cases["DCT inverse, 64x64 blocks"] = (lambda: dct.inverse(chunks), 4 * n)
    m = n // 8  # packing and quantizing see only the kept values
    codes = torch.randint(0, 4, (m,), device=x.device, dtype=torch.uint8)
    packed = bitpack.pack(codes, 2)
    cases["bitpack pack 2-bit"] = (lambda: bitpack.pack(codes, 2), m)
    cases["bitpack unpack 2-bit"] = (lambda: bitpack.unpack(packed, m, 2), packed.numel())
    idx = torch.randint(0, 6, (m,), device=x.device, dtype=torch.uint8)
    cases["bitpack pack 6-bit (indices)"] = (lambda: bitpack.pack(idx, 6), m)
    vals, segments = x[:m], 1024
    seg = torch.arange(m, device=x.device) // (m // segments)
    cases["quantize 2-bit, 1024 segments"] = (lambda: quantize.quantize(vals, seg, segments, 2), 4 * m)
    return cases


def part_kernels(budget: Budget) -> dict[str, Any]:
    """GB/s of input of the codecs and the sparse exchange's kernels on one GPU."""
    torch.manual_seed(0)
    x = torch.randn(KERNEL_VALUES, device="cuda")
    cases = kernel_cases(x)
    rows = [row(name, lambda c=case: timed_gbps(*c), budget) for name, case in cases.items()]
    return {"values": KERNEL_VALUES, "rows": rows}


# -- part 4: a ~1B model's step and the FLOP/s it implies ---------------------------------------------


def big_model() -> tuple[torch.nn.Module, int]:
    """The ~1B LLaMA-style LM on the GPU (fp32 master weights) and its parameter count."""
    from wansync.workloads.lm.model import LMShape, TransformerLM

    shape = LMShape(**BIG_SHAPE)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = TransformerLM(shape, BIG_VOCAB)
    return model, shape.param_count(BIG_VOCAB)


def step_time(model: torch.nn.Module, batch: int, steps: int = 4) -> float:
    """Median seconds of forward + backward + AdamW under bf16 autocast, after two warm-up steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, BIG_VOCAB, (batch, BIG_SEQ + 1), device="cuda")
    times = []
    for i in range(steps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, BIG_VOCAB).float(), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del logits, loss
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    del opt
    return sorted(times)[len(times) // 2]


def part_throughput(budget: Budget) -> dict[str, Any]:
    """Effective FLOP/s of a ~1B model's bf16 step by 6·N·tokens/time, beside the planner's assumption;
    the batch halves until it fits."""
    from wansync.planner.sizes import FLOPS_PER_ACCELERATOR

    budget.check(30)
    torch.cuda.reset_peak_memory_stats()
    model, n = big_model()
    batch, last = BIG_BATCH, None
    while batch >= 1:
        try:
            t = step_time(model, batch)
            break
        except torch.cuda.OutOfMemoryError as e:
            last, batch = one_line(e), batch // 2  # the line only: the traceback would pin the step's tensors
        torch.cuda.empty_cache()
    else:
        raise RuntimeError(f"out of memory at batch 1: {last}")
    tokens = batch * BIG_SEQ
    effective = 6 * n * tokens / t
    planned = FLOPS_PER_ACCELERATOR["bf16"]
    peak = torch.cuda.max_memory_allocated()
    del model
    torch.cuda.empty_cache()
    return {
        "rows": [
            {
                "name": "~1B LM, bf16 autocast, AdamW",
                "status": "ok",
                "params": n,
                "batch": batch,
                "seq_len": BIG_SEQ,
                "tokens": tokens,
                "step_s": round(t, 4),
                "effective_TFLOP/s": round(effective / 1e12, 1),
                "planner_TFLOP/s": round(planned / 1e12, 1),
                "measured/planner": round(effective / planned, 3),
                "peak_GB": round(peak / 1e9, 2),
            }
        ]
    }


# -- part 5: the CUDA allocator against the planner's memory bill ------------------------------------


def planned_memory(strategy: str, options: dict[str, Any], workers: int) -> dict[str, int]:
    """The planner's bill for the same model, strategy and options (memory_bill.py's `planned`)."""
    from wansync.net.wan import PRESETS
    from wansync.planner import of_name, predict, setting

    s = setting(
        strategy, options, of_name(MEMORY_MODEL), workers, PRESETS["lan"], 0.1, ranks_per_worker=1, inside="ddp"
    )
    return predict(s).memory


def measure_memory(strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """Bytes the CUDA allocator holds after `sync.step()` (gradients still held: the planner's held bill) at
    its largest over 4 steps, and the peak (activations included, which the planner does not bill)."""
    import torch.distributed as dist
    import wansync as ws
    from wansync.workloads.lm.model import TransformerLM, lm_shape

    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = TransformerLM(lm_shape(MEMORY_MODEL), 256).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with warnings.catch_warnings():  # RegimeWarning: short rounds are chosen to reach every state, not to train
        warnings.simplefilter("ignore")
        sync = ws.strategy(strategy, model, opt, **options)
    x = torch.randint(0, 256, (4, 129), device="cuda")
    held = 0
    for _ in range(4):
        logits = sync.model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1)).backward()
        del logits
        sync.step()
        torch.cuda.synchronize()
        held = max(held, torch.cuda.memory_allocated() - base)
        sync.zero_grad()
    sync.finish()
    peak = torch.cuda.max_memory_allocated() - base
    plan = planned_memory(strategy, options, dist.get_world_size())
    del sync, model, opt
    return {
        "measured_MB": round(held / 1e6, 2),
        "planner_MB": round(plan["total"] / 1e6, 2),
        "planner-measured_%": round(100 * (plan["total"] - held) / held, 2) if held else None,
        "peak_MB": round(peak / 1e6, 2),
    }


def part_memory(budget: Budget) -> dict[str, Any]:
    """`MEMORY_CASES` on the `small` LM in this process, one rank on NCCL (`ws.init`'s one-process group)."""
    import wansync as ws

    torch.cuda.set_device(0)
    ws.init(backend="nccl")
    rows = [row(name, lambda n=name, o=opts: measure_memory(n, o), budget) for name, opts in MEMORY_CASES.items()]
    return {"model": MEMORY_MODEL, "rows": rows}


# -- the whole check, its JSON and its table -----------------------------------------------------------


def no_cuda_line() -> str:
    return (
        f"gpu-check: no CUDA device here (torch {torch.__version__}, "
        f"{'built without CUDA' if torch.version.cuda is None else 'no driver or no visible GPU'}); "
        "nothing to check"
    )


def machine() -> dict[str, Any]:
    """What ran the check: the GPU, how many, torch and its CUDA and NCCL."""
    props = torch.cuda.get_device_properties(0)
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return {
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "memory_GB": round(props.total_memory / 1e9, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def run_check(budget_s: float) -> dict[str, Any]:
    """The five parts: the in-process kernels and ~1B step first (the figures the CLI runs cannot give, so a
    slow CLI run cannot starve them), then the CLI runs, and the memory part last, as it leaves this process in
    an NCCL group of its own; `empty_cache` after each part hands the GPU back to the CLI's workers."""
    gpus = torch.cuda.device_count()
    budget = Budget(budget_s)
    t0 = time.monotonic()
    parts: dict[str, Any] = {}
    parts["kernels"] = guarded(part_kernels, budget)
    parts["throughput"] = guarded(part_throughput, budget)
    parts["strategies"] = guarded(part_strategies, gpus, budget)
    parts["precision_fsdp"] = guarded(part_precision_fsdp, gpus, budget)
    parts["memory"] = guarded(part_memory, budget)
    return {**machine(), "budget_s": budget_s, "seconds": round(time.monotonic() - t0, 1), "parts": parts}


def _cell(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v).replace("|", "\\|")


def render(result: dict[str, Any]) -> str:
    """The markdown table of a recorded check: the machine, one line per part, then each part's rows."""
    lines = [
        f"# gpu-check: {result.get('device', '?')} x{result.get('gpus', '?')}",
        "",
        f"torch {result.get('torch')}, CUDA {result.get('cuda')}, NCCL {result.get('nccl')}, "
        f"{result.get('date', '')}, {result.get('seconds', '?')} s",
        "",
        "| part | status | seconds | reason |",
        "|---|---|---|---|",
    ]
    parts = result.get("parts", {})
    for name, part in parts.items():
        lines.append(f"| {name} | {part.get('status')} | {_cell(part.get('seconds'))} | {_cell(part.get('reason'))} |")
    for name, part in parts.items():
        rows = part.get("rows") or []
        if not rows:
            continue
        keys = [k for k in ("name", "status") if any(k in r for r in rows)]
        keys += [k for r in rows for k in r if k not in keys and k not in ("seconds", "reason")]
        keys = list(dict.fromkeys(keys)) + ["seconds", "reason"]
        lines += ["", f"## {name}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def recorded(path: str) -> dict[str, Any]:
    """A recorded check (gpu_check.json) to render; one line when `path` is missing, not a regular
    file, not UTF-8 JSON or not a check's record."""
    from wansync.errors import user_text

    text = user_text(path, "--render file")
    try:
        result = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--render file {path} is not JSON ({e})") from None
    if not isinstance(result, dict) or not isinstance(result.get("parts"), dict):
        raise ValueError(f"--render file {path} is not a gpu-check record (no parts): give a gpu_check.json")
    return result


def write(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "gpu_check.md").write_text(render(result))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="directory for gpu_check.json and gpu_check.md")
    ap.add_argument("--budget", type=float, default=290.0, help="wall-clock seconds for the whole check")
    ap.add_argument("--render", metavar="FILE.json", help="print the table of a recorded check, run nothing")
    args = ap.parse_args(argv)
    if args.render:
        from wansync.errors import WansyncError

        try:
            print(render(recorded(args.render)), end="")
        except (ValueError, WansyncError) as e:
            print(f"gpu_check: error: {e}", file=sys.stderr)
            return 1
        return 0
    if not torch.cuda.is_available():
        print(no_cuda_line())
        return 0
    result = run_check(args.budget)
    out = Path(args.out)
    write(result, out)
    print(render(result), end="")
    print(f"gpu-check: wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
