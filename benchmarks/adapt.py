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

`--busy N` runs N busy loops (processes spinning on the CPU) beside the runs, started before the first and
killed by their PIDs after the last, also on an error or Ctrl-C: the step times then swing with the load,
as on a shared machine. Per run, the decisions in each phase, and whether one went back to a lighter
setting while the link was down.

    python benchmarks/adapt.py [--seeds 0,1,2] [--steps 240] [--t1 14] [--t2 28] [--target 5] [--busy N]
        [--out DIR]

`--out DIR` keeps the runs; a run already finished there with the same settings is read instead of run
again, so a benchmark stopped half-way (or run a seed at a time, in the quiet spells of a shared machine)
goes on where it stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

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


def run_one(out: Path, topology: Path, seed: int, steps: int, adapt: str | None, setup: dict) -> dict:
    """One run in `out`, or the one already there if it finished under the same `setup` (`--out`)."""
    mark = out / "bench.json"
    kept = mark.exists() and json.loads(mark.read_text())["setup"] == setup and (out / "summary.json").exists()
    if not kept:
        shutil.rmtree(out, ignore_errors=True)
        load = os.getloadavg()[0]
        _train(out, topology, seed, steps, adapt)
        mark.write_text(json.dumps({"setup": setup, "load": [load, os.getloadavg()[0]]}))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "steps": [r for r in rows if r["type"] == "step"],
        "adapt": [r for r in rows if r["type"] == "adapt"],
        "syncs": sorted(r["step"] for r in rows if r["type"] == "sync"),
        "loss": summary["final_val_loss"],
        "offset": summary["wan"].get("schedule_s_at_start", 0.0),
        "wall": summary["wall_clock_s"],
        "load": json.loads(mark.read_text())["load"],  # the 1-min load average before and after it
        "kept": kept,
    }


def _train(out: Path, topology: Path, seed: int, steps: int, adapt: str | None) -> None:
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
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    if len(known) == 1:
        return fmt.format(known[0])
    return f"{fmt.format(statistics.mean(known))} (±{fmt.format((max(known) - min(known)) / 2)})"


def _exit_on_term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[list[int]]:
    """`n` processes spinning on the CPU while the block runs, each killed by its PID when the block ends,
    however it ends (an error, Ctrl-C, or SIGTERM, which is turned into SystemExit for this)."""
    procs: list[subprocess.Popen] = []
    previous = signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL))
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        signal.signal(signal.SIGTERM, previous)


CODECS = ("fp32", "bf16", "int8", "fp4")  # lightest first


def _order(knobs: dict) -> tuple[int, int]:
    """Where `knobs` come in --adapt's order of preference: H from the lowest, then the lightest codec."""
    return knobs["sync_every"], CODECS.index(knobs["codec"])


def decisions(run: dict, t1: float, t2: float) -> list[dict]:
    """Each decision: its step, the phase its clock falls in, the change of the link it answers (`answers`:
    0 none, before the drop; 1 the drop, planned on the dropped link; 2 the recovery, planned on the
    nominal one after the drop began: a decision comes two rounds after the exchange that measured the
    link, and on a loaded machine that can be after the phase ended), before -> after, whether it went
    back (to a setting earlier in the order of preference), the link and step time it planned with."""
    steps, off = run["steps"], run["offset"]
    out = []
    for d in sorted(run["adapt"], key=lambda d: d["step"]):
        at = steps[d["step"] - 1]["time"] + off
        out.append(
            {
                "step": d["step"],
                "at": at,
                "phase": 0 if at < t1 else 1 if at < t2 else 2,
                "answers": 0 if at < t1 else 1 if d["link_bw_bps"] / 1e6 < BW / 10**0.5 else 2,
                "back": _order(d["after"]) < _order(d["before"]),
                "what": f"H {d['before']['sync_every']} {d['before']['codec']} -> H {d['after']['sync_every']} "
                f"{d['after']['codec']}",
                "step_s": d["step_s"],
                "bw": d["link_bw_bps"],
            }
        )
    return out


