"""Command-line parsing only: every Config key is a flag (`sync_every` -> `--sync-every`)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Sequence

from . import __version__
from .config import Config, base_type, build_config, load_toml, replace
from .errors import ConfigError, WansyncError
from .interrupts import Terminated, exit_now, exit_status, sigterm_raises


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not a usage wall
        self.exit(2, f"wansync: error: {message} (see '{self.prog} --help')\n")


def add_config_flags(p: argparse.ArgumentParser, skip: Sequence[str] = ()) -> None:
    p.add_argument("--config", metavar="FILE.toml", help="TOML config file (flags override it)")
    groups: dict[str, Any] = {}
    for f in fields(Config):
        if f.name in skip:
            continue
        sec = f.metadata["section"]
        g = groups.setdefault(sec, p.add_argument_group(f"[{sec}]"))
        flag = "--" + f.name.replace("_", "-")
        t = base_type(f.name)
        if t is bool:
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=f.metadata["help"])
        else:
            g.add_argument(flag, dest=f.name, type=str, default=None, metavar=t.__name__.upper(),
                           help=f.metadata["help"])


def config_from_args(args: argparse.Namespace) -> Config:
    overrides = {f.name: getattr(args, f.name) for f in fields(Config)
                 if getattr(args, f.name, None) is not None}
    return build_config(getattr(args, "config", None), overrides)


def _add_experiment_flags(p: argparse.ArgumentParser, what: str) -> None:
    e = p.add_argument_group(what)
    e.add_argument("--strategies", metavar="A,B,...", help="strategies to run side by side (registry names)")
    e.add_argument("--seeds", type=int, default=None, metavar="N", help="seeds per setting: seed, seed+1, ... "
                   "(default 1, or the preset's)")
    e.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="sweep a config key over values (repeatable; ';' separates values that contain commas)")
    e.add_argument("--preset", metavar="NAME", help="a paper's setting: " + ", ".join(_preset_names()))
    e.add_argument("--force", action="store_true", help="re-run finished runs too")
    e.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="runs at once (default 1; threads per worker are split between them)")
    e.add_argument("--dry-run", action="store_true", help="print the resolved runs and validate them; train nothing")
    _add_target_flags(e)


def _add_target_flags(g: Any) -> None:
    g.add_argument("--target-loss", type=float, default=None, metavar="LOSS",
                   help="validation loss target for steps/time-to-target (default: DDP's final x 1.01)")
    g.add_argument("--target-acc", type=float, default=None, metavar="PCT",
                   help="test accuracy target in %% (vision; default: DDP's final x 0.99)")


def _preset_names() -> list[str]:
    from .presets import PRESETS
    return list(PRESETS)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="wansync", description="Data-parallel training across slow links.")
    p.add_argument("--version", action="version", version=f"wansync {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("train", help="train one model with one strategy on M local workers (or under torchrun)")
    add_config_flags(t)
    t.add_argument("--preset", metavar="NAME", help="start from a paper's setting (its last strategy unless "
                   "--strategy): " + ", ".join(_preset_names()))
    t.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint "
                   "(--steps stays the total budget; only run-control flags may change)")
    c = sub.add_parser("compare", help="run several strategies side by side (x seeds), then write the report")
    _add_experiment_flags(c, "experiment")
    add_config_flags(c)
    s = sub.add_parser("sweep", help="run a grid of config values (x strategies x seeds), then write the report")
    _add_experiment_flags(s, "experiment")
    add_config_flags(s)
    r = sub.add_parser("report", help="tables and plots from finished runs (summary.csv, report.md, PNGs)")
    r.add_argument("run_dir", metavar="RUN_DIR", help="an experiment directory (or a single run directory)")
    _add_target_flags(r)
    r.add_argument("--no-plots", action="store_true", help="tables only")
    d = sub.add_parser("demo", help="every available strategy side by side on the tiny LM, 4 workers, "
                       "emulated two-site link")
    d.add_argument("--out", default="runs/demo", help="experiment directory (default runs/demo)")
    d.add_argument("--steps", type=int, default=DEMO_STEPS, help=f"training steps per run (default {DEMO_STEPS})")
    d.add_argument("--force", action="store_true", help="re-run finished runs too")
    return p


def cmd_train(args: argparse.Namespace) -> int:
    from .launch import torchrun_env
    from .run import resume_config, train
    if args.resume:
        overrides = {f.name: getattr(args, f.name) for f in fields(Config) if getattr(args, f.name, None) is not None}
        cfg = resume_config(args.resume, overrides)
        torchrun_env(cfg.workers)
        summary = train(cfg, resume=True)
        return 0 if summary is not None else 1
    if args.preset:
        from .presets import get
        preset = get(args.preset)
        cfg, _ = _layered_config(args, {**preset.values, "strategy": preset.strategies[-1]})
    else:
        cfg = config_from_args(args)
    torchrun_env(cfg.workers if args.workers is not None else None)   # refuses a stale or contradicting one
    summary = train(cfg)
    return 0 if summary is not None else 1


def _layered_config(args: argparse.Namespace, lowest: dict[str, Any]) -> tuple[Config, dict[str, Any]]:
    """defaults < lowest (default out, preset) < --config file < flags."""
    values = dict(lowest)
    if getattr(args, "config", None):
        values.update(load_toml(args.config))
    flags = {f.name: getattr(args, f.name) for f in fields(Config) if getattr(args, f.name, None) is not None}
    values.update(flags)
    return build_config(None, values), flags


def cmd_experiment(args: argparse.Namespace) -> int:
    from . import experiments as X
    from .presets import check_available, get
    preset = get(args.preset) if args.preset else None
    lowest: dict[str, Any] = {"out": f"runs/{preset.name if preset else args.command}"}
    if preset:
        lowest.update(preset.values)
    cfg, flags = _layered_config(args, lowest)
    from .launch import torchrun_env
    torchrun_env(cfg.workers if "workers" in flags else None)
    grid = X.parse_grid(args.grid)
    cells = _preset_cells(args, preset, grid, flags)
    if cells is not None:
        strategies = list(dict.fromkeys(c["strategy"] for c in cells))
    elif args.strategies:
        strategies = X.split_values(args.strategies)
    elif preset:
        strategies = list(preset.strategies)
    elif args.command == "compare" and "strategy" not in grid:
        raise ConfigError(f"compare needs --strategies A,B,... (available: {', '.join(X.available_strategies())})")
    else:
        strategies = [cfg.strategy]
    if preset and "strategy" not in grid:
        check_available(preset, strategies)
    if args.command == "sweep" and not grid and cells is None:
        raise ConfigError("sweep needs at least one --grid KEY=V1,V2 (any config key)")
    seeds = args.seeds if args.seeds is not None else (preset.seeds if preset else 1)
    if args.parallel < 1:
        raise ConfigError(f"--parallel must be >= 1, got {args.parallel}")
    threads = None
    if args.parallel > 1 and not cfg.threads:
        threads = X.default_threads(args.parallel, cfg.workers)
    if args.parallel > 1:
        cfg = replace(cfg, quiet=True)
    out = Path(cfg.out)
    specs = X.plan(cfg, strategies, seeds, grid, out, threads=threads, cells=cells)
    if args.dry_run:
        return _dry_run(specs, preset)
    return _run_and_report(specs, out, args.force, args.parallel, args.target_loss, args.target_acc)


def _preset_cells(args: argparse.Namespace, preset: Any, grid: dict[str, Any],
                  flags: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The preset's run cells (None when it has none or `--grid strategy=` replaces them);
    --strategies keeps the cells of those strategies (a strategy without a cell runs the preset's values)."""
    if preset is None or not preset.runs or "strategy" in grid:
        return None
    clash = [k for k in preset.swept_keys() if k in flags and k not in grid]
    if clash:
        values = ", ".join(dict.fromkeys(str(c[clash[0]]) for c in preset.runs if clash[0] in c))
        raise ConfigError(f"--{clash[0].replace('_', '-')} is swept by preset {preset.name} ({values}); "
                          f"change its values with --grid {clash[0]}=V1,V2")
    cells = [dict(c) for c in preset.runs]
    if args.strategies:
        from . import experiments as X
        wanted = X.split_values(args.strategies)
        cells = [c for c in cells if c["strategy"] in wanted]
        cells += [{"strategy": s} for s in wanted if not any(c["strategy"] == s for c in cells)]
    return cells


