"""The emulator against real TCP on uneven links: three hosts of the namespace bed, a rate of its own
for each pair (`netns.Bed.shape_pairs`: htb per destination), against `--wan FILE` with the same
pairs on one host. And the hierarchical all-reduce against the flat one, on both.

- Collectives: a 7.28 MB all-reduce (the tiny LM's float32) over one rank per host, the median of 9
  per repetition. Real: gloo across the bed; emulated: gloo over 127.0.0.1 under the topology file
  (sites a, b, c; each pair the bed's rate, each RTT the bed's, measured).
- Trainings: ddp and diloco, 3 workers (the tiny LM, `--threads 1`): the median exposed communication
  of a synchronization (profile.json's events). Real: `torchrun --nnodes 3` in the bed; emulated:
  `wansync train --workers 3 --wan FILE`. torchrun numbers the nodes as they meet, so the real ring's
  direction is not the file's: the training settings shape both directions of a pair alike.
- By sites or flat: 4 ranks, two on host a (an uneven site), one on b, one on c; the 7.28 MB
  all-reduce flat (one ring) and by sites (`comm.site_mean`: inside a, then a-b-c, then back inside a),
  real and emulated, and the cost model's choice (`net.cost.allreduce_algorithm`).

Needs root. Run it with nothing else on the machine (see hosts_fidelity.py: a busy neighbour moves the
bed's figures). Prints markdown tables; the recorded figures are in benchmarks/README.md.

    sudo python benchmarks/pairs_fidelity.py [--reps 3] [--only collectives|training|sites]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import netns  # noqa: E402 - the test suite's bed, not a second copy

sys.path.insert(0, str(ROOT / "benchmarks"))
from hosts_fidelity import STRATEGIES, TRAIN, env, exposed, spread  # noqa: E402 - the 2-host bench's runs

PORT = 29566
NAMES = "abc"
BYTES = 7_280_000
OPS = 9
# pair settings (host i -> host j), both directions alike for the trainings (see the docstring)
SETTINGS = {
    "A": {("a", "b"): "300mbit", ("b", "c"): "100mbit", ("a", "c"): "200mbit"},
    "B": {("a", "b"): "1gbit", ("b", "c"): "50mbit", ("a", "c"): "500mbit"},
}
# fast links between the sites: gathering inside a site first costs more than it saves (flat should win)
FAST = {(a, b): "2gbit" for a in NAMES for b in NAMES if a != b}
# an asymmetric one, for the collectives (their ranks are placed by hand)
ASYMMETRIC = {
    ("a", "b"): "300mbit",
    ("b", "a"): "100mbit",
    ("b", "c"): "200mbit",
    ("c", "b"): "200mbit",
    ("c", "a"): "150mbit",
    ("a", "c"): "400mbit",
}


def pairs(setting: dict[tuple[str, str], str], both: bool) -> dict[tuple[str, str], str]:
    out = dict(setting)
    if both:
        out.update({(b, a): r for (a, b), r in setting.items()})
    return out


def topology_toml(
    rates: dict[tuple[str, str], str], rtt_s: dict[tuple[str, str], float], workers: tuple[int, int, int] = (1, 1, 1)
) -> str:
    """The bed as a topology file: sites a, b, c, each pair its rate and measured RTT, one direction each."""
    lines = ['name = "bed"']
    for name, n in zip(NAMES, workers):
        lines += [f"[sites.{name}]", f"workers = {n}"]
    for (x, y), rate in rates.items():
        lines += ["[[links]]", f'from = "{x}"', f'to = "{y}"', f'rtt = "{rtt_s[(x, y)] * 1e6:.0f}us"', f'bw = "{rate}"']
    return "\n".join(lines) + "\n"


# ---- the probe: one rank ------------------------------------------------------------------------------


def probe(rank: int, world: int, addr: str, topology: str, emulated: bool, algorithm: str) -> None:
    """All-reduces of BYTES, flat or by sites: prints the median seconds until the last rank has the
    result (ranks finish at different times on a real ring: the one that waits longest counts, as
    the emulator completes every member at the collective's end)."""
    import torch
    import torch.distributed as dist

    from wansync import net
    from wansync.comm.site_mean import SiteGroups

    torch.set_num_threads(1)
    topo = net.parse_wan(topology)
    kwargs = dict(
        init_method=f"tcp://{addr}:{PORT}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    if emulated:
        dist.init_process_group(net.install(), pg_options=net.Emulator(topo), **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)
    plain = dist.new_group(backend="gloo")
    sites = SiteGroups.make([list(range(world))], topo, world) if algorithm == "sites" else None
    t = torch.ones(BYTES // 4)
    times = []
    for k in range(OPS + 2):
        dist.barrier(group=plain)
        t0 = time.perf_counter()
        if sites is None:
            dist.all_reduce(t)
        else:
            sites.all_reduce(t)
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=plain)
        if k >= 2:
            times.append(float(took))
    if rank == 0:
        print(json.dumps(statistics.median(times)))
    dist.destroy_process_group()


def placed(bed: netns.Bed, workers: tuple[int, ...]) -> list[netns.Host]:
    """The host of each rank: `workers[i]` ranks on host i, in order."""
    return [h for h, n in zip(bed.hosts, workers) for _ in range(n)]


def probe_real(bed: netns.Bed, topology: Path, workers: tuple[int, ...], algorithm: str) -> float:
    hosts = placed(bed, workers)
    procs = [
        bed.start(
            h,
            [
                sys.executable,
                __file__,
                "--probe",
                str(r),
                str(len(hosts)),
                bed.hosts[0].address,
                str(topology),
                "real",
                algorithm,
            ],
            env=dict(env(), GLOO_SOCKET_IFNAME=h.ifname),
            stdout=subprocess.PIPE,
            text=True,
        )
        for r, h in enumerate(hosts)
    ]
    out = procs[0].communicate(timeout=600)[0]
    for p in procs[1:]:
        p.wait(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


def probe_emulated(topology: Path, world: int, algorithm: str) -> float:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--probe",
                str(r),
                str(world),
                "127.0.0.1",
                str(topology),
                "emulated",
                algorithm,
            ],
            env=dict(env(), GLOO_SOCKET_IFNAME="lo"),
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    out = procs[0].communicate(timeout=600)[0]
    for p in procs[1:]:
        p.wait(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


# ---- trainings ---------------------------------------------------------------------------------------------


def exposed_real(bed: netns.Bed, strategy: str, corpus: Path, work: Path) -> float:
    torchrun = Path(sys.executable).parent / "torchrun"
    first = bed.hosts[0]
    launch = [
        "--nnodes",
        "3",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "wansync",
        "--rdzv-endpoint",
        f"{first.address}:29400",
        "--rdzv-id",
        work.name,
    ]
    args = ["train", "--strategy", strategy, *STRATEGIES[strategy], *TRAIN, "--data", str(corpus)]
    procs = {
        h: bed.start(
            h,
            [str(torchrun), *launch, "-m", "wansync", *args, "--out", str(work / h.name)],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for h in bed.hosts
    }
    for h, p in procs.items():
        out = p.communicate(timeout=900)[0]
        if p.returncode != 0:
            raise RuntimeError(f"{strategy} in the bed failed on {h.name}: {out[-2000:]}")
    return exposed(work / first.name)


def exposed_emulated(strategy: str, topology: Path, corpus: Path, work: Path) -> float:
    out = work / "emulated"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "wansync",
            "train",
            "--strategy",
            strategy,
            *STRATEGIES[strategy],
            *TRAIN,
            "--data",
            str(corpus),
            "--workers",
            "3",
            "--wan",
            str(topology),
            "--out",
            str(out),
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if r.returncode != 0:
        raise RuntimeError(f"{strategy} under --wan {topology} failed: {r.stderr[-2000:]}")
    return exposed(out)


def measured_rtts(bed: netns.Bed) -> dict[tuple[str, str], float]:
    return {(NAMES[i], NAMES[j]): bed.rtt(i, j) for i in range(3) for j in range(3) if i != j}


def shape(bed: netns.Bed, rates: dict[tuple[str, str], str]) -> None:
    bed.shape_pairs({(NAMES.index(a), NAMES.index(b)): r for (a, b), r in rates.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--only", choices=("collectives", "training", "sites"))
    p.add_argument("--probe", nargs=6, metavar=("RANK", "WORLD", "ADDR", "TOPOLOGY", "MODE", "ALGORITHM"))
    args = p.parse_args()
    if args.probe:
        rank, world, addr, topology, mode, algorithm = args.probe
        return probe(int(rank), int(world), addr, topology, mode == "emulated", algorithm)
    why = netns.unavailable()
    if why:
        sys.exit(f"pairs_fidelity: {why}")
    from wansync.net import parse_wan
    from wansync.net.cost import allreduce_algorithm
    from wansync.workloads.lm.corpus import shakespeare_text

    print(f"{datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print("\n| pairs (a-b, b-c, a-c) | what | real (bed) | emulated | emulated/real |")
    print("|---|---|---|---|---|", flush=True)

    def row(*cells: str) -> None:
        print("| " + " | ".join(cells) + " |", flush=True)

    def ratio(e: list[float], r: list[float]) -> str:
        return f"{statistics.median(e) / statistics.median(r):.3f}"

    with tempfile.TemporaryDirectory() as tmp, netns.Bed(3) as bed:
        corpus = Path(tmp) / "plays.txt"
        corpus.write_text(shakespeare_text()[:400_000])
        rtts = measured_rtts(bed)
        cases = [(name, pairs(s, both=True)) for name, s in SETTINGS.items()] + [("asymmetric", ASYMMETRIC)]
        for name, rates in cases:
            shape(bed, rates)
            label = f"{name}: " + ", ".join(f"{a}{b} {r}" for (a, b), r in rates.items())
            topology = Path(tmp) / f"{name}.toml"
            topology.write_text(topology_toml(rates, rtts))
            if args.only in (None, "collectives"):
                real = [probe_real(bed, topology, (1, 1, 1), "flat") for _ in range(args.reps)]
                emu = [probe_emulated(topology, 3, "flat") for _ in range(args.reps)]
                row(label, "all-reduce 7.28 MB (ms)", spread(real, 1e3), spread(emu, 1e3), ratio(emu, real))
            if args.only in (None, "training") and name != "asymmetric":
                for strategy in STRATEGIES:
                    real, emu = [], []
                    for k in range(args.reps):
                        work = Path(tmp) / f"{name}-{strategy}-{k}"
                        real.append(exposed_real(bed, strategy, corpus, work))
                        emu.append(exposed_emulated(strategy, topology, corpus, work))
                    row(
                        label,
                        f"{strategy}: exposed comm per sync (ms)",
                        spread(real, 1e3),
                        spread(emu, 1e3),
                        ratio(emu, real),
                    )
        if args.only in (None, "sites"):
            print(
                "\n| uneven sites (2 + 1 + 1 ranks) | algorithm | real (bed) | emulated | emulated/real | "
                "cost model |\n|---|---|---|---|---|---|",
                flush=True,
            )
            for name, rates in [*cases, ("fast", FAST)]:
                shape(bed, rates)
                topology = Path(tmp) / f"{name}-uneven.toml"
                topology.write_text(topology_toml(rates, rtts, (2, 1, 1)))
                modelled = {"flat": None, "sites": None}
                from wansync.net.cost import collective_duration, hierarchical_seconds

                topo = parse_wan(str(topology))
                modelled["flat"] = collective_duration("allreduce", BYTES, 4, topo)
                modelled["sites"] = hierarchical_seconds(BYTES, 4, topo)
                choice = allreduce_algorithm(BYTES, 4, topo)
                medians = {}
                for algorithm in ("flat", "sites"):
                    real = [probe_real(bed, topology, (2, 1, 1), algorithm) for _ in range(args.reps)]
                    emu = [probe_emulated(topology, 4, algorithm) for _ in range(args.reps)]
                    medians[algorithm] = statistics.median(real)
                    row(
                        name,
                        algorithm,
                        spread(real, 1e3),
                        spread(emu, 1e3),
                        ratio(emu, real),
                        f"{modelled[algorithm] * 1e3:.1f} ms",
                    )
                faster = min(medians, key=medians.__getitem__)
                print(
                    f"({name}: the cost model chose {choice}; the bed's faster was "
                    f"{'hierarchical' if faster == 'sites' else 'flat'})",
                    flush=True,
                )
        print("(bed RTTs: " + ", ".join(f"{a}{b} {v * 1e6:.0f} us" for (a, b), v in rtts.items()) + ")")


if __name__ == "__main__":
    main()
