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

``--ranked`` holds `wansync plan --strategies all` to the emulator instead: the tiny LM at 4 workers on
``RANKED_WAN``, every strategy at the settings the plan chose for it (`planner.choose`), each run for
``--steps`` steps (default 100) under `ws.Run` in one group of 4 ranks (`ranked_rows`, which
tests/test_planner_validation.py runs at 100 steps), and the plan's whole-run wall clock (warm-up, last
partial round and `finish()` included) against the run's, from the run's own step times.

Default subset (about 4 min on 2 idle cores, 30 shared with other jobs): tiny LM, 2 workers, every preset, ddp / diloco /
streaming / cocodc; plus 4 workers under cross-region for every other strategy. ``--full`` runs
tiny and small, 2/4/8 workers, every preset, every strategy; ``--models``, ``--workers``, ``--presets``
and ``--strategies`` (comma-separated) run that part of the full grid; ``--codec int8`` (bf16, fp4) has
every strategy but ddp exchange compressed (the planner is told the same). Each run's checkpoints are
deleted once its profile is read (the rest of its directory stays under ``--out``).

    python benchmarks/planner_validation.py [--full | --models small --workers 2,8 ...] [--out runs/bench_planner]
    python benchmarks/planner_validation.py --ranked [--steps 300] [--out runs/bench_planner]   # into runs/bench_planner_ranked300
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
from wansync.planner.choose import choose, rank
from wansync.planner.measure import run_step_times
from wansync.planner.memory import DEFAULT_GPU_MEMORY
from wansync.planner.prediction import run_trace
from wansync.planner.simulate import transfer_seconds
from wansync.strategies import STRATEGIES, option_names

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


# --ranked: a link of two sites whose modelled exchanges of the tiny LM (7.3 MB) take several times what
# the real gloo collective of 4 ranks takes on this 2-core host (15-25 ms), so that the emulator's
# max(real, modelled) is the modelled time the plan predicts; a sequence of 8 tokens per rank and SGD
# (DeMo's inner optimizer; the cheapest step, which the plan is given as measured).
RANKED_WAN = "rtt=4ms,bw=2gbit,sites=2"
RANKED_WORKERS, RANKED_BATCH, RANKED_SEQ = 4, 1, 8
# The plan chooses the settings for this step time (`--step-time`; the runs' own then predict them), and
# post-local SGD switches after 20 steps (`--switch-step 20`: a knob given, kept), so that a 100-step run
# has exchanges to predict beyond its DDP phase.
RANKED_STEP_S = 0.01
RANKED_GIVEN = {"switch_step": 20}


def ranked_plan(steps: int, wan: str = RANKED_WAN, model: str = "tiny") -> list[tuple[str, dict]]:
    """`wansync plan --model tiny --workers 4 --wan WAN --strategies all --steps N --step-time 0.01
    --switch-step 20`: every strategy with the knobs chosen or given for it, best first."""
    size, topology = of_name(model), parse_wan(wan)
    chosen = []
    for name in STRATEGIES:
        given = {k: v for k, v in RANKED_GIVEN.items() if k in option_names(name)}
        s = setting(name, given, size, RANKED_WORKERS, topology, RANKED_STEP_S)
        chosen.append(choose(s, DEFAULT_GPU_MEMORY, steps=steps, given=frozenset(given)))
    return [
        (c.strategy, {k: v for k, v in c.prediction.setting.options.items() if k in {*c.searched, *RANKED_GIVEN}})
        for c in rank(chosen)
    ]