def round_steps(run: dict) -> list[float]:
    """Each round's median step time without the exposed communication (its steps' wall clock)."""
    bounds = [0, *run["syncs"]]
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        took = [s["took"] - s["exposed_s"] for s in run["steps"] if lo < s["step"] <= hi]
        if took:
            out.append(statistics.median(took))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--t1", type=float, default=14.0)
    ap.add_argument("--t2", type=float, default=28.0)
    ap.add_argument("--target", type=float, default=5.0)
    ap.add_argument("--busy", type=int, default=0, help="busy loops beside the runs (0: none)")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="keep the runs here; one finished there under the same settings is read, not rerun (default: a "
        "temporary directory)",
    )
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    adapt = f"exposed={args.target:g}%,h={H}..{4 * H},codec=fp32..fp4"
    print(
        f"{datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
        f"{args.busy} busy loops; diloco --overlap-rounds, 4 workers on 2 sites, 100 ms, {BW:g} Mbit/s -> "
        f"{BW / 10:g} at {args.t1:g} s -> {BW:g} at {args.t2:g} s; step {STEP_S * 1e3:g} ms emulated, H = {H}, "
        f"{args.steps} steps; fixed fp32 against --adapt {adapt}; seeds {args.seeds}",
        flush=True,
    )
    results: dict[str, list[tuple[dict, list[dict]]]] = {"fixed": [], "adapt": []}
    loads = []
    with contextlib.ExitStack() as stack:
        base = args.out or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        base.mkdir(parents=True, exist_ok=True)
        pids = stack.enter_context(busy_loops(args.busy))
        if pids:
            print(f"  busy loops: PIDs {', '.join(map(str, pids))}", flush=True)
        topology = base / "drop.toml"
        topology.write_text(TOPOLOGY.format(bw=BW, t1=args.t1, t2=args.t2))
        for seed in seeds:
            for name, spec in (("fixed", None), ("adapt", adapt)):
                setup = {"seed": seed, "adapt": spec, "busy": args.busy, "steps": args.steps, "t": [args.t1, args.t2]}
                run = run_one(base / f"{name}-{seed}", topology, seed, args.steps, spec, setup)
                results[name].append((run, phases(run, args.t1, args.t2)))
                loads += run["load"]
                rounds = round_steps(run)
                print(
                    f"  seed {seed} {name}{' (kept from --out)' if run['kept'] else ''}: {len(run['adapt'])} "
                    f"decisions, wall {run['wall']:.1f} s, rounds' median step {min(rounds):.3f}-{max(rounds):.3f} s, "
                    f"load {run['load'][0]:.1f} before, {run['load'][1]:.1f} after",
                    flush=True,
                )
                for d in decisions(run, args.t1, args.t2):
                    print(
                        f"    step {d['step']} at {d['at']:.1f} s: {d['what']} (planned on {d['bw'] / 1e6:.3g} Mbit/s, "
                        f"step {d['step_s'] * 1e3:.0f} ms)",
                        flush=True,
                    )
    names = ("before the drop", "during the drop (10x less)", "after it")
    emulated = (BW, BW / 10, BW)
    print(f"\n1-min load average before and after each run: {min(loads):.1f}-{max(loads):.1f}")
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
    print(f"\n| run | final val loss ({args.steps} steps) | wall clock (s) |")
    print("|---|---|---|")
    for name, runs in results.items():
        print(f"| {name} | {cell([r['loss'] for r, _ in runs], '{:.4f}')} | {cell([r['wall'] for r, _ in runs])} |")
    print(
        "\n| --adapt, seed | decisions: before the drop / answering it / answering the recovery | went back while the "
        "link was down | worst phase after the lag |"
    )
    print("|---|---|---|---|")
    per_phase, back, worst_late = [], 0, 0.0
    for seed, (run, ph) in zip(seeds, results["adapt"]):
        ds = decisions(run, args.t1, args.t2)
        n = [sum(d["answers"] == i for d in ds) for i in range(3)]
        went_back = sum(d["back"] and (d["phase"] == 1 or d["answers"] == 1) for d in ds)
        late = max((p["exposed_late"] or 0.0) for p in ph)
        per_phase.append(max(n))
        back += went_back
        worst_late = max(worst_late, late)
        print(f"| {seed} | {n[0]} / {n[1]} / {n[2]} | {went_back} | {late:.1f} % |")
    worst = max(
        abs(p[i]["bw"] / emulated[i] - 1)
        for runs in results.values()
        for _, p in runs
        for i in range(3)
        if p[i]["bw"] is not None
    )
    print(
        f"\nestimated bandwidth, worst phase: {100 * worst:.1f} % from the emulated one; --adapt: at most "
        f"{max(per_phase)} decision(s) for a change of the link, {back} going back while it was down, worst phase "
        f"after the lag {worst_late:.1f} % exposed (target {args.target:g} %)"
    )


if __name__ == "__main__":
    main()