def _lr_rule(c: Config, world: int | None = None) -> str:
    from .optim import peak_lr
    if c.lr_scaling == "linear":
        w = world or c.workers
        return f"lr {peak_lr(c, w):g} = {c.lr:g} x {w * c.batch_size}/256 (linear scaling)"
    return f"lr {c.lr:g} (fixed)"


def _dry_run(specs: list[Any], preset: Any) -> int:
    from . import experiments as X
    if preset:
        print(f"preset {preset.name}: {preset.source}")
        for note in preset.notes:
            print(f"  note: {note}")
    c = specs[0].cfg
    print(f"{len(specs)} runs: model {c.model}, data {c.data}, {c.workers} workers, wan {c.wan or 'none'}, "
          f"{c.steps} steps, batch {c.batch_size}/worker, {c.optimizer} {_lr_rule(c)}")
    errors = []
    for s in specs:
        try:
            options = X.validate_run(s.cfg)
            status = ("ok  " + (", ".join(f"{k}={v}" for k, v in options.items()) or "(no options)")
                      + f"; {_lr_rule(s.cfg)}")
        except WansyncError as e:
            errors.append(f"{s.label} seed {s.seed}: {e}")
            status = f"INVALID: {e}"
        print(f"  {s.run_dir}  {status}")
    if errors:
        raise WansyncError(f"{len(errors)} of {len(specs)} runs are invalid; first: {errors[0]}")
    print(f"all {len(specs)} runs are valid (dry run: nothing trained)")
    return 0


