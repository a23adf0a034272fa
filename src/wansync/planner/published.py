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

Each set of sites is a topology file shipped as a preset (`intellect-1-usa`, `intellect-1-usa-europe`,
`intellect-1-global`, in `net/topologies/`): the continents are sites, each node a worker behind its own
internet uplink (``ports = "worker"``: its 8 GPUs share it), its GPUs on `NVLINK`. The report gives no
placement of the nodes nor the links between them; the files assume one (USA + Europe: 10 + 4 nodes;
global: 8 + 4 + 2 with Asia) and RTTs from the distances, and their bandwidths are calibrated, one
link at a time, so that the planner's own int8 ring mean of the 10B pseudo-gradients (the reduce-scatter
path: `comm.mean_cost.mean_collectives`) takes the reported all-reduce time: the link between US nodes
from the USA run, then the USA-Europe pair from the second, then the pairs to Asia from the global run
(`calibrate`, which `benchmarks/intellect1.py --write` runs to rewrite the files). Replaying DiLoCo on
each file alone must then give the reported utilization; what the other configurations predict on the
same files is the planner's answer to "what would wansync do there".

The same planner then predicts a larger run (`large_table`): a 72B model on 20 workers, each behind
500 Mbit/s at 100 ms, DiLoCo and Streaming DiLoCo against SparseLoCo.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..net.link import NVLINK, Link
from ..net.topology import Topology
from ..net.wan import parse_wan
from ..strategies import make_options
from .prediction import Prediction, predict, setting
from .schedule import mean_transfers
from .simulate import transfer_seconds
from .sizes import FLOPS_PER_ACCELERATOR, flops_step_s, of_params

PARAMS = 10e9
NODES, GPUS_PER_NODE = 14, 8
INNER_STEP_S = 22.8  # 100 inner steps took about 38 minutes
H = 100


@dataclass(frozen=True)
class Region:
    name: str
    preset: str  # its topology file (`net/topologies/<preset>.toml`)
    all_reduce_s: float  # reported median
    utilization_pct: float  # reported


REGIONS = (
    Region("USA", "intellect-1-usa", 103.0, 95.7),
    Region("USA + Europe", "intellect-1-usa-europe", 382.0, 85.6),
    Region("global", "intellect-1-global", 469.0, 83.0),
)

# (label, strategy, options): INTELLECT-1's own setting first, then wansync's alternatives
CONFIGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    (
        "DiLoCo H=100, int8 (INTELLECT-1)",
        "diloco",
        {"sync_every": H, "codec": "int8", "codec_collective": "reduce_scatter"},
    ),
    ("DiLoCo H=100, fp4", "diloco", {"sync_every": H, "codec": "fp4", "codec_collective": "reduce_scatter"}),
    ("DiLoCo H=200, int8", "diloco", {"sync_every": 2 * H, "codec": "int8", "codec_collective": "reduce_scatter"}),
    (
        "DiLoCo H=100, int8, whole-round overlap",
        "diloco",
        {"sync_every": H, "codec": "int8", "codec_collective": "reduce_scatter", "overlap_rounds": True},
    ),
    (
        "Streaming DiLoCo H=100, P=4, τ=5, int8",
        "streaming",
        {"sync_every": H, "fragments": 4, "overlap": 5, "codec": "int8", "codec_collective": "reduce_scatter"},
    ),
    (
        "Streaming DiLoCo H=100, P=4, τ=10, int8",
        "streaming",
        {"sync_every": H, "fragments": 4, "overlap": 10, "codec": "int8", "codec_collective": "reduce_scatter"},
    ),
    (
        "Streaming DiLoCo H=100, P=4, τ=10, fp4",
        "streaming",
        {"sync_every": H, "fragments": 4, "overlap": 10, "codec": "fp4", "codec_collective": "reduce_scatter"},
    ),
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
    (
        "DiLoCo H=100, int8, whole-round overlap",
        "diloco",
        {"sync_every": H, "codec": "int8", "codec_collective": "reduce_scatter", "overlap_rounds": True},
    ),
    (
        "Streaming DiLoCo H=100, P=4, τ=10, fp4",
        "streaming",
        {"sync_every": H, "fragments": 4, "overlap": 10, "codec": "fp4", "codec_collective": "reduce_scatter"},
    ),
    ("SparseLoCo H=30, 0.78 %, 2-bit", "sparseloco", {"sync_every": 30}),
    ("SparseLoCo H=100, 0.78 %, 2-bit", "sparseloco", {"sync_every": H}),
    ("SparseLoCo H=30, 3 %, 2-bit", "sparseloco", {"sync_every": 30, "density": 0.03}),
)


def topology(region: Region) -> Topology:
    """The region's topology file, as `--wan` reads it."""
    return parse_wan(region.preset)


def all_reduce_seconds(topo: Topology) -> float:
    """The planner's int8 ring mean of the 10B pseudo-gradients on `topo` (INTELLECT-1's all-reduce,
    timed as the planner times it)."""
    label, strategy, options = CONFIGS[0]
    opts = make_options(strategy, **options)
    timed = transfer_seconds(topo, NODES, GPUS_PER_NODE)
    return sum(timed(x) for x in mean_transfers(0, "params", int(PARAMS), opts, NODES, extra=1))


