"""INTELLECT-1's three sets of sites (arXiv:2412.01152) as topology files, the planner and the emulator on them.

    python benchmarks/intellect1.py                 # plan on each shipped file: all-reduce and utilization
    python benchmarks/intellect1.py --emulate       # and a time-scaled emulated replay of the same round
    python benchmarks/intellect1.py --write         # recalibrate the files (src/wansync/net/topologies/)

The files (`intellect-1-usa`, `intellect-1-usa-europe`, `intellect-1-global`) put 14 nodes of 8 GPUs
in continents (sites), each node behind its own uplink (`ports = "worker"`), and their bandwidths are
calibrated one link at a time (`planner.published.calibrate`) so that the planner's int8 ring mean of
the 10B pseudo-gradients takes the reported median all-reduce: the US link from the USA run, then
USA-Europe, then the pairs to Asia. The placement (10 + 4; 8 + 4 + 2) and the RTTs are assumptions.

`--emulate` replays outer rounds on the emulator itself, time-scaled by `--scale` (2e-3) with buffers
scaled by `--byte-scale` (1e-6): RTTs x scale and bandwidths x byte-scale / scale, so every modelled
time shrinks by the same factor while the real collectives under it stay tiny (14 processes share 2 cores):
14 ranks on this machine (one per node: a node's 8 ranks move 1/8 each over the uplink they share,
the same bytes as one rank moving all of it), the H = 100 scaled 22.8 s steps as one sleep, then the
mean's two collectives (the all-to-all and all-gather of the int8 payload) through `wansync_emu` on
the file's topology. Utilization = compute / (compute + the blocking exchange), per the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = ROOT / "src" / "wansync" / "net" / "topologies"

# the assumed placement and RTTs: (name, [(site, nodes)], intra RTT, {pair: RTT})
LAYOUTS = {
    "intellect-1-usa": [("usa", 14)],
    "intellect-1-usa-europe": [("usa", 10), ("europe", 4)],
    "intellect-1-global": [("usa", 8), ("europe", 4), ("asia", 2)],
}
RTT_S = {("usa", "usa"): 0.06, ("usa", "europe"): 0.12, ("usa", "asia"): 0.25, ("europe", "asia"): 0.25}
HEADER = """# INTELLECT-1 (arXiv:2412.01152), the set of sites it calls "{region}": 14 nodes of 8 H100
# (FSDP2 inside a node), {placement}.
# Each node is a worker behind its own internet uplink, which its 8 GPUs share (ports = "worker").
# The placement and the RTTs are assumptions (the report gives neither);
# the bandwidths are calibrated so that the planner's int8 ring mean of the 10B pseudo-gradients takes
# the reported median all-reduce ({all_reduce:g} s), one link at a time: the US link from the USA run,
# then USA-Europe, then the pairs to Asia. Written by `python benchmarks/intellect1.py --write`.
"""


def structure(preset: str, bw: dict[tuple[str, str], float]):
    """The topology of `preset` with the bandwidths `bw` (bit/s, by site-name pair; (s, s) inside s)."""
    from wansync.net.link import NVLINK, Link
    from wansync.net.topology import Topology

    sites = LAYOUTS[preset]
    names = [n for n, _ in sites]
    inside = Link(RTT_S[("usa", "usa")], bw.get(("usa", "usa"), 1e9))
    pairs = []
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if i != j:
                key = tuple(sorted((a, b), key=names.index))
                pairs.append((i, j, Link(RTT_S[key], bw.get(key, 1e9))))
    return Topology(
        sites=len(names),
        name=preset,
        site_names=tuple(names),
        site_workers=tuple(n for _, n in sites),
        site_links=(inside,) * len(names),
        intra_link=inside,
        site_ports=("worker",) * len(names),
        pair_links=tuple(pairs),
        worker_link=NVLINK,
    )


def calibrated() -> dict[str, object]:
    from wansync.planner.published import REGIONS, calibrate

    bw: dict[tuple[str, str], float] = {}
    out = {}
    for region, links in zip(REGIONS, ([("usa", "usa")], [("usa", "europe")], [("usa", "asia"), ("europe", "asia")])):
        topo = structure(region.preset, bw)
        names = list(topo.site_names)
        pairs = [(names.index(a), names.index(b)) for a, b in links]
        pairs += [(b, a) for a, b in pairs if a != b]
        if ("usa", "usa") in links:
            pairs = [(s, s) for s in range(topo.sites)]
        value = calibrate(topo, pairs, region.all_reduce_s)
        for key in links:
            bw[key] = value
        out[region.preset] = structure(region.preset, bw)
    return out


def toml_of(topo, region) -> str:
    names = topo.site_names
    placement = " + ".join(f"{n} in {s}" for s, n in zip(names, topo.site_workers))
    lines = [
        HEADER.format(region=region.name, placement=placement, all_reduce=region.all_reduce_s).rstrip(),
        f'name = "{topo.name}"',
        "",
    ]
    for s, name in enumerate(names):
        link = topo.base_link(s, s)
        lines += [
            f"[sites.{name}]",
            f"workers = {topo.site_workers[s]}",
            'ports = "worker"',
            f'link = {{ rtt = "{link.rtt_s * 1e3:g}ms", bw = "{link.bandwidth_bps / 1e6:.6g}mbit" }}',
            "",
        ]
    for a in range(topo.sites):
        for b in range(a + 1, topo.sites):
            link = topo.base_link(a, b)
            lines += [
                "[[links]]",
                f'sites = ["{names[a]}", "{names[b]}"]',
                f'rtt = "{link.rtt_s * 1e3:g}ms"',
                f'bw = "{link.bandwidth_bps / 1e6:.6g}mbit"',
                "",
            ]
    lines += ["[worker]", 'link = "nvlink"', ""]
    return "\n".join(lines)


def write() -> None:
    from wansync.planner.published import REGIONS

    topos = calibrated()
    for region in REGIONS:
        path = TOPOLOGIES / f"{region.preset}.toml"
        path.write_text(toml_of(topos[region.preset], region))
        print(f"wrote {path.relative_to(ROOT)}")


def plan_rows() -> list[dict]:
    from wansync.planner.published import CONFIGS, REGIONS, all_reduce_seconds, predicted, topology, utilization_pct

    label, strategy, options = CONFIGS[0]
    rows = []
    for region in REGIONS:
        topo = topology(region)
        rows.append(
            {
                "region": region,
                "all_reduce_s": all_reduce_seconds(topo),
                "utilization": utilization_pct(predicted(topo, strategy, options)),
            }
        )
    return rows


# ---- the emulated replay ----------------------------------------------------------------------------

PARAMS, NODES, STEP_S, H = 10e9, 14, 22.8, 100


def scaled(topo, scale: float, byte_scale: float):
    """Every modelled time x `scale` for buffers x `byte_scale`: each link's RTT x scale, its bandwidth
    x byte_scale / scale (a + B/b becomes scale·a + byte_scale·B / (b·byte_scale/scale))."""

    def s(link):
        return dataclasses.replace(
            link, rtt_s=link.rtt_s * scale, bandwidth_bps=link.bandwidth_bps * byte_scale / scale
        )

    return dataclasses.replace(
        topo,
        intra_link=s(topo.intra_link),
        site_links=tuple(s(x) for x in topo.site_links),
        pair_links=tuple((a, b, s(x)) for a, b, x in topo.pair_links),
        worker_link=None,
        ranks_per_worker=1,
        site_ports=(),
    )


def replay_rank(rank: int, world: int, port: int, preset: str, scale: float, byte_scale: float, rounds: int) -> dict:
    import torch.distributed as dist

    from wansync import net
    from wansync.comm.mean_cost import mean_collectives

    dist.destroy_process_group()
    topo = scaled(net.parse_wan(preset), scale, byte_scale)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=120))
    dist.init_process_group(
        net.install(),
        store=store,
        rank=rank,
        world_size=world,
        pg_options=net.Emulator(topo, seed=0),
        timeout=datetime.timedelta(seconds=120),
    )
    numel = int(PARAMS * byte_scale)
    steps = mean_collectives(numel, "int8", "reduce_scatter", world, 1)  # INTELLECT-1's int8 ring mean
    walls = []
    for _ in range(rounds + 1):
        dist.barrier()
        t0 = time.perf_counter()
        time.sleep(H * STEP_S * scale)  # the H inner steps (one sleep: no overshoot per step)
        compute = time.perf_counter() - t0
        for c in steps:  # the all-to-all, then the all-gather: as modelled
            _issue(c.op, c.nbytes, world).wait()
        walls.append((compute, time.perf_counter() - t0))
    dist.destroy_process_group()
    return {"rounds": walls[1:]}


def _issue(op: str, nbytes: int, world: int):
    """The collective `op` over a B = `nbytes` buffer (the cost model's B) of bytes."""
    import torch
    import torch.distributed as dist

    per = max(1, nbytes // world)
    if op == "allgather":
        return dist.all_gather_into_tensor(
            torch.empty(per * world, dtype=torch.uint8), torch.zeros(per, dtype=torch.uint8), async_op=True
        )
    if op in ("alltoall", "reduce_scatter"):
        src = torch.zeros(per * world, dtype=torch.uint8)
        return dist.all_to_all_single(torch.empty_like(src), src, async_op=True)
    return dist.all_reduce(torch.zeros(per * world, dtype=torch.uint8), async_op=True)


def emulate(scale: float, byte_scale: float, rounds: int) -> list[dict]:
    from wansync.planner.published import REGIONS
    from wansync.runner.localgroup import run_ranks

    out = []
    for region in REGIONS:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ranks = run_ranks(replay_rank, NODES, port, region.preset, scale, byte_scale, rounds, timeout=600)
        shares = [compute / wall for r in ranks for compute, wall in r["rounds"]]
        exchange = statistics.median(wall - compute for r in ranks for compute, wall in r["rounds"])
        out.append({"region": region, "utilization": 100 * statistics.median(shares), "exchange_s": exchange / scale})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="recalibrate and rewrite the three topology files")
    ap.add_argument("--emulate", action="store_true", help="also replay a round on the emulator, time-scaled")
    ap.add_argument("--scale", type=float, default=2e-3, help="time scale of the replay")
    ap.add_argument("--byte-scale", type=float, default=1e-6, help="buffer scale of the replay")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.write:
        write()
    rows = plan_rows()
    emulated = emulate(args.scale, args.byte_scale, args.rounds) if args.emulate else None
    print(f"# INTELLECT-1 on its topology files, {datetime.date.today()}, {sys.platform}")
    head = "| sites | planned all-reduce | reported | planned utilization | reported |"
    print(head + (" emulated utilization |" if emulated else ""))
    print("|---|---|---|---|---|" + ("---|" if emulated else ""))
    for i, r in enumerate(rows):
        reg = r["region"]
        cells = [
            f"{reg.name} (`{reg.preset}`)",
            f"{r['all_reduce_s']:.0f} s",
            f"{reg.all_reduce_s:g} s",
            f"{r['utilization']:.1f} %",
            f"{reg.utilization_pct} %",
        ]
        if emulated:
            cells.append(f"{emulated[i]['utilization']:.1f} % (exchange {emulated[i]['exchange_s']:.0f} s)")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