def _run_and_report(specs: list[Any], out: Path, force: bool, parallel: int, target_loss: float | None,
                    target_acc: float | None) -> int:
    from . import experiments as X
    from .report import report
    X.write_plan(out, specs, {"target_loss": target_loss, "target_acc": target_acc})
    t0 = time.monotonic()
    outcomes = X.execute(specs, force=force, parallel=parallel)
    rep = report(out, target_loss=target_loss, target_acc=target_acc)
    ran = sum(o.status == "ok" for o in outcomes)
    skipped = sum(o.status == "skipped" for o in outcomes)
    failed = [o for o in outcomes if o.status == "failed"]
    print()
    print(rep.table)
    print()
    print(f"{ran} runs trained, {skipped} skipped (finished earlier), {len(failed)} failed, "
          f"in {time.monotonic() - t0:.0f} s")
    print(f"report: {rep.path}")
    if failed:
        raise WansyncError(f"{len(failed)} of {len(outcomes)} runs failed (marked in {rep.path}); "
                           f"first: {failed[0].spec.label} seed {failed[0].spec.seed}: {failed[0].message}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .report import report
    rep = report(args.run_dir, target_loss=args.target_loss, target_acc=args.target_acc, plots=not args.no_plots)
    print(rep.table)
    print()
    for p in rep.plots:
        print(f"plot: {p}")
    print(f"report: {rep.path}")
    return 0


DEMO_STEPS = 120
_DEMO_SYNC_EVERY = (8, 10, 12, 16, 20, 24, 25, 30, 40, 50)


def demo_link() -> tuple[str, str]:
    """('two-site', '') when the WAN emulator is there, else ('', a note)."""
    try:
        from .net import parse_wan
        parse_wan("two-site")
        return "two-site", ""
    except (ImportError, WansyncError, AttributeError) as e:
        return "", f"note: the WAN emulator is not available ({type(e).__name__}); running without a link"


def _demo_sync_every(base: Config, strategies: list[str]) -> int | None:
    """The smallest H every periodic strategy accepts with its other knobs at their defaults."""
    from .strategies import option_names
    from .train import resolve_strategy_options
    periodic = [s for s in strategies if "sync_every" in option_names(s)]
    for h in _DEMO_SYNC_EVERY:
        try:
            for s in periodic:
                resolve_strategy_options(replace(base, strategy=s, sync_every=h))
            return h
        except WansyncError:
            continue
    return None


def cmd_demo(args: argparse.Namespace) -> int:
    from . import experiments as X
    strategies = X.available_strategies()
    wan, note = demo_link()
    if note:
        print(note)
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    base = build_config(overrides={"model": "tiny", "workers": 4, "batch_size": 8, "seq_len": 64, "threads": 1,
                                   "steps": args.steps, "eval_every": max(1, args.steps // 6), "eval_batches": 4,
                                   "warmup_steps": min(20, args.steps // 5), "wan": wan, "out": args.out,
                                   # overlapped strategies: one step of overlap fits the short period
                                   # (tau < H/P); strategies without the knob ignore it
                                   "overlap": 1})
    h = _demo_sync_every(base, strategies)
    if h is not None:
        base = replace(base, sync_every=h)
    print(f"demo: {', '.join(strategies)} on the tiny LM (Shakespeare), 4 workers, "
          f"{'link ' + wan if wan else 'no emulated link'}, {args.steps} steps"
          + (f", sync_every {h}" if h else "") + f"; runs in {args.out}")
    specs = X.plan(base, strategies, 1, None, Path(args.out))
    return _run_and_report(specs, Path(args.out), args.force, 1, None, None)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        with sigterm_raises():
            code = {"train": cmd_train, "demo": cmd_demo, "compare": cmd_experiment, "sweep": cmd_experiment,
                    "report": cmd_report}[args.command](args)
    except WansyncError as e:
        print(f"wansync: error: {e}", file=sys.stderr)
        code = 1
    except (KeyboardInterrupt, Terminated) as e:      # the workers are ended and reaped by now
        print("wansync: interrupted" if isinstance(e, KeyboardInterrupt) else f"wansync: terminated ({e})",
              file=sys.stderr)
        exit_now(exit_status(e))
    sys.exit(code)