def ranked_rank(rank_: int, world: int, runs: list, steps: int, wan: str, root: str) -> None:
    """One rank of the ranked validation: each (strategy, knobs) of `runs` in turn, `steps` steps of the
    tiny LM on random tokens under `ws.Run` (its profile is what the plan is held to), then `finish()`."""
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import wansync as ws
    from wansync import net
    from wansync.workloads.lm.model import TransformerLM, lm_shape

    group = dist.new_group(backend=net.install(), pg_options=net.Emulator(parse_wan(wan), seed=0))
    warnings.simplefilter("ignore")  # the regime guards (a short run's settings, on purpose), the missing evaluation
    for name, knobs in runs:
        torch.manual_seed(0)
        model = TransformerLM(lm_shape("tiny"), 256)
        sync = ws.strategy(name, model, torch.optim.SGD(model.parameters(), lr=1e-3), group=group, **knobs)
        tokens = torch.Generator().manual_seed(rank_)
        with ws.Run(sync, out=f"{root}/{name}", steps=steps, quiet=True, log_every=steps, wan=wan) as run:
            for _ in range(steps):
                x = torch.randint(0, 256, (RANKED_BATCH, RANKED_SEQ + 1), generator=tokens)
                loss = F.cross_entropy(sync.model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
                loss.backward()
                sync.step()
                sync.zero_grad()
                run.log(loss, items=RANKED_BATCH)
            sync.finish()


def ranked_rows(steps: int, out: Path, runs: list[tuple[str, dict]] | None = None, wan: str = RANKED_WAN) -> list[dict]:
    """The plan's choices (`runs`: some of `ranked_plan`'s; all by default) run under the emulator
    (`ranked_rank`), then each predicted for the run's own compute: with identical workers (the run's
    mean per step) and replayed (every rank's own steps)."""
    from wansync.runner.localgroup import run_ranks

    runs = ranked_plan(steps, wan) if runs is None else runs
    run_ranks(ranked_rank, RANKED_WORKERS, runs, steps, wan, str(out), timeout=60 + 3 * steps * len(runs))
    rows = []
    for name, knobs in runs:
        run_dir = out / name
        prof = json.loads((run_dir / "profile.json").read_text())
        cats = prof["categories_s"]
        s = setting(
            name,
            knobs,
            of_name("tiny"),
            RANKED_WORKERS,
            parse_wan(wan),
            cats["compute"] / steps,
            other_s=(cats["data"] + cats["sync_math"]) / steps,
        )
        once = cats["eval"] + cats["checkpoint"] + cats["other"]
        row = {"strategy": name, "knobs": knobs, "steps": steps, "wall_s": prof["wall_clock_s"]}
        replayed = dataclasses.replace(s, step_times=run_step_times(run_dir))
        for key, setting_ in (("identical", s), ("replayed", replayed)):
            p = predict(setting_, steps=steps, finish=True)
            row[f"{key}_s"] = p.wall_s + once
            row[f"{key}_err_pct"] = 100 * (row[f"{key}_s"] - row["wall_s"]) / row["wall_s"]
        row["steady_s"] = predict(s).wall_per_1000_s * steps / 1000 + once  # the plan's answer before --steps
        row["steady_err_pct"] = 100 * (row["steady_s"] - row["wall_s"]) / row["wall_s"]
        rows.append(row)
    return rows


def main_ranked(steps: int, out: Path) -> None:
    t0 = time.monotonic()
    print(
        f"load average at start: {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} CPUs; tiny LM, "
        f"{RANKED_WORKERS} workers, --wan {RANKED_WAN}, {steps} steps"
    )
    print(
        "| strategy | settings chosen | emulated wall s | whole run planned: identical / replayed | error % "
        "| identical, steady state x steps / 1000 | error % |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in ranked_rows(steps, out):
        knobs = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in r["knobs"].items()) or "-"
        print(
            f"| {r['strategy']} | {knobs} | {r['wall_s']:.2f} | {r['identical_s']:.2f} / {r['replayed_s']:.2f} "
            f"| {r['identical_err_pct']:+.1f} / {r['replayed_err_pct']:+.1f} | {r['steady_s']:.2f} "
            f"| {r['steady_err_pct']:+.1f} |",
            flush=True,
        )
    print(f"\n{time.monotonic() - t0:.0f} s; load average at end: {os.getloadavg()[0]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--ranked", action="store_true", help="hold `plan --strategies all` to emulated runs (tiny LM, 4 workers)"
    )
    ap.add_argument("--steps", type=int, default=100, help="--ranked: steps per run (default 100)")
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
    if args.ranked:
        main_ranked(args.steps, Path(f"{args.out}_ranked{args.steps}"))
        return
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
