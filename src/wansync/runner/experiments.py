"""A grid of runs -> one run directory per (strategy, setting, seed); resumable.

    OUT/experiment.json                       the grid of runs (labels, settings, seeds, report targets)
    OUT/<strategy>[__key=value...]/seed<k>/   one run directory each (see run.py)
    OUT/summary.csv, runs.csv, report.md, *.png   written by report.py after the runs

Nothing here knows any particular strategy: the list of valid names is the registry
(`wansync.strategies.STRATEGIES`), and each strategy validates its own options.

A run is *finished* when its `summary.json` exists and its `config.toml` equals the config we
would write now (ignoring keys that only change presentation: out, quiet, log_every, tensorboard, threads);
finished runs are skipped unless `force`. A run that fails (a WansyncError from `run.train`) leaves
`failed.json` with the one-line message in its directory and the experiment carries on.

Every input is used or refused: a grid key no strategy of the grid has, a flag the grid also sweeps,
an empty value in a list, --seeds beside --grid seed=... A strategy the grid crosses with an option
it does not have runs once, not once per value. Before the first run, everything the experiment
needs is checked (`check_experiment`: every run's config, data and model; the directory and every run
directory in it are new, empty or wansync's; the report's files there are wansync's, unless `force`),
and the experiment holds its directory's lock to the end (`rundir.lock`).
"""

from __future__ import annotations

import math
import os
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import tomli_w

from ..rundir import files, jsonout
from . import run
from .grid import available_strategies, check_strategies, parse_grid, setting_label, split_values
from .. import strategies as registry
from ..config import Config, check_combinations, check_options_apply, coerce, replace, to_sections
from ..errors import ConfigError, StorageError, WansyncError
from ..strategies.guards import regime_warnings
from .torchrun import TorchrunEnv, torchrun_env
from ..trainer.optim import peak_lr
from ..presets import Preset, check_available, layered_config, preset_cells
from ..analysis.report import Report, report
from ..rundir.layout import (
    CONFIG_FILE,
    EXPERIMENT_FILE,
    FAILED_FILE,
    REPORT_FILES,
    SUMMARY_FILE,
    has_summary,
    is_experiment_dir,
    json_object,
    read_summary,
    regular_text,
)
from ..rundir.lock import LOCK_FILE, RunBusy, RunLock
from ..rundir.owned import WRITTEN_FILE, check_replaceable
from ..rules import in_range

# Keys that change how a run is shown or where it lives, not what it computes.
PRESENTATION_KEYS = ("out", "quiet", "log_every", "tensorboard", "threads", "target_loss", "target_acc")
MAX_SEEDS = 1000
MAX_RUNS = 10_000  # runs of one grid: more is a typo, and would take memory before any work


@dataclass
class RunSpec:
    strategy: str
    setting: dict[str, Any]  # grid values other than strategy and seed, in grid order
    seed: int
    cfg: Config
    label: str  # "<strategy>[__key=value...]": one setting, all seeds
    run_dir: Path

    def describe(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "strategy": self.strategy,
            "setting": self.setting,
            "seed": self.seed,
            "dir": str(self.run_dir),
        }


@dataclass
class Outcome:
    spec: RunSpec
    status: str  # "ok" | "skipped" | "failed"
    message: str = ""
    seconds: float = 0.0
    summary: dict[str, Any] | None = field(default=None, repr=False)


# ---------------------------------------------------------------- the grid of runs


