"""A fixed configuration against `--adapt exposed=5%` through a link that drops 10x and recovers.

Four workers on two sites (two each), 100 ms and 200 Mbit/s between the sites, an emulated step of
150 ms (a topology file's `[compute] step`, so that the CPU's own speed does not move the phases), and
a link schedule: the bandwidth drops to a tenth at T1 and comes back at T2. For each seed, `wansync
train` runs diloco with `--overlap-rounds` twice, one run after the other: once fixed (fp32, H = 8:
what `wansync plan` picks for the nominal link, its exchange hidden behind a round), once with
`--adapt exposed=5%` (H 8..32, codec fp32..fp4, starting from the fixed run's knobs).

Per phase (before the drop, during it, after it) and per run, from metrics.jsonl: the exposed share
of the wall clock (the steps whose clock falls in the phase; also without the two rounds whose exchanges
the change of the link hit before the controller could act, the lag it is allowed), the bandwidth the run
estimated (median of its per-step estimates in the phase, after the lag) against the emulated one,
and the knobs it held; then the final validation loss at equal steps. Means over seeds, with half the
range.

    python benchmarks/adapt.py [--seeds 0,1,2] [--steps 240] [--t1 14] [--t2 28] [--target 5]
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
from pathlib import Path

COMMON = [
    "--model",
    "tiny",
    "--batch-size",
    "8",
    "--seq-len",
    "64",
    "--threads",
    "1",
    "--eval-every",
    "1000",
    "--eval-batches",
    "2",
    "--quiet",
    "--checkpoint-every",
    "0",
    "--workers",
    "4",
    "--strategy",
    "diloco",
    "--overlap-rounds",
    "--sync-every",
    "8",
]
TOPOLOGY = """name = "drop-10x"
[sites.a]
workers = 2
[sites.b]
workers = 2
[[links]]
sites = ["a", "b"]
rtt = "100ms"
bw = "{bw}mbit"
[compute]
step = "150ms"
[[schedules]]
links = "all"
steps = [{{ at = "{t1}s", scale = 0.1 }}, {{ at = "{t2}s", scale = 1.0 }}]
"""
BW = 200.0
H, STEP_S = 8, 0.15


def run_one(out: Path, topology: Path, seed: int, steps: int, adapt: str | None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "wansync",
        "train",
        "--wan",
        str(topology),
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--out",
        str(out),
        *COMMON,
        *(["--adapt", adapt] if adapt else []),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        sys.exit(f"adapt: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "steps": [r for r in rows if r["type"] == "step"],
        "adapt": [r for r in rows if r["type"] == "adapt"],
        "syncs": sorted(r["step"] for r in rows if r["type"] == "sync"),
        "loss": summary["final_val_loss"],
        "offset": summary["wan"].get("schedule_s_at_start", 0.0),
        "wall": summary["wall_clock_s"],
    }


def phases(run: dict, t1: float, t2: float, lag_rounds: int = 2) -> list[dict]:
    """Per phase: exposed share (all its steps, and those after `lag_rounds` rounds: the exchanges of the
    first `lag_rounds` boundaries in the phase ran on the knobs chosen before the change, and each lands
    one round later (`--overlap-rounds`), so the steps after the boundary where the last of them landed),
    median estimated bandwidth after the lag, the knobs held at the phase's end."""
    steps, off, syncs = run["steps"], run["offset"], run["syncs"]
    for prev, s in zip([{"time": 0.0}] + steps, steps):
        s["took"] = s["time"] - prev["time"]  # the step's own wall clock
    knobs = {"sync_every": H, "codec": "fp32"}
    changes = sorted(run["adapt"], key=lambda d: d["step"])
    out = []
    for lo, hi in ((0.0, t1), (t1, t2), (t2, float("inf"))):
        every = [s for s in steps if lo <= s["time"] + off < hi]
        after = [b for b in syncs if every and b >= every[0]["step"]]
        first_late = after[lag_rounds] if lo > 0 and len(after) > lag_rounds else (every[0]["step"] - 1 if every else 0)
        late = [s for s in every if s["step"] > first_late]

        def share(rows: list[dict]) -> float | None:
            took = sum(r["took"] for r in rows)
            return 100.0 * sum(r["exposed_s"] for r in rows) / took if len(rows) > 1 and took > 0 else None

        bws = [s["link_bw_bps"] / 1e6 for s in late if "link_bw_bps" in s]
        last_step = every[-1]["step"] if every else 0
        for d in changes:
            if d["step"] <= last_step:
                knobs = d["after"]
        out.append(
            {
                "exposed": share(every),
                "exposed_late": share(late),
                "bw": statistics.median(bws) if bws else None,
                "knobs": dict(knobs),
            }
        )
    return out


