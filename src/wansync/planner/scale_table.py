"""`wansync plan --table`: the large-scale table, 150M-70B parameters x 8/64/512 workers x the link
presets x ddp/diloco/streaming/cocodc at their defaults, and the sentences computed from its rows."""

from __future__ import annotations

import dataclasses
import itertools
import sys
from typing import Iterator, Sequence

from ..net.link import NVLINK
from ..net.wan import PRESETS
from ..units import human_bytes, human_seconds
from .choose import TARGET_PCT
from .memory import DEFAULT_GPU_MEMORY, memory_bill
from .prediction import predict, recommend_h, setting
from .sizes import ACCELERATORS_PER_WORKER, FLOPS_PER_ACCELERATOR, TOKENS_PER_WORKER_STEP, flops_step_s, of_params

TABLE_SIZES = (150e6, 1e9, 7e9, 70e9)
TABLE_WORKERS = (8, 64, 512)
TABLE_STRATEGIES = ("ddp", "diloco", "streaming", "cocodc")
TABLE_PRECISION = "bf16"  # what people train these sizes in
TABLE_GPU_MEMORY = DEFAULT_GPU_MEMORY  # the table's capacity check: an 80 GB accelerator


@dataclasses.dataclass(frozen=True)
class TableRow:
    """One row of the large table, as numbers (`table_summary` reads these, not the printed text)."""

    size: str
    workers: int
    link: str
    strategy: str
    step_s: float
    wall_s: float
    exposed_pct: float
    bytes_per_step: float  # the prediction's (bytes, not always whole)
    mem_ddp: int
    mem_fsdp: int
    fits: tuple[str, ...]
    smallest_h: int | None  # None: ddp (no H), or none up to 5000


def large_table(target_pct: float = TARGET_PCT) -> str:
    """150M-70B parameters x 8/64/512 workers x the four presets (a worker's 8 ranks on NVLink: one
    node) x ddp/diloco/streaming/cocodc, every strategy at its defaults, step time from the FLOPs
    rule (sizes.py) in bf16; memory per GPU with DDP and with FSDP inside, and which fits on an 80 GB
    accelerator; then the sentences `table_summary` computes from the rows."""
    rows = table_rows(target_pct)
    return render_table(rows, target_pct) + "\n\n" + "\n".join(table_summary(rows, target_pct))


def print_large_table(target_pct: float = TARGET_PCT) -> None:
    """`large_table`, printed as it is computed (minutes on a laptop): the head at once, each row as it
    is predicted, then the summary; how many rows come is said first."""
    count = len(TABLE_SIZES) * len(TABLE_WORKERS) * len(PRESETS) * len(TABLE_STRATEGIES)
    print(f"plan --table: {count} settings, each row printed as it is predicted", file=sys.stderr, flush=True)
    print(table_head(target_pct), flush=True)
    rows = []
    for row in iter_table_rows(target_pct):
        rows.append(row)
        print(row_line(row), flush=True)
    print("\n" + "\n".join(table_summary(rows, target_pct)), flush=True)


def table_rows(target_pct: float = TARGET_PCT) -> list[TableRow]:
    return list(iter_table_rows(target_pct))


def iter_table_rows(target_pct: float = TARGET_PCT) -> Iterator[TableRow]:
    for n, m, link, name in itertools.product(TABLE_SIZES, TABLE_WORKERS, PRESETS, TABLE_STRATEGIES):
        size = of_params(n)
        step = flops_step_s(n, flops=FLOPS_PER_ACCELERATOR[TABLE_PRECISION])
        topology = dataclasses.replace(PRESETS[link], worker_link=NVLINK)
        s = setting(name, {}, size, m, topology, step, ranks_per_worker=ACCELERATORS_PER_WORKER)
        p = predict(s)
        sharded = memory_bill(dataclasses.replace(s, inside="fsdp"), p.timeline.held_in_flight)["per_gpu"]
        fits = tuple(way for way, need in (("ddp", p.memory["per_gpu"]), ("fsdp", sharded)) if need <= TABLE_GPU_MEMORY)
        yield (
            TableRow(
                size.name,
                m,
                link,
                name,
                step,
                p.wall_per_1000_s,
                p.exposed_pct,
                p.bytes_per_step,
                p.memory["per_gpu"],
                sharded,
                fits,
                recommend_h(s, target_pct) if name != "ddp" else None,
            )
        )