def command_runs(
    command: str,
    preset: Preset | None,
    config_file: str | None,
    flags: Mapping[str, Any],
    grid_items: Sequence[str],
    strategies_text: str | None,
    seeds: int | None,
    parallel: int,
    given: Iterable[str] = (),
) -> tuple[list[RunSpec], Path, TorchrunEnv | None]:
    """The runs of `wansync compare|sweep` from its flags, the experiment directory, and the torchrun
    environment the runs adopt (read once, here: a stale or contradicting one is refused).

    Values: defaults < preset < --config file < flags; the runs: the preset's cells, else
    --strategies (or the preset's strategies) x --grid x seeds. `given`: the keys the user gave
    (flags, the config file's), each of which some run must use."""
    lowest: dict[str, Any] = {"out": f"runs/{preset.name if preset else command}"}
    if preset:
        lowest.update(preset.values)
    cfg = layered_config(lowest, config_file, flags)
    check_combinations(cfg, flags)
    env = torchrun_env(cfg.workers if "workers" in flags else None, cfg.ranks_per_worker)
    grid = parse_grid(grid_items)
    check_inputs_used(grid, flags, strategies_text, seeds)
    wanted = split_values(strategies_text, "--strategies") if strategies_text is not None else None
    cells = preset_cells(preset, grid, flags, wanted)
    if cells is not None:
        names = list(dict.fromkeys(c["strategy"] for c in cells))
    elif wanted is not None:
        names = wanted
    elif preset:
        names = list(preset.strategies)
    elif command == "compare" and "strategy" not in grid:
        raise ConfigError(f"compare needs --strategies A,B,... (available: {', '.join(available_strategies())})")
    else:
        names = [cfg.strategy]
    if preset and "strategy" not in grid:
        check_available(preset, names)
    if command == "sweep" and not grid and cells is None:
        raise ConfigError("sweep needs at least one --grid KEY=V1,V2 (any config key)")
    if seeds is None:
        seeds = preset.seeds if preset else 1
    if parallel < 1:
        raise ConfigError(f"--parallel must be >= 1, got {parallel}")
    threads = None
    if parallel > 1 and not cfg.threads:
        threads = default_threads(parallel, cfg.workers)
    if parallel > 1:
        cfg = replace(cfg, quiet=True)
    out = Path(cfg.out)
    specs = grid_runs(cfg, names, seeds, grid, out, threads=threads, cells=cells)
    check_options_apply([s.cfg for s in specs], [*given, *grid])
    return specs, out, env


def check_inputs_used(
    grid: Mapping[str, Any], flags: Mapping[str, Any], strategies_text: str | None, seeds: int | None
) -> None:
    """Two inputs one of which would be dropped without a word: refused in one line."""
    if strategies_text is not None and ("strategy" in grid or "strategy" in flags):
        raise ConfigError(
            "--strategies and --"
            + ("grid strategy=..." if "strategy" in grid else "strategy")
            + " both name the strategies: give one of them"
        )
    if seeds is not None and "seed" in grid:
        raise ConfigError("--seeds and --grid seed=... both set the seeds: give one of them")
    clash = [k for k in grid if k in flags]
    if clash:
        raise ConfigError(
            f"--{clash[0].replace('_', '-')} is also swept by --grid {clash[0]}=...: give its values "
            f"in the grid only"
        )


def grid_runs(
    base: Config,
    strategies: Sequence[str],
    seeds: int | Sequence[int] = 1,
    grid: dict[str, list[Any]] | None = None,
    out: str | Path | None = None,
    threads: int | None = None,
    cells: Sequence[dict[str, Any]] | None = None,
) -> list[RunSpec]:
    """Every (strategy, setting, seed) as a RunSpec; nothing is written.

    `cells` (a preset's explicit list of runs, each a dict of config values with a "strategy") replaces
    `strategies`: every cell is one setting, crossed with `grid` (whose keys win over the cell's)."""
    grid = dict(grid or {})
    out = Path(out if out is not None else base.out)
    if "strategy" in grid:
        strategies = [str(s) for s in grid.pop("strategy")]
        cells = None
    if cells is not None:
        combos = expand_cells(cells, grid)
        check_strategies(list(dict.fromkeys(s for s, _ in combos)))
    else:
        combos = [(s, {}) for s in check_strategies(strategies)]
    if "seed" in grid:
        seed_list = [int(s) for s in grid.pop("seed")]
    elif isinstance(seeds, int):
        in_range(1, MAX_SEEDS, high_included=True)("seeds", seeds)
        seed_list = [base.seed + k for k in range(seeds)]
    else:
        seed_list = list(seeds)
    n_runs = len(combos) * math.prod(len(v) for v in grid.values()) * len(seed_list)
    if n_runs > MAX_RUNS:
        raise ConfigError(f"the grid has {n_runs} runs, more than {MAX_RUNS}: sweep fewer values at once")
    settings: list[dict[str, Any]] = [{}]
    for key, values in grid.items():
        settings = [{**s, key: v} for s in settings for v in values]
    specs: list[RunSpec] = []
    seen: dict[Path, str] = {}
    for strategy, fixed in combos:
        for setting in [{**fixed, **s} for s in own_settings(strategy, settings)]:
            label = setting_label(strategy, setting)
            for seed in seed_list:
                run_dir = out / label / f"seed{seed}"
                if run_dir in seen:
                    raise ConfigError(f"two runs would share the directory {run_dir}; rename a grid value")
                seen[run_dir] = label
                changes: dict[str, Any] = {**setting, "strategy": strategy, "seed": seed, "out": str(run_dir)}
                if threads is not None:
                    changes["threads"] = threads
                try:
                    cfg = replace(base, **changes)
                except WansyncError as e:
                    raise ConfigError(f"{label} seed {seed}: {e}") from None
                specs.append(RunSpec(strategy, setting, seed, cfg, label, run_dir))
    return specs