def cell(values: list[float | None], fmt: str = "{:.1f}") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.mean(values))} (±{fmt.format((max(values) - min(values)) / 2)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--t1", type=float, default=14.0)
    ap.add_argument("--t2", type=float, default=28.0)
    ap.add_argument("--target", type=float, default=5.0)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    adapt = f"exposed={args.target:g}%,h={H}..{4 * H},codec=fp32..fp4"
    print(
        f"{datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; diloco "
        f"--overlap-rounds, 4 workers on 2 sites, 100 ms, {BW:g} Mbit/s -> {BW / 10:g} at {args.t1:g} s -> {BW:g} at "
        f"{args.t2:g} s; step {STEP_S * 1e3:g} ms emulated, H = {H}, {args.steps} steps; fixed fp32 against "
        f"--adapt {adapt}; seeds {args.seeds}",
        flush=True,
    )
    results: dict[str, list[tuple[dict, list[dict]]]] = {"fixed": [], "adapt": []}
    with tempfile.TemporaryDirectory() as tmp:
        topology = Path(tmp) / "drop.toml"
        topology.write_text(TOPOLOGY.format(bw=BW, t1=args.t1, t2=args.t2))
        for seed in seeds:
            for name, spec in (("fixed", None), ("adapt", adapt)):
                run = run_one(Path(tmp) / f"{name}-{seed}", topology, seed, args.steps, spec)
                results[name].append((run, phases(run, args.t1, args.t2)))
                print(f"  seed {seed} {name}: {len(run['adapt'])} decisions, wall {run['wall']:.1f} s", flush=True)
    names = ("before the drop", "during the drop (10x less)", "after it")
    emulated = (BW, BW / 10, BW)
    print(
        f"\n| run | phase | exposed (% of wall) | after 2 rounds of lag | estimated bw (Mbit/s) | emulated | "
        f"knobs at the phase's end (seed {seeds[0]}) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        for i, phase in enumerate(names):
            ph = [p[i] for _, p in runs]
            knobs = ph[0]["knobs"]
            print(
                f"| {name} | {phase} | {cell([p['exposed'] for p in ph])} | {cell([p['exposed_late'] for p in ph])} | "
                f"{cell([p['bw'] for p in ph], '{:.3g}')} | {emulated[i]:g} | H {knobs['sync_every']}, "
                f"{knobs['codec']} |"
            )
    print("\n| run | final val loss (240 steps) | wall clock (s) |")
    print("|---|---|---|")
    for name, runs in results.items():
        print(f"| {name} | {cell([r['loss'] for r, _ in runs], '{:.4f}')} | {cell([r['wall'] for r, _ in runs])} |")
    worst = max(
        abs(p[i]["bw"] / emulated[i] - 1)
        for runs in results.values()
        for _, p in runs
        for i in range(3)
        if p[i]["bw"] is not None
    )
    held = max((p[i]["exposed_late"] or 0.0) for _, p in results["adapt"] for i in range(3))
    print(
        f"\nestimated bandwidth, worst phase: {100 * worst:.1f} % from the emulated one; --adapt, worst phase "
        f"after the lag: {held:.1f} % exposed (target {args.target:g} %)"
    )


if __name__ == "__main__":
    main()
