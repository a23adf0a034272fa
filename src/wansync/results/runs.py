"""Training the tables: each is a small experiment (cells x seeds) in `<root>/<table>/`, run with the
experiment runner (a finished run is skipped, so an interrupted `make results` resumes); a cell that two
tables share (the same resolved config) is trained once and copied."""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Sequence

from ..runner import experiments, run
from ..rundir import files
from ..rundir.lock import LOCK_FILE, RunLock
from .. import presets
from ..config import fingerprint
from ..analysis.report import report
from ..net.wan import parse_wan
from ..strategies import resolve_options
from .measures import lm_target, table_context
from .catalog import SEEDS, Table, label

# Cost of one run on 2 idle cores, for sizing and the dry run's estimate: (fixed seconds: 4 worker
# processes start, load the data, evaluate at the end; seconds per step). Measured 2026-11-30 as CPU
# seconds / 2 of a 10-step and a 60-step run of each workload (CNN: per-worker batch 64; the LM:
# batch 8 x 64 tokens, cross-region link), the LM's step cost checked against the demo of 2026-11-29.
# Both with 4 workers: the CPU a step takes grows with the workers that share the cores (2 workers' runs
# of the sparse-demo table took 27-59 s on 2026-12-05, where 4 workers' cost would say 84 s).
COST = MappingProxyType({"vision": (26.0, 0.14 / 64), "lm": (18.0, 0.22)})


def table_specs(table: Table, root: Path, seeds: int = SEEDS, steps: int | None = None) -> list[experiments.RunSpec]:
    """The runs of `table` (none for a table that reads another's), `steps` shortening them (a smoke run)."""
    if table.reads:
        return []
    values = dict(table.values)
    if steps is not None:
        values.update(
            steps=steps,
            eval_every=min(values.get("eval_every", steps), steps),
            warmup_steps=min(values.get("warmup_steps", 0), steps // 5),
        )
    base = presets.layered_config(values, None, {})
    return experiments.grid_runs(base, [], seeds, None, root / table.name, cells=table.cells)


def run_cost(spec: experiments.RunSpec, kind: str) -> float:
    """Estimated seconds of one run of a `kind` table on 2 idle cores (COST, scaled to the run's
    workers). A topology that pads every step to an emulated step time (`[compute] step`) sets the
    floor of a step: its full-speed step, or its slowest worker's where every worker waits for the
    slowest (slow policy `wait`)."""
    fixed, per = COST[kind]
    per_step = (per * spec.cfg.batch_size if kind == "vision" else per) * spec.cfg.workers / 4
    topo = parse_wan(spec.cfg.wan) if spec.cfg.wan else None
    if topo is not None and topo.step_s:
        policy = resolve_options(spec.cfg.strategy, vars(spec.cfg)).get("slow_policy", "wait")
        slowest = max(map(topo.slowdown, range(len(topo.speeds))), default=1.0) if policy == "wait" else 1.0
        per_step = max(per_step, topo.step_s * slowest)
    return fixed + spec.cfg.steps * per_step


def _key(spec: experiments.RunSpec) -> str:
    """What the run computes (its resolved config without out and run-control keys)."""
    return json.dumps(
        fingerprint(spec.cfg, resolve_options(spec.cfg.strategy, vars(spec.cfg))), sort_keys=True, default=str
    )


def table_runs(
    tables: Sequence[Table], root: Path, seeds: int, steps: int | None
) -> list[tuple[Table, list[experiments.RunSpec], list[bool]]]:
    """Per table its runs and, per run, whether an earlier table already trains the same config."""
    seen: set[str] = set()
    out = []
    for t in tables:
        specs = table_specs(t, root, seeds, steps)
        shared = []
        for s in specs:
            k = _key(s)
            shared.append(k in seen)
            seen.add(k)
        out.append((t, specs, shared))
    return out


def command(t: Table, root: Path, seeds: int) -> str:
    """The command that regenerates table `t` (and the page)."""
    return f"wansync results --only {t.reads or t.name}" + (f" --out {root}" if str(root) != "runs/results" else "")


def equivalent_compare(t: Table, root: Path, seeds: int) -> str:
    """The same runs as a plain `wansync compare` (tables built on a preset)."""
    if not t.preset:
        return ""
    flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in t.flags.items())
    strat = f" --strategies {','.join(t.strategies)}" if t.strategies else ""
    return f"wansync compare --preset {t.preset}{strat} --seeds {seeds}{flags} --out {root / (t.reads or t.name)}"