def own_settings(strategy: str, settings: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The grid's settings as `strategy` runs them: values of other strategies' options dropped, the
    settings that become the same merged (ddp in a grid over sync_every runs once)."""
    own = set(registry.option_names(strategy))
    out: list[dict[str, Any]] = []
    for s in settings:
        kept = {k: v for k, v in s.items() if k not in registry.OPTIONS or k in own}
        if kept not in out:
            out.append(kept)
    return out


def expand_cells(
    cells: Sequence[dict[str, Any]], grid: dict[str, list[Any]] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """[(strategy, the cell's other values)], keys that `grid` sweeps dropped, duplicates merged."""
    out: list[tuple[str, dict[str, Any]]] = []
    for cell in cells:
        if "strategy" not in cell:
            raise ConfigError(f"a run cell must name its strategy: {cell}")
        item = (
            str(cell["strategy"]),
            {k: coerce(k, v) for k, v in cell.items() if k != "strategy" and k not in (grid or {})},
        )
        if item not in out:
            out.append(item)
    return out


# ---------------------------------------------------------------- resume


def _comparable(sections: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, sec in sections.items():
        for k, v in sec.items() if isinstance(sec, dict) else ():
            if k not in PRESENTATION_KEYS:
                flat[f"{name}.{k}"] = v
    return flat


def is_finished(spec: RunSpec) -> bool:
    """summary.json present and config.toml equal to the config this grid would write."""
    d = spec.run_dir
    if not has_summary(d) or not (d / "config.toml").is_file() or (d / FAILED_FILE).exists():
        return False
    try:
        options = registry.resolve_options(spec.cfg.strategy, vars(spec.cfg))
        expected = tomllib.loads(tomli_w.dumps(to_sections(spec.cfg, options)))
        found = tomllib.loads(regular_text(d / CONFIG_FILE))
    except (WansyncError, tomllib.TOMLDecodeError, OSError):
        return False
    return _comparable(expected) == _comparable(found)


# ---------------------------------------------------------------- running


def write_experiment(out: Path, specs: Sequence[RunSpec], extra: dict[str, Any] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    previous = read_experiment(out)
    data = {"runs": [{**s.describe(), "dir": os.path.relpath(s.run_dir, out)} for s in specs], **(extra or {})}
    # keep the entries of earlier grids whose directories are not in this one (their runs stay on disk)
    mine = {r["dir"] for r in data["runs"]}
    data["runs"] += [r for r in previous.get("runs", []) if r.get("dir") not in mine]
    files.write_text(out / EXPERIMENT_FILE, jsonout.dumps(data, indent=2))


def read_experiment(out: Path) -> dict[str, Any]:
    return json_object(Path(out) / EXPERIMENT_FILE)


def run_one(spec: RunSpec, force: bool = False, torchrun: TorchrunEnv | None = None) -> Outcome:
    if not force and is_finished(spec):
        summary = read_summary(spec.run_dir)
        return Outcome(spec, "skipped", summary=summary)
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    (spec.run_dir / FAILED_FILE).unlink(missing_ok=True)
    t0 = time.monotonic()
    try:
        summary = run.train(spec.cfg, force=True, torchrun=torchrun)  # the experiment decided to (re-)run it
    except RunBusy as e:  # another process's run: nothing of it is touched
        return Outcome(spec, "failed", str(e), time.monotonic() - t0)
    except WansyncError as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        (spec.run_dir / SUMMARY_FILE).unlink(missing_ok=True)
        files.write_text(
            spec.run_dir / FAILED_FILE,
            jsonout.dumps({**spec.describe(), "status": "failed", "message": message}, indent=2),
        )
        return Outcome(spec, "failed", message, time.monotonic() - t0)
    return Outcome(spec, "ok", "", time.monotonic() - t0, summary)


def default_threads(parallel: int, workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, parallel * workers))


def execute(
    specs: Sequence[RunSpec],
    *,
    force: bool = False,
    parallel: int = 1,
    log: Callable[[str], None] = print,
    torchrun: TorchrunEnv | None = None,
) -> list[Outcome]:
    """Run every spec (one at a time unless parallel > 1), on local workers or under `torchrun`'s
    ranks; never raises for a failed run."""
    n = len(specs)
    if parallel < 1:
        raise ConfigError(f"parallel must be >= 1, got {parallel}")

    def one(i_spec: tuple[int, RunSpec]) -> Outcome:
        i, spec = i_spec
        tag = f"[{i + 1}/{n}] {spec.label} seed {spec.seed}:"
        if parallel == 1 and (force or not is_finished(spec)):
            log(f"{tag} training in {spec.run_dir}")
        o = run_one(spec, force, torchrun)
        if o.status == "skipped":
            log(f"{tag} finished earlier, skipped (--force re-runs it)")
        elif o.status == "failed":
            log(f"{tag} FAILED after {o.seconds:.0f} s: {o.message}")
        else:
            log(f"{tag} done in {o.seconds:.0f} s")
        return o

    if parallel == 1:
        return [one(x) for x in enumerate(specs)]
    pool = ThreadPoolExecutor(max_workers=parallel)
    try:
        return list(pool.map(one, enumerate(specs)))
    finally:  # on a signal, do not wait for the runs in flight (their workers die with us)
        pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------- the commands' output


def _lr_rule(c: Config) -> str:
    if c.lr_scaling == "linear":
        return f"lr {peak_lr(c, c.workers):g} = {c.lr:g} x {c.workers * c.batch_size}/256 (linear scaling)"
    return f"lr {c.lr:g} (fixed)"


def check_experiment(specs: Sequence[RunSpec], out: Path, force: bool, local: bool = True) -> None:
    """Before any work, without writing anything: every run can start (`run.check_run`; `local`: on
    this machine's processes), the experiment directory is new, empty or wansync's, every run
    directory in it too, and the report's files there are wansync's (unless `force`). One line on the
    first problem."""
    check_runs(specs, local)
    try:
        check_experiment_dir(out, specs, force)
    except OSError as e:  # a name too long, a path through a file
        raise StorageError(f"cannot create experiment directory {out}: {e.strerror or e}") from None


def check_runs(specs: Sequence[RunSpec], local: bool = True) -> None:
    """Every run can start (`run.check_run`; `local`: on this machine's processes), or one line
    naming the first that cannot."""
    for s in specs:
        try:
            run.check_run(s.cfg)
            if local:
                run.check_local_launch(s.cfg)
        except WansyncError as e:
            raise ConfigError(f"{s.label} seed {s.seed}: {e}") from None


def check_experiment_dir(out: Path, specs: Sequence[RunSpec], force: bool) -> None:
    """`out` is new, empty or a wansync experiment; each run directory in it is new, empty or a
    wansync run; the report's files there are wansync's (unless `force`)."""
    if os.path.lexists(out) and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    if out.is_dir() and not is_experiment_dir(out):
        entries = sorted(p.name for p in out.iterdir() if p.name not in (LOCK_FILE, WRITTEN_FILE))
        if entries:
            raise ConfigError(
                f"refusing to run an experiment in {out}: it is not empty and not a wansync experiment "
                f"directory (it holds {entries[0]!r}); choose another --out"
            )
    for s in specs:
        run.check_target(s.run_dir, force=True)
    if out.is_dir():
        check_replaceable(out, REPORT_FILES, force)


def check_and_list(
    specs: Sequence[RunSpec], preset: Preset | None, out: Path | None = None, force: bool = False
) -> int:
    """Print the resolved runs and validate each one; train nothing. Raises when one is invalid, or
    (given `out`) when the experiment could not start there (`check_experiment`)."""
    if preset:
        print(f"preset {preset.name}: {preset.source}")
        for note in preset.notes:
            print(f"  note: {note}")
    c = specs[0].cfg
    print(
        f"{len(specs)} runs: model {c.model}, data {c.data}, {c.workers} workers, wan {c.wan or 'none'}, "
        f"{c.steps} steps, batch {c.batch_size}/worker, {c.optimizer} {_lr_rule(c)}"
    )
    errors = []
    for s in specs:
        try:
            options = run.check_run(s.cfg)
            status = (
                "ok  " + (", ".join(f"{k}={v}" for k, v in options.items()) or "(no options)") + f"; {_lr_rule(s.cfg)}"
            )
            warnings = regime_warnings(s.cfg.strategy, options, steps=s.cfg.steps)
        except WansyncError as e:
            errors.append(f"{s.label} seed {s.seed}: {e}")
            status, warnings = f"INVALID: {e}", []
        print(f"  {s.run_dir}  {status}")
        for line in warnings:
            print(f"    warning: {line}")
    if errors:
        raise WansyncError(f"{len(errors)} of {len(specs)} runs are invalid; first: {errors[0]}")
    if out is not None:
        check_experiment(specs, out, force)
    print(f"all {len(specs)} runs are valid (dry run: nothing trained)")
    return 0


def run_and_report(
    specs: Sequence[RunSpec],
    out: Path,
    force: bool,
    parallel: int,
    target_loss: float | None,
    target_acc: float | None,
    target_rule: str = "ddp",
    torchrun: TorchrunEnv | None = None,
    extra: dict[str, Any] | None = None,
) -> int:
    """Write the grid (experiment.json), run what is not finished, write the report and print its table.
    `target_rule`: the default target when none is given (report.default_target); `extra`: more for
    experiment.json (the demo's recorded spread of seeds, `analysis.verdict.recorded_spread`).
    Raises (after the report) when a run failed. Under torchrun the ranks train every run together and
    rank 0 alone holds the directory and writes the experiment's files, as it does a run's."""
    if torchrun is not None and torchrun.rank != 0:  # rank 0 checks the directory it writes
        check_runs(specs, local=False)
        failed = [o for o in execute(specs, force=force, parallel=parallel, torchrun=torchrun) if o.status == "failed"]
        if failed:
            raise WansyncError(f"{failed[0].spec.label} seed {failed[0].spec.seed}: {failed[0].message}")
        return 0
    check_experiment(specs, out, force, local=torchrun is None)
    with RunLock(run.make_run_dir(out, "experiment directory"), "run an experiment in"):
        write_experiment(
            out,
            specs,
            {"target_loss": target_loss, "target_acc": target_acc, "target_rule": target_rule, **(extra or {})},
        )
        t0 = time.monotonic()
        outcomes = execute(specs, force=force, parallel=parallel, torchrun=torchrun)
        rep = report(
            out,
            target_loss=target_loss,
            target_acc=target_acc,
            record_targets=True,
            target_rule=target_rule,
            force=force,
        )
    print_outcome(rep, outcomes, time.monotonic() - t0)
    return 0


def print_outcome(rep: Report, outcomes: Sequence[Outcome], seconds: float) -> None:
    """The report's table, what ran, warnings, the decision and the verdict; raises when a run failed."""
    ran = sum(o.status == "ok" for o in outcomes)
    skipped = sum(o.status == "skipped" for o in outcomes)
    failed = [o for o in outcomes if o.status == "failed"]
    print()
    print(rep.table)
    print()
    print(f"{ran} runs trained, {skipped} skipped (finished earlier), {len(failed)} failed, in {seconds:.0f} s")
    for row in rep.rows:
        if row["diverged"]:
            print(
                f"warning: {row['setting']} diverged in {row['diverged']}/{row['seeds_ok']} seeds (final "
                f"{rep.quality.name} worse than at the first evaluation, or at chance)"
            )
    print(f"report: {rep.path}")
    if len(rep.rows) > 1:
        print()
        print(rep.decision)
        print()
        print(rep.verdict)
    if failed:
        raise WansyncError(
            f"{len(failed)} of {len(outcomes)} runs failed (marked in {rep.path}); "
            f"first: {failed[0].spec.label} seed {failed[0].spec.seed}: {failed[0].message}"
        )
