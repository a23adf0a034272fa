"""The emulator against real TCP: the same collectives and trainings on the namespace test bed
(two hosts with their own TCP stacks, a veth pair shaped with `tbf` to the line rate) and under
`--wan` on one host, at the same line rate.

- Collectives: a 4-byte and a 7.28 MB (the tiny LM's float32) all-reduce between the two ranks; the
  median of many per repetition. Real: gloo across the bed. Emulated: gloo over 127.0.0.1 under
  `--wan rtt=<the bed's RTT>,bw=<rate>`, the RTT measured in the bed (a TCP ping-pong).
- Trainings: ddp and diloco (2 workers, the tiny LM, `--threads 1`): the exposed communication of a
  synchronization (profile.json's per-event `exposed_s`; the median over a run's events, so that a
  step where a rank was descheduled by another process does not count as link time). Real:
  `torchrun --nnodes 2` in the bed as docs/multinode.md says; emulated: `wansync train --workers 2
  --wan ...`.

Needs root (network namespaces). Prints a markdown table (the median over the repetitions and half their range);
the recorded figures are in benchmarks/README.md.

    sudo python benchmarks/hosts_fidelity.py [--rates 1gbit,100mbit] [--reps 5] [--only collectives|training]
        [--slow-start-after-idle 0|1]   # the bed's TCP: restart the window after an idle time (the kernel's 1)

Run it with nothing else on the machine: at 1 Gbit/s the bed's figures move by up to ±10 ms (of ~60)
when another process competes for the cores.
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

PORT = 29555
SIZES = {"4 B": 4, "7.28 MB": 7_280_000}
OPS = {"4 B": 300, "7.28 MB": 9}  # all-reduces per repetition (the median is kept)
TRAIN = [
    "--model",
    "tiny",
    "--batch-size",
    "4",
    "--seq-len",
    "64",
    "--eval-batches",
    "2",
    "--eval-every",
    "1000",
    "--threads",
    "1",
    "--quiet",
    "--seed",
    "0",
]
STRATEGIES = {"ddp": ["--steps", "30"], "diloco": ["--steps", "40", "--sync-every", "2"]}


def probe(rank: int, addr: str, wan: str | None) -> None:
    """One rank of the collectives' probe: prints {size: median seconds} as JSON on rank 0."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    kwargs = dict(init_method=f"tcp://{addr}:{PORT}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    if wan is None:
        dist.init_process_group("gloo", **kwargs)
    else:
        from wansync import net

        dist.init_process_group(net.install(), pg_options=net.Emulator(net.parse_wan(wan)), **kwargs)
    plain = dist.new_group(backend="gloo")
    out = {}
    for label, nbytes in SIZES.items():
        t = torch.ones(max(1, nbytes // 4))
        for _ in range(3):
            dist.all_reduce(t)
        times = []
        for _ in range(OPS[label]):
            dist.barrier(group=plain)
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out[label] = statistics.median(times)
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()


def in_bed(bed: netns.Bed, mode: str, timeout: float = 600) -> str:
    """Run this script's `mode` (the probe) as rank 0 on host A and rank 1 on host B; rank 0's output."""
    a, b = bed.hosts
    meet = a.address
    procs = [
        bed.start(
            h,
            [sys.executable, __file__, f"--{mode}", str(r), meet],
            env=netns.host_env({"GLOO_SOCKET_IFNAME": h.ifname}),
            stdout=subprocess.PIPE,
            text=True,
        )
        for r, h in enumerate((a, b))
    ]
    out = procs[0].communicate(timeout=timeout)[0]
    procs[1].wait(timeout=60)
    return out.strip().splitlines()[-1]


def emulated_probe(wan: str) -> dict[str, float]:
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--probe", str(r), "127.0.0.1", "--wan", wan],
            env=netns.host_env({"GLOO_SOCKET_IFNAME": "lo"}),
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    out = procs[0].communicate(timeout=600)[0]
    procs[1].wait(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


def exposed(run: Path) -> float:
    """The median exposed communication of a run's synchronizations (rank 0's profile)."""
    return statistics.median(e["exposed_s"] for e in json.loads((run / "profile.json").read_text())["events"])


def train_in_bed(bed: netns.Bed, args: list[str], work: Path) -> Path:
    """`wansync train ARGS` under torchrun on both hosts, as docs/multinode.md says; the first host's run."""
    a, b = bed.hosts
    procs = {
        h: bed.start(
            h,
            netns.torchrun_wansync(a.address, ["train", *args, "--out", str(work / h.name)]),
            env=netns.host_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for h in (a, b)
    }
    for h, p in procs.items():
        out = p.communicate(timeout=900)[0]
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} in the bed failed on {h.name}: {out[-2000:]}")
    return work / a.name


def exposed_real(bed: netns.Bed, strategy: str, corpus: Path, work: Path) -> float:
    return exposed(
        train_in_bed(bed, ["--strategy", strategy, *STRATEGIES[strategy], *TRAIN, "--data", str(corpus)], work)
    )


def exposed_emulated(strategy: str, wan: str, corpus: Path, work: Path) -> float:
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
            "2",
            "--wan",
            wan,
            "--out",
            str(out),
        ],
        env=netns.host_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if r.returncode != 0:
        raise RuntimeError(f"{strategy} under --wan {wan} failed: {r.stderr[-2000:]}")
    return exposed(out)


def spread(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    """The median over the repetitions (a repetition a busy neighbour slowed does not move it), and
    half the range between them."""
    mid = statistics.median(values) * scale
    return f"{mid:.{digits}g} (±{(max(values) - min(values)) * scale / 2:.2g})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="1gbit,100mbit")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--only", choices=("collectives", "training"))
    p.add_argument("--probe", type=int, metavar="RANK")
    p.add_argument("addr", nargs="?")
    p.add_argument("--wan")
    p.add_argument(
        "--slow-start-after-idle",
        choices=("0", "1"),
        help="set the bed's net.ipv4.tcp_slow_start_after_idle (default: the kernel's, 1)",
    )
    args = p.parse_args()
    if args.probe is not None:
        return probe(args.probe, args.addr, args.wan)
    why = netns.unavailable()
    if why:
        sys.exit(f"hosts_fidelity: {why}")
    from wansync.workloads.lm.corpus import shakespeare_text

    print(f"{datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print("\n| line rate | what | real (bed) | emulated | emulated/real | emulated - real |")
    print("|---|---|---|---|---|---|", flush=True)

    def row(*cells: str) -> None:
        print("| " + " | ".join(cells) + " |", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "plays.txt"
        corpus.write_text(shakespeare_text()[:400_000])
        for rate in args.rates.split(","):
            with netns.Bed(2, rate=rate) as bed:
                for host in bed.hosts if args.slow_start_after_idle else ():
                    bed.run(host, ["sysctl", "-qw", f"net.ipv4.tcp_slow_start_after_idle={args.slow_start_after_idle}"])
                rtt = bed.rtt(0, 1)  # a TCP ping-pong across the bed (`netns.Bed.rtt`)
                wan = f"rtt={rtt * 1e6:.0f}us,bw={rate}"
                if args.only in (None, "collectives"):
                    real = [json.loads(in_bed(bed, "probe")) for _ in range(args.reps)]
                    emu = [emulated_probe(wan) for _ in range(args.reps)]
                    for label in SIZES:
                        r, e = [x[label] for x in real], [x[label] for x in emu]
                        ratio = f"{statistics.median(e) / statistics.median(r):.3f}"
                        row(
                            rate,
                            f"all-reduce {label} (ms)",
                            spread(r, 1e3),
                            spread(e, 1e3),
                            ratio,
                            f"{(statistics.median(e) - statistics.median(r)) * 1e3:+.2f} ms",
                        )
                if args.only in (None, "training"):
                    for strategy in STRATEGIES:
                        real, emu = [], []
                        for k in range(args.reps):
                            work = Path(tmp) / f"{rate}-{strategy}-{k}"
                            real.append(exposed_real(bed, strategy, corpus, work))
                            emu.append(exposed_emulated(strategy, wan, corpus, work))
                        ratio = f"{statistics.median(emu) / statistics.median(real):.3f}"
                        row(
                            rate,
                            f"{strategy}: exposed comm per sync (ms)",
                            spread(real, 1e3),
                            spread(emu, 1e3),
                            ratio,
                            f"{(statistics.median(emu) - statistics.median(real)) * 1e3:+.1f} ms",
                        )
                print(f"({rate}: bed RTT {rtt * 1e3:.3f} ms, emulated as --wan {wan})", flush=True)


if __name__ == "__main__":
    main()