def list_tables(tables: Sequence[Table], root: Path, seeds: int = SEEDS, steps: int | None = None) -> int:
    """List every table, cell and seed with its estimated time; validate every run; train nothing."""
    total, n_runs, n_train, n_finished = 0.0, 0, 0, 0
    for t, specs, shared in table_runs(tables, root, seeds, steps):
        print(f"== {t.name}: {t.title}")
        print(f"   command: {command(t, root, seeds)}")
        if t.reads:
            for c in t.cells:
                lab = label(c["strategy"], **{k: v for k, v in c.items() if k != "strategy"})
                for k in range(seeds):
                    print(f"   reads {root / t.reads / lab / ('seed' + str(t.values.get('seed', 0) + k))}")
            print(f"   no runs of its own (reads {t.reads}); estimated 0 min")
            continue
        experiments.check_and_list(specs, None)
        done = [experiments.is_finished(s) for s in specs]  # skipped by the real run (it resumes)
        cost = sum(run_cost(s, t.kind) for s, dup, fin in zip(specs, shared, done) if not (dup or fin))
        dups, n_done = sum(shared), sum(done)
        print(
            f"   {len(specs)} runs ({len({s.label for s in specs})} cells x {seeds} seeds)"
            + (f", {dups} shared with an earlier table (trained once, copied)" if dups else "")
            + (f", {n_done} finished already" if n_done else "")
            + f"; estimated {cost / 60:.0f} min on 2 idle cores"
        )
        total, n_runs = total + cost, n_runs + len(specs)
        n_train += sum(1 for dup, fin in zip(shared, done) if not (dup or fin))
        n_finished += n_done
    print(
        f"total: {n_runs} runs in {len(tables)} tables, {n_finished} finished, {n_train} to train; estimated "
        f"{total / 60:.0f} min on 2 idle cores (dry run: nothing trained)"
    )
    return 0


def _copy_run(src: Path, dst: Path) -> None:
    files.copy_tree(src, dst, skip=(LOCK_FILE,))


def run_tables(
    tables: Sequence[Table],
    root: Path,
    seeds: int = SEEDS,
    steps: int | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> list[experiments.Outcome]:
    """Train what is not finished (a config shared with an earlier table: copied), report each table.
    Every table's directory is checked before the first run (`experiments.check_experiment`), and
    held (its lock) while it is written."""
    planned = [(t, specs) for t, specs, _ in table_runs(tables, root, seeds, steps) if specs]
    for t, specs in planned:
        experiments.check_experiment(specs, root / t.name, force)
    done: dict[str, experiments.RunSpec] = {}
    outcomes: list[experiments.Outcome] = []
    target = None
    for t, specs in planned:
        out = root / t.name
        with RunLock(run.make_run_dir(out, "experiment directory"), "run results in"):
            experiments.write_experiment(out, specs)
            log(f"== {t.name}: {len(specs)} runs in {out}")
            outcomes += _train_table(specs, done, force, log)
            if t.kind == "lm" and not t.own_target:
                target = target if target is not None else lm_target(root)
            own = table_context(t, root, None)[1] if t.own_target else None
            report(
                out,
                target_loss=own if t.own_target else target if t.kind == "lm" else None,
                record_targets=True,
                force=force,
            )
    return outcomes


def _train_table(
    specs: Sequence[experiments.RunSpec], done: dict[str, experiments.RunSpec], force: bool, log: Callable[[str], None]
) -> list[experiments.Outcome]:
    """One table's runs: trained, or copied from an earlier table's run of the same config (`done`)."""
    outcomes: list[experiments.Outcome] = []
    for spec in specs:
        first = done.get(k := _key(spec))
        if first is not None and experiments.is_finished(first) and (force or not experiments.is_finished(spec)):
            _copy_run(first.run_dir, spec.run_dir)
            log(f"{spec.label} seed {spec.seed}: the same run as {first.run_dir}, copied")
            continue
        outcomes += experiments.execute([spec], force=force, log=log)
        done.setdefault(k, spec)
    return outcomes
