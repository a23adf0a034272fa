"""A published run replayed by the planner: INTELLECT-1 (arXiv:2412.01152), and what wansync's own
strategies and codecs predict on the same links.

INTELLECT-1 trained a 10B-parameter model on 14 nodes of 8 H100 (FSDP2 inside a node, the outer
state on the CPU) across three continents with DiLoCo: H = 100 inner steps of about 22.8 s, then a
blocking int8 ring all-reduce of the pseudo-gradients. It reports the median all-reduce time and the
compute utilization on three sets of sites:

    sites              all-reduce     compute utilization
    USA                103 s          95.7 %
    USA + Europe       382 s          85.6 %
    global             469 s          83.0 %

The same planner then predicts a larger run (`large_table`): a 72B model on 20 workers, each behind
500 Mbit/s at 100 ms, DiLoCo and Streaming DiLoCo against SparseLoCo.

Calibration: each set of sites becomes a link (one site per node, its 8 GPUs on `NVLINK`; an RTT
assumed from the distances, which matters little next to 10 GB) whose bandwidth makes the planner's own int8 ring mean of the
10B pseudo-gradients (the reduce-scatter path: `comm.mean_cost.mean_collectives`) take the reported
all-reduce time. Replaying DiLoCo on that link must then give the reported utilization; what the
other configurations predict on it is the planner's answer to "what would wansync do there".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..net.link import NVLINK, Link, Topology
from ..strategies import make_options
from .predict import Prediction, predict, setting
from .schedule import mean_transfers
from .simulate import transfer_seconds
from .sizes import FLOPS_PER_ACCELERATOR, flops_step_s, of_params

PARAMS = 10e9
NODES, GPUS_PER_NODE = 14, 8
INNER_STEP_S = 22.8              # 100 inner steps took about 38 minutes
H = 100


@dataclass(frozen=True)
class Region:
    name: str
    all_reduce_s: float          # reported median
    utilization_pct: float       # reported
    rtt_s: float                 # assumed from the distances


REGIONS = (Region("USA", 103.0, 95.7, 0.06), Region("USA + Europe", 382.0, 85.6, 0.12),
           Region("global", 469.0, 83.0, 0.25))

# (label, strategy, options): INTELLECT-1's own setting first, then wansync's alternatives
CONFIGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("DiLoCo H=100, int8 (INTELLECT-1)", "diloco", {"sync_every": H, "codec": "int8", "codec_collective": "reduce_scatter"}),
    ("DiLoCo H=100, fp4", "diloco", {"sync_every": H, "codec": "fp4", "codec_collective": "reduce_scatter"}),
    ("DiLoCo H=200, int8", "diloco", {"sync_every": 2 * H, "codec": "int8", "codec_collective": "reduce_scatter"}),
    ("Streaming DiLoCo H=100, P=4, τ=5, int8", "streaming",
     {"sync_every": H, "fragments": 4, "overlap": 5, "codec": "int8", "codec_collective": "reduce_scatter"}),
    ("Streaming DiLoCo H=100, P=4, τ=10, int8", "streaming",
     {"sync_every": H, "fragments": 4, "overlap": 10, "codec": "int8", "codec_collective": "reduce_scatter"}),
    ("Streaming DiLoCo H=100, P=4, τ=10, fp4", "streaming",
     {"sync_every": H, "fragments": 4, "overlap": 10, "codec": "fp4", "codec_collective": "reduce_scatter"}),
    ("SparseLoCo H=100, 0.78 %, 2-bit", "sparseloco", {"sync_every": H}),
    ("SparseLoCo H=30, 0.78 %, 2-bit", "sparseloco", {"sync_every": 30}),
    ("SparseLoCo H=100, 3 %, 2-bit", "sparseloco", {"sync_every": H, "density": 0.03}),
)

# A larger run over the public internet: a 72B model on 20 workers (one node of 8 accelerators each,
# FSDP2 inside), every worker behind its own 500 Mbit/s at 100 ms RTT, the step time from the planner's
# FLOPs rule in bf16. What it predicts, not a figure any paper reports.
LARGE_PARAMS, LARGE_WORKERS = 72e9, 20
LARGE_LINK = Link(rtt_s=0.1, bandwidth_bps=500e6)
LARGE_CONFIGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("DiLoCo H=100, int8", "diloco", {"sync_every": H, "codec": "int8", "codec_collective": "reduce_scatter"}),
    ("Streaming DiLoCo H=100, P=4, τ=10, fp4", "streaming",
     {"sync_every": H, "fragments": 4, "overlap": 10, "codec": "fp4", "codec_collective": "reduce_scatter"}),
    ("SparseLoCo H=30, 0.78 %, 2-bit", "sparseloco", {"sync_every": 30}),
    ("SparseLoCo H=100, 0.78 %, 2-bit", "sparseloco", {"sync_every": H}),
    ("SparseLoCo H=30, 3 %, 2-bit", "sparseloco", {"sync_every": 30, "density": 0.03}),
)


def calibrated(region: Region) -> Topology:
    """The link on which the planner's int8 ring mean of the 10B pseudo-gradients (the collectives
    it replays for INTELLECT-1's setting, timed as it times them) takes the reported all-reduce
    time (bisection on the bandwidth)."""
    label, strategy, options = CONFIGS[0]
    opts = make_options(strategy, **options)

    def seconds(bw_bps: float) -> float:
        link = Link(rtt_s=region.rtt_s, bandwidth_bps=bw_bps)
        topo = Topology(sites=NODES, intra_link=link, inter_link=link, name=region.name, worker_link=NVLINK)
        timed = transfer_seconds(topo, NODES, GPUS_PER_NODE)
        return sum(timed(x) for x in mean_transfers(0, "params", int(PARAMS), opts, NODES, extra=1))
    low, high = 1e6, 1e13
    for _ in range(200):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if seconds(mid) > region.all_reduce_s else (low, mid)
    link = Link(rtt_s=region.rtt_s, bandwidth_bps=high)
    return Topology(sites=NODES, intra_link=link, inter_link=link, name=region.name, worker_link=NVLINK)


def predicted(topology: Topology, strategy: str, options: dict[str, Any]) -> Prediction:
    size = of_params(PARAMS)
    s = setting(strategy, options, size, NODES, topology, INNER_STEP_S, ranks_per_worker=GPUS_PER_NODE,
                inside="fsdp")
    return predict(s)


def utilization_pct(p: Prediction) -> float:
    """Compute over wall clock (the steady state the planner scales to 1000 steps)."""
    return 100.0 * 1000 * p.setting.step_s / p.wall_per_1000_s


def table() -> str:
    """The calibrated links, the replay of INTELLECT-1's setting against its reported utilization,
    and the alternatives on the same links (Markdown)."""
    topologies = [calibrated(r) for r in REGIONS]
    lines = ["| sites | assumed RTT | calibrated bandwidth | reported all-reduce | reported utilization |",
             "|---|---|---|---|---|"]
    for r, topo in zip(REGIONS, topologies):
        lines.append(f"| {r.name} | {r.rtt_s * 1e3:g} ms | {topo.inter_link.bandwidth_bps / 1e9:.3g} Gbit/s | "
                     f"{r.all_reduce_s:g} s | {r.utilization_pct} % |")
    lines += ["", "| configuration (predicted compute utilization) | " + " | ".join(r.name for r in REGIONS) + " |",
              "|---|" + "---|" * len(REGIONS)]
    for label, strategy, options in CONFIGS:
        cells = [f"{utilization_pct(predicted(t, strategy, options)):.1f} %" for t in topologies]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| reported (INTELLECT-1) | " + " | ".join(f"{r.utilization_pct} %" for r in REGIONS) + " |")
    return "\n".join(lines + ["", large_table()])


def large_table() -> str:
    """The 72B setting (`LARGE_CONFIGS`): compute utilization, exposed share and bytes per worker per
    outer round, predicted (Markdown)."""
    topology = Topology(sites=LARGE_WORKERS, intra_link=LARGE_LINK, inter_link=LARGE_LINK,
                        name="20 x 500 Mbit/s", worker_link=NVLINK)
    step_s = flops_step_s(LARGE_PARAMS, flops=FLOPS_PER_ACCELERATOR["bf16"])
    size = of_params(LARGE_PARAMS)
    lines = [f"A 72B model on {LARGE_WORKERS} workers of {GPUS_PER_NODE} GPUs (FSDP2 inside), each behind 500 Mbit/s "
             f"at 100 ms RTT, {step_s:.1f} s per inner step (the FLOPs rule in bf16): predicted, not reported.", "",
             "| configuration | compute utilization | exposed communication | bytes per worker per step |",
             "|---|---|---|---|"]
    for label, strategy, options in LARGE_CONFIGS:
        p = predict(setting(strategy, options, size, LARGE_WORKERS, topology, step_s,
                            ranks_per_worker=GPUS_PER_NODE, inside="fsdp"))
        lines.append(f"| {label} | {utilization_pct(p):.1f} % | {p.exposed_pct:.1f} % | "
                     f"{p.bytes_per_step / 1e6:.3g} MB |")
    return "\n".join(lines)
