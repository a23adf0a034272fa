"""The link a run estimates from its own collectives (`net.estimate`), on real TCP: two hosts of the
namespace bed joined by a veth pair shaped with `tbf` to a rate, diloco across them under torchrun,
with `--wan lan` (a link model that adds nothing measurable next to the bed's: every collective then
completes when the real one does, and the emulator's records time it).

For each rate: the bandwidth the run estimated (summary.json's `link_estimate`, and the median of the
per-step estimates in metrics.jsonl) against the tbf rate, and the RTT it estimated against the bed's
own (a TCP ping-pong, `netns.Bed.rtt`).

Needs root. Run it with nothing else on the machine.

    sudo python benchmarks/link_estimate_bed.py [--rates 50mbit,200mbit] [--reps 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import netns  # noqa: E402 - the test suite's bed, not a second copy

sys.path.insert(0, str(ROOT / "benchmarks"))
from hosts_fidelity import TRAIN, train_in_bed  # noqa: E402 - the 2-host bench's runs

RUN = ["--strategy", "diloco", "--steps", "40", "--sync-every", "4", "--wan", "lan"]
EVAL = ["--eval-every", "8"]  # small blocking means along the way: the RTT's samples


def run_in_bed(bed: netns.Bed, corpus: Path, work: Path) -> dict:
    run = train_in_bed(bed, [*RUN, *TRAIN, *EVAL, "--data", str(corpus)], work)
    summary = json.loads((run / "summary.json").read_text())
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    per_step = [r["link_bw_bps"] for r in steps if r.get("type") == "step" and "link_bw_bps" in r]
    est = summary["link_estimate"]
    return {"bw": est["bandwidth_bps"], "rtt": est["rtt_s"], "per_step": statistics.median(per_step)}


def bits(rate: str) -> float:
    return netns._bits(rate)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="50mbit,200mbit")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    why = netns.unavailable()
    if why:
        sys.exit(f"link_estimate_bed: {why}")
    from wansync.workloads.lm.corpus import shakespeare_text

    print(
        f"{datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
        f"diloco H 4, 40 steps, tiny LM, 2 hosts, --wan lan; {args.reps} repetitions",
        flush=True,
    )
    print("\n| tbf rate | estimated (summary) | per-step median | estimated / tbf | RTT estimated | RTT of the bed |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text(shakespeare_text())
        os.chmod(tmp, 0o755)
        for rate in args.rates.split(","):
            got = []
            with netns.Bed(2, rate=rate) as bed:
                rtt = bed.rtt(0, 1)
                for rep in range(args.reps):
                    got.append(run_in_bed(bed, corpus, Path(tmp) / f"{rate}-{rep}"))
            bw = statistics.median(g["bw"] for g in got)
            per_step = statistics.median(g["per_step"] for g in got)
            rtts = [g["rtt"] for g in got if g["rtt"] is not None]
            print(
                f"| {rate} | {bw / 1e6:.1f} Mbit/s | {per_step / 1e6:.1f} Mbit/s | {bw / bits(rate):.3f} | "
                f"{statistics.median(rtts) * 1e3:.2f} ms | {rtt * 1e3:.2f} ms |"
                if rtts
                else f"| {rate} | {bw / 1e6:.1f} Mbit/s | {per_step / 1e6:.1f} Mbit/s | {bw / bits(rate):.3f} | - | "
                f"{rtt * 1e3:.2f} ms |",
                flush=True,
            )


if __name__ == "__main__":
    main()