def render_table(rows: list[TableRow], target_pct: float = TARGET_PCT) -> str:
    return "\n".join([table_head(target_pct), *(row_line(r) for r in rows)])


def table_head(target_pct: float = TARGET_PCT) -> str:
    gb = f"{TABLE_GPU_MEMORY / 1e9:g} GB"
    head = (
        "| params | workers | link | strategy | step (s) | wall / 1000 steps | exposed % | bytes/worker/step "
        f"| mem/GPU DDP inside | mem/GPU FSDP inside | fits on {gb} | smallest H for <= {target_pct:g}% |"
    )
    return head + "\n|" + "---|" * 12


def row_line(r: TableRow) -> str:
    h = "-" if r.strategy == "ddp" else (r.smallest_h or "> 5000")
    return (
        f"| {r.size} | {r.workers} | {r.link} | {r.strategy} | {r.step_s:.3g} | {human_seconds(r.wall_s)} "
        f"| {r.exposed_pct:.1f} | {human_bytes(r.bytes_per_step)} | {human_bytes(r.mem_ddp)} "
        f"| {human_bytes(r.mem_fsdp)} | {', '.join(r.fits) or 'no'} | {h} |"
    )


def _span(values: Sequence[float], fmt: str = "{:.1f}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


def _bytes_span(values: Sequence[float]) -> str:
    lo, hi = human_bytes(min(values)), human_bytes(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def table_summary(rows: list[TableRow], target_pct: float = TARGET_PCT) -> list[str]:
    """The "Read:" sentences under the table, computed from its rows (never written by hand)."""
    gb = f"{TABLE_GPU_MEMORY / 1e9:g} GB"
    out = ["Read (computed from the rows above):"]
    for name in dict.fromkeys(r.strategy for r in rows):
        mine = [r for r in rows if r.strategy == name]
        lan, wide = [r for r in mine if r.link == "lan"], [r for r in mine if r.link != "lan"]
        parts = [
            f"{_span([r.exposed_pct for r in wide])} % across sites" if wide else "",
            f"{_span([r.exposed_pct for r in lan])} % on lan" if lan else "",
        ]
        line = f"- {name}: exposed " + ", ".join(p for p in parts if p)
        worst = max(mine, key=lambda r: r.exposed_pct)
        line += f" (most: {worst.size}, {worst.workers} workers, {worst.link})"
        if name != "ddp":
            hs = [r.smallest_h for r in mine]
            found = [h for h in hs if h is not None]
            line += (
                f"; smallest H for <= {target_pct:g} %: {_span(found, '{:d}')}"
                if found
                else f"; no H up to 5000 keeps it under {target_pct:g} %"
            )
            if None in hs:
                line += f" (none up to 5000 in {hs.count(None)} of {len(hs)} rows)"
        line += f"; {_bytes_span([r.bytes_per_step for r in mine])} per worker per step."
        out.append(line)
    for size in dict.fromkeys(r.size for r in rows):
        mine = [r for r in rows if r.size == size]
        ways = {way: sum(way in r.fits for r in mine) for way in ("ddp", "fsdp")}
        neither = sum(not r.fits for r in mine)
        out.append(
            f"- {size} on {gb}: DDP inside fits in {ways['ddp']} of {len(mine)} rows "
            f"({_bytes_span([r.mem_ddp for r in mine])} per GPU), FSDP inside in {ways['fsdp']} "
            f"({_bytes_span([r.mem_fsdp for r in mine])}); "
            + (f"{neither} of them fit neither way." if neither else "every row fits one way or the other.")
        )
    return out


def table_preamble() -> str:
    return (
        f"step time = 6*N*{TOKENS_PER_WORKER_STEP:,} tokens per worker step / ({ACCELERATORS_PER_WORKER} "
        f"accelerators x {FLOPS_PER_ACCELERATOR[TABLE_PRECISION] / 1e12:g} TFLOP/s, {TABLE_PRECISION}); "
        f"{ACCELERATORS_PER_WORKER} ranks per worker on NVLink (each preset with worker=nvlink); "
        "strategies at their defaults; steady state; memory per GPU "
        "at the peak, rank 0's, AdamW inside, fp32 masters (see docs/planner.md)"
    )