def calibrate(topo: Topology, links: list[tuple[int, int]], target_s: float) -> float:
    """The bandwidth (bit/s) that, given to the links `links` of `topo` (directed site pairs; (s, s)
    is site s's own link), makes `all_reduce_seconds` the reported `target_s` (bisection)."""

    def seconds(bw_bps: float) -> float:
        return all_reduce_seconds(with_bandwidth(topo, links, bw_bps))

    low, high = 1e6, 1e13
    for _ in range(200):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if seconds(mid) > target_s else (low, mid)
    return high


def with_bandwidth(topo: Topology, links: list[tuple[int, int]], bw_bps: float) -> Topology:
    """`topo` with the bandwidth of `links` set to `bw_bps`."""
    site_links = list(topo.site_links) or [topo.intra_link] * topo.sites
    pairs = {(a, b): link for a, b, link in topo.pair_links}
    for a, b in links:
        if a == b:
            site_links[a] = dataclasses.replace(site_links[a], bandwidth_bps=bw_bps)
        else:
            pairs[(a, b)] = dataclasses.replace(pairs.get((a, b), topo.inter_link), bandwidth_bps=bw_bps)
    return dataclasses.replace(
        topo,
        site_links=tuple(site_links),
        intra_link=site_links[0],
        pair_links=tuple((a, b, link) for (a, b), link in sorted(pairs.items())),
    )


def predicted(topology: Topology, strategy: str, options: dict[str, Any]) -> Prediction:
    size = of_params(PARAMS)
    s = setting(strategy, options, size, NODES, topology, INNER_STEP_S, ranks_per_worker=GPUS_PER_NODE, inside="fsdp")
    return predict(s)


def utilization_pct(p: Prediction) -> float:
    """Compute over wall clock (the steady state the planner scales to 1000 steps)."""
    return p.utilization_pct


def table() -> str:
    """The calibrated links, the replay of INTELLECT-1's setting against its reported utilization,
    and the alternatives on the same links (Markdown)."""
    topologies = [topology(r) for r in REGIONS]
    lines = [
        "| sites (`--wan`) | links (calibrated bandwidth, assumed RTT) | planned all-reduce | "
        "reported all-reduce | reported utilization |",
        "|---|---|---|---|---|",
    ]
    for r, topo in zip(REGIONS, topologies):
        lines.append(
            f"| {r.name} (`{r.preset}`) | {links_words(topo)} | {all_reduce_seconds(topo):.0f} s | "
            f"{r.all_reduce_s:g} s | {r.utilization_pct} % |"
        )
    lines += [
        "",
        "| configuration (predicted compute utilization) | " + " | ".join(r.name for r in REGIONS) + " |",
        "|---|" + "---|" * len(REGIONS),
    ]
    for label, strategy, options in CONFIGS:
        cells = [f"{utilization_pct(predicted(t, strategy, options)):.1f} %" for t in topologies]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| reported (INTELLECT-1) | " + " | ".join(f"{r.utilization_pct} %" for r in REGIONS) + " |")
    return "\n".join(lines + ["", large_table()])


def links_words(topo: Topology) -> str:
    """`usa 1.59 Gbit/s 60 ms; usa-europe ...`: each site's own link, then each pair's."""

    def fmt(link: Any) -> str:
        return f"{link.bandwidth_bps / 1e9:.3g} Gbit/s, {link.rtt_s * 1e3:g} ms"

    words = [f"{topo.site_name(s)} {fmt(topo.base_link(s, s))}" for s in range(topo.sites)]
    words += [
        f"{topo.site_name(a)}-{topo.site_name(b)} {fmt(topo.base_link(a, b))}"
        for a in range(topo.sites)
        for b in range(a + 1, topo.sites)
    ]
    return "; ".join(words)


def large_table() -> str:
    """The 72B setting (`LARGE_CONFIGS`): compute utilization, exposed share and bytes per worker per
    outer round, predicted (Markdown)."""
    topology = Topology(
        sites=LARGE_WORKERS, intra_link=LARGE_LINK, inter_link=LARGE_LINK, name="20 x 500 Mbit/s", worker_link=NVLINK
    )
    step_s = flops_step_s(LARGE_PARAMS, flops=FLOPS_PER_ACCELERATOR["bf16"])
    size = of_params(LARGE_PARAMS)
    lines = [
        f"A 72B model on {LARGE_WORKERS} workers of {GPUS_PER_NODE} GPUs (FSDP2 inside), each behind 500 Mbit/s "
        f"at 100 ms RTT, {step_s:.1f} s per inner step (the FLOPs rule in bf16): predicted, not reported.",
        "",
        "| configuration | compute utilization | exposed communication | bytes per worker per step |",
        "|---|---|---|---|",
    ]
    for label, strategy, options in LARGE_CONFIGS:
        p = predict(
            setting(
                strategy, options, size, LARGE_WORKERS, topology, step_s, ranks_per_worker=GPUS_PER_NODE, inside="fsdp"
            )
        )
        lines.append(
            f"| {label} | {utilization_pct(p):.1f} % | {p.exposed_pct:.1f} % | " f"{p.bytes_per_step / 1e6:.3g} MB |"
        )
    return "\n".join(lines)
