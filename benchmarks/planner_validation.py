"""The planner against emulated runs: predicted vs measured wall clock and exposed communication.

Each row runs ``wansync train`` (a short run under the WAN emulator) and reads its ``profile.json``,
then asks the planner to predict the same run: the same strategy and knobs, model, workers and link,
simulated step by step for the run's steps plus ``finish()``. To test the communication model and not
the step time, the planner is given the run's own measured compute per step (the profile's
``compute``), its other per-step work (``data`` + ``sync_math``), and its one-off costs (``eval``,
``checkpoint``, ``other``). Tolerance: wall clock within 10 %, exposed communication within 2
percentage points. The modelled communication seconds of the emulator's records and of the planner's
schedule are printed side by side (they differ only if the planner's schedule or bytes do).

Two predictions per row. "identical": the planner's default, every worker taking the run's mean
compute per step and arriving at each exchange together. "replayed": every rank's own step times
from the run (`logs/profile_rank<R>.json`, `steps_s`; `wansync plan --step-times RUN`), so that the
workers arrive apart as they did, and an early one waits for the straggler and then for the transfer,
as on the emulator, which starts a collective when its last member is ready. On this 2-core host the
ranks take turns arriving late, so "identical" misses by the time rank 0 waited for its peer; the last
two columns show that wait, measured without any model (`derived.peer_wait_pct` of profile.json,
`wansync.telemetry.peerwait`: per step, rank 0's blocked time beyond the least any rank was blocked),
and the identical prediction's error against the measured share less it.

Default subset (about 4 min on 2 idle cores, 30 shared with other jobs): tiny LM, 2 workers, every preset, ddp / diloco /
streaming / cocodc; plus 4 workers under cross-region for every other strategy. ``--full`` runs
tiny and small, 2/4/8 workers, every preset, every strategy; ``--models``, ``--workers``, ``--presets``
and ``--strategies`` (comma-separated) run that part of the full grid; ``--codec int8`` (bf16, fp4) has
every strategy but ddp exchange compressed (the planner is told the same). Each run's checkpoints are
deleted once its profile is read (the rest of its directory stays under ``--out``).

    python benchmarks/planner_validation.py [--full | --models small --workers 2,8 ...] [--out runs/bench_planner]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from wansync.net.wan import PRESETS, parse_wan
from wansync.planner import of_name, predict, setting
from wansync.planner.measure import run_step_times
from wansync.planner.predict import run_trace
from wansync.planner.simulate import transfer_seconds
from wansync.strategies import STRATEGIES

STEPS = 30
COMMON = [
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
]
KNOBS = {
    "ddp": {},
    "local_sgd": {"sync_every": 5},
    "slowmo": {"sync_every": 5},
    "cpdp": {"sync_every": 5},
    "post_local_sgd": {"sync_every": 5, "switch_step": 10},
    "diloco": {"sync_every": 10},
    "streaming": {"sync_every": 10, "fragments": 2, "overlap": 2},
    "cocodc": {"sync_every": 10, "fragments": 2, "overlap": 2},
    "sparseloco": {"sync_every": 10},
    "demo": {},
}
FOUR = ("ddp", "diloco", "streaming", "cocodc")


def grid(
    full: bool,
    models: str | None = None,
    workers: str | None = None,
    presets: str | None = None,
    strategies: str | None = None,
) -> list[tuple[str, int, str, str]]:
    """The default subset, the full grid, or the grid of the given comma-separated lists (each
    defaulting to the full grid's)."""
    if full or any((models, workers, presets, strategies)):

        def pick(given: str | None, every) -> list[str]:
            return [v.strip() for v in given.split(",")] if given else [str(v) for v in every]

        return list(
            itertools.product(
                pick(models, ("tiny", "small")),
                map(int, pick(workers, ("2", "4", "8"))),
                pick(presets, PRESETS),
                pick(strategies, STRATEGIES),
            )
        )
    rows = list(itertools.product(("tiny",), (2,), PRESETS, FOUR))
    return rows + [("tiny", 4, "cross-region", s) for s in STRATEGIES if s not in FOUR]


def run_one(model: str, workers: int, preset: str, strategy: str, out: Path, codec: str = "fp32") -> dict:
    knobs = {**KNOBS[strategy], **({"codec": codec} if codec != "fp32" and strategy != "ddp" else {})}
    run_dir = out / (f"{model}-{workers}-{preset}-{strategy}" + ("" if codec == "fp32" else f"-{codec}"))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in knobs.items()]
    cmd = [
        sys.executable,
        "-m",
        "wansync",
        "train",
        "--strategy",
        strategy,
        "--model",
        model,
        "--wan",
        preset,
        "--workers",
        str(workers),
        "--steps",
        str(STEPS),
        "--out",
        str(run_dir),
        *COMMON,
        *flags,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    prof = json.loads((run_dir / "profile.json").read_text())
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # 8 small-LM workers: ~2 GB a run
    cats = prof["categories_s"]
    s = setting(
        strategy,
        knobs,
        of_name(model),
        workers,
        parse_wan(preset),
        cats["compute"] / STEPS,
        other_s=(cats["data"] + cats["sync_math"]) / STEPS,
    )
    once = cats["eval"] + cats["checkpoint"] + cats["other"]
    out = {
        "wall_s": prof["wall_clock_s"],
        "exposed_pct": prof["derived"]["exposed_comm_pct"],
        "modelled_s": prof["derived"]["comm_modelled_s"],
        "pred_modelled_s": sum(
            map(transfer_seconds(s.topology, workers), run_trace(s, STEPS, finish=True).transfers())
        ),
        "wait_pp": prof["derived"].get("peer_wait_pct", 0.0),
    }
    replayed = dataclasses.replace(s, step_times=run_step_times(run_dir))
    for key, setting_ in (("link", s), ("replay", replayed)):
        tl = predict(setting_, steps=STEPS, finish=True).timeline
        out[f"{key}_wall_s"] = tl.wall_s + once
        out[f"{key}_exposed_pct"] = 100 * tl.exposed_s / (tl.wall_s + once)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the full grid (hours on 2 cores)")
    ap.add_argument("--models", help="a grid of these models (comma-separated; tiny, small)")
    ap.add_argument("--workers", help="... of these worker counts (e.g. 2,8)")
    ap.add_argument("--presets", help="... under these link presets")
    ap.add_argument("--strategies", help="... of these strategies")
    ap.add_argument(
        "--codec", default="fp32", help="every strategy but ddp exchanges with this codec (int8, bf16, fp4)"
    )
    ap.add_argument("--out", default="runs/bench_planner")
    args = ap.parse_args()
    out = Path(args.out)
    t0 = time.monotonic()
    print(f"load average at start: {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} CPUs; steps {STEPS}")
    print(
        "| model | workers | link | strategy | wall s | predicted: identical / replayed | error % | exposed % "
        "| predicted: identical / replayed | diff pp | within (identical / replayed) "
        "| modelled comm s: emulator / planner | peer wait pp | diff pp without the peer wait |"
    )
    print("|" + "---|" * 12)
    ok = ok_replay = total = ok_wait = 0
    for model, workers, preset, strategy in grid(args.full, args.models, args.workers, args.presets, args.strategies):
        r = run_one(model, workers, preset, strategy, out, args.codec)
        head = f"| {model} | {workers} | {preset} | {strategy}{'' if args.codec == 'fp32' else '+' + args.codec} "
        if "error" in r:
            print(head + f"| failed: {r['error']} |", flush=True)
            continue
        err = {k: 100 * (r[f"{k}_wall_s"] - r["wall_s"]) / r["wall_s"] for k in ("link", "replay")}
        diff = {k: r[f"{k}_exposed_pct"] - r["exposed_pct"] for k in ("link", "replay")}
        good = {k: abs(err[k]) <= 10 and abs(diff[k]) <= 2 for k in ("link", "replay")}
        ok, ok_replay, total = ok + good["link"], ok_replay + good["replay"], total + 1
        unwaited = diff["link"] + r["wait_pp"]  # identical workers against the measured share less rank 0's peer wait
        ok_wait += abs(err["link"]) <= 10 and abs(unwaited) <= 2
        print(
            head + f"| {r['wall_s']:.1f} | {r['link_wall_s']:.1f} / {r['replay_wall_s']:.1f} | "
            f"{err['link']:+.1f} / {err['replay']:+.1f} | {r['exposed_pct']:.1f} | {r['link_exposed_pct']:.1f} / "
            f"{r['replay_exposed_pct']:.1f} | {diff['link']:+.1f} / {diff['replay']:+.1f} | "
            f"{'yes' if good['link'] else 'NO'} / {'yes' if good['replay'] else 'NO'} | "
            f"{r['modelled_s']:.3f} / {r['pred_modelled_s']:.3f} | {r['wait_pp']:.1f} | {unwaited:+.1f} |",
            flush=True,
        )
    print(
        f"\nwithin tolerance (wall 10 %, exposed 2 pp): {ok_replay} of {total} rows with every rank's step times "
        f"replayed; {ok} of {total} with identical workers, {ok_wait} of {total} of those against the measured "
        f"share less rank 0's peer wait; {time.monotonic() - t0:.0f} s; "
        f"load average at end: {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
