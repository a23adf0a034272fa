"""Command-line parsing only: every Config key is a flag (`sync_every` -> `--sync-every`)."""

from __future__ import annotations

import argparse
import re
import math
import sys
from dataclasses import fields
from typing import Any, Callable, Sequence

from . import __version__
from .config import Config, base_type, build_config, check_combinations, check_key, check_options_apply, load_toml
from .errors import ConfigError, WansyncError, check, one_line
from .rules import in_range, not_blank, positive
from .runner.interrupts import Terminated, exit_now, exit_status, sigterm_raises
from .rundir.divergence import warning as divergence_warning
from .presets import PRESETS, get, layered_config
from .trust.secret import refuse_on_command_line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not a usage wall
        self.exit(2, f"wansync: error: {one_line(message)} (see '{self.prog} --help')\n")


def add_config_flags(p: argparse.ArgumentParser, shown: Callable[[str], bool] = lambda key: True) -> None:
    """Every config key as a flag; `--help` lists those `shown` (`plan` hides what it refuses, but still
    takes it, to refuse it in one line naming it)."""
    p.add_argument("--config", metavar="FILE.toml", help="TOML config file (flags override it)")
    groups: dict[str, Any] = {}
    for f in fields(Config):
        sec = f.metadata["section"]
        g = groups.setdefault(sec, p.add_argument_group(f"[{sec}]"))
        flag = "--" + f.name.replace("_", "-")
        t = base_type(f.name)
        text = f.metadata["help"].replace("%", "%%") if shown(f.name) else argparse.SUPPRESS  # a 5% is text
        if t is bool:
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            g.add_argument(flag, dest=f.name, type=str, default=None, metavar=t.__name__.upper(), help=text)


def config_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys given as flags."""
    return {f.name: getattr(args, f.name) for f in fields(Config) if getattr(args, f.name, None) is not None}


def config_from_args(args: argparse.Namespace) -> Config:
    return build_config(getattr(args, "config", None), config_flags(args))


def given_keys(args: argparse.Namespace) -> set[str]:
    """The config keys the user gave: as flags, or in the --config file (a preset's are not given)."""
    keys = set(config_flags(args))
    if getattr(args, "config", None) is not None:
        keys |= set(load_toml(args.config))
    return keys


def _add_experiment_flags(p: argparse.ArgumentParser, what: str) -> None:
    e = p.add_argument_group(what)
    e.add_argument("--strategies", metavar="A,B,...", help="strategies to run side by side (registry names)")
    e.add_argument(
        "--seeds",
        type=int,
        default=None,
        metavar="N",
        help="seeds per setting: seed, seed+1, ... " "(default 1, or the preset's)",
    )
    e.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="sweep a config key over values (repeatable; ';' separates values that contain commas)",
    )
    e.add_argument("--preset", metavar="NAME", help="a paper's setting: " + ", ".join(PRESETS))
    e.add_argument("--force", action="store_true", help="re-run finished runs too")
    e.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="runs at once (default 1; threads per worker are split between them)",
    )
    e.add_argument("--dry-run", action="store_true", help="print the resolved runs and validate them; train nothing")


def _add_target_flags(g: Any) -> None:
    g.add_argument(
        "--target-loss",
        type=float,
        default=None,
        metavar="LOSS",
        help="validation loss target for steps/time-to-target (default: DDP's final x 1.01)",
    )
    g.add_argument(
        "--target-acc",
        type=float,
        default=None,
        metavar="PCT",
        help="test accuracy target in %% (vision; default: DDP's final x 0.99)",
    )


DEMO_STEPS = 300


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="wansync", description="Data-parallel training across slow links.")
    p.add_argument("--version", action="version", version=f"wansync {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("train", help="train one model with one strategy on M local workers (or under torchrun)")
    add_config_flags(t)
    t.add_argument(
        "--preset",
        metavar="NAME",
        help="start from a paper's setting (its last strategy unless " "--strategy): " + ", ".join(PRESETS),
    )
    t.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue RUN_DIR from its latest checkpoint "
        "(--steps stays the total budget; only run-control flags may change)",
    )
    t.add_argument("--force", action="store_true", help="replace an earlier run in --out (it is kept otherwise)")
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
    r.add_argument(
        "--force",
        action="store_true",
        help="replace report files wansync did not write (a report.md "
        "of your own, an edited CSV); they are kept otherwise",
    )
    d = sub.add_parser(
        "demo",
        help="every available strategy side by side on the tiny LM, 2 workers, "
        "emulated cross-region link, each at settings inside its working regime",
    )
    d.add_argument("--out", default="runs/demo", help="experiment directory (default runs/demo)")
    d.add_argument("--steps", type=int, default=DEMO_STEPS, help=f"training steps per run (default {DEMO_STEPS})")
    d.add_argument("--force", action="store_true", help="re-run finished runs too")
    _add_plan_parser(sub)
    _add_results_parser(sub)
    return p


def _add_results_parser(sub: Any) -> None:
    p = sub.add_parser(
        "results", help="run every table of docs/results.md (>= 3 seeds per cell, resumable), " "then rewrite that page"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list every table, cell and seed with its estimated " "time; train nothing",
    )
    p.add_argument(
        "--only",
        default=None,
        metavar="T1,T2",
        help="only these tables (the page is still rewritten " "from every table's runs on disk)",
    )
    p.add_argument("--out", default="runs/results", help="results root (default runs/results)")
    p.add_argument(
        "--doc",
        default=None,
        help="the page to rewrite (default docs/results.md; with --steps or "
        "--seeds, a smoke run: results.md in --out)",
    )
    p.add_argument("--seeds", type=int, default=3, help="seeds per cell (default 3)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="shorten every run to this many steps (a smoke test " "of the pipeline, not a result)",
    )
    p.add_argument("--force", action="store_true", help="re-run finished runs too")


def _add_plan_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="predict wall clock, exposed communication, bytes and memory of a setting "
        "(the emulator's cost model on the strategy's own schedule); --table for large sizes",
    )
    g = p.add_argument_group(
        "plan",
        "figures per 1000 steps of the steady state, or with --steps N of a whole run of N steps (warm-up, "
        "last partial round and finish() included); memory checked against 80 GB per GPU unless --gpu-memory",
    )
    g.add_argument(
        "--strategies",
        default=None,
        metavar="A,B,...|all",
        help="rank these strategies (or all), each at its best H, codec and --inside under the "
        "exposed target and the GPU memory, in one table (instead of --strategy)",
    )
    g.add_argument(
        "--params",
        type=float,
        default=None,
        metavar="N",
        help="model size in parameters (e.g. 7e9) " "instead of a named --model",
    )
    g.add_argument("--step-time", type=float, default=None, metavar="S", help="compute seconds per step")
    g.add_argument("--measure", action="store_true", help="measure the step time: a few steps of --model here")
    g.add_argument(
        "--step-times",
        default=None,
        metavar="RUN",
        help="replay the per-step times of every rank of "
        "a finished `wansync train` run (worker w takes rank w mod its ranks), stragglers included",
    )
    g.add_argument(
        "--tokens-per-step",
        type=float,
        default=None,
        metavar="T",
        help="FLOPs rule: tokens per worker step (default: R ranks x batch_size x seq_len; with "
        "--params, R x 32 sequences of 2,048 tokens unless --batch-size and --seq-len are given)",
    )
    g.add_argument(
        "--throughput",
        type=float,
        default=None,
        metavar="FLOPS",
        help="FLOPs rule: effective " "FLOP/s per accelerator (default by --precision: 4e14 bf16, 2.7e13 fp32)",
    )
    g.add_argument(
        "--gpu-memory",
        default=None,
        metavar="SIZE",
        help="the accelerator memory rank 0's peak is checked against (e.g. 80GB, 141GB, 24GiB; default 80GB)",
    )
    g.add_argument(
        "--target-exposed",
        type=float,
        default=None,
        metavar="PCT",
        help="also give the smallest H whose exposed communication stays below PCT %% (with "
        "--strategies: the target each strategy's H is chosen for, default 10)",
    )
    g.add_argument(
        "--intellect-1",
        action="store_true",
        help="replay INTELLECT-1's published run (arXiv:2412.01152) "
        "on links calibrated to its reported all-reduce times, and what other strategies and codecs "
        "predict there (docs/planner.md)",
    )
    g.add_argument(
        "--table",
        action="store_true",
        help="the large-scale table: 150M-70B x 8/64/512 workers x " "the presets x ddp/diloco/streaming/cocodc",
    )
    from .planner.keys import reads

    add_config_flags(p, shown=reads)


def cmd_train(args: argparse.Namespace) -> int:
    from .runner.torchrun import torchrun_env
    from .runner.run import resume_config, train

    if args.resume is not None:
        not_blank("a run directory")("--resume", args.resume)
        given = [
            flag
            for flag, value in (("--preset", args.preset), ("--config", args.config), ("--force", args.force))
            if value is not None and value is not False
        ]
        if given:
            raise ConfigError(
                f"{given[0]} cannot be used with --resume: a resumed run keeps the config it "
                f"was started with (only run-control flags may change)"
            )
        cfg = resume_config(args.resume, config_flags(args))
        summary = train(cfg, resume=True, torchrun=torchrun_env(cfg.workers, cfg.ranks_per_worker))
        return _finished(summary)
    if args.preset is not None:
        preset = get(args.preset)
        cfg = layered_config({**preset.values, "strategy": preset.strategies[-1]}, args.config, config_flags(args))
    else:
        cfg = config_from_args(args)
    check_combinations(cfg, config_flags(args))
    check_options_apply([cfg], given_keys(args))
    # read once: a stale or contradicting environment is refused here, a consistent one adopted by train
    env = torchrun_env(cfg.workers if args.workers is not None else None, cfg.ranks_per_worker)
    summary = train(cfg, force=args.force, torchrun=env)
    return _finished(summary)


def _finished(summary: dict[str, Any] | None) -> int:
    """The exit status of a finished `train`; a diverged run is warned about in one line."""
    if summary and summary.get("diverged"):
        print(divergence_warning(summary), file=sys.stderr)
    return 0 if summary is not None else 1


def cmd_experiment(args: argparse.Namespace) -> int:
    from .runner import experiments

    preset = get(args.preset) if args.preset is not None else None
    specs, out, env = experiments.command_runs(
        args.command,
        preset,
        args.config,
        config_flags(args),
        args.grid,
        args.strategies,
        args.seeds,
        args.parallel,
        given_keys(args),
    )
    if args.dry_run:
        return experiments.check_and_list(specs, preset, out, args.force)
    first = specs[0].cfg  # --target-loss/--target-acc are config keys (flag, file or preset)
    return experiments.run_and_report(
        specs, out, args.force, args.parallel, first.target_loss, first.target_acc, torchrun=env
    )


def cmd_report(args: argparse.Namespace) -> int:
    from .analysis.report import report

    not_blank("a directory of runs")("RUN_DIR", args.run_dir)
    for key in ("target_loss", "target_acc"):
        if getattr(args, key) is not None:
            check_key(key, getattr(args, key))
    rep = report(
        args.run_dir,
        target_loss=args.target_loss,
        target_acc=args.target_acc,
        plots=not args.no_plots,
        force=args.force,
        lock=True,
    )
    print(rep.table)
    print()
    for p in rep.plots:
        print(f"plot: {p}")
    print(f"report: {rep.path}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .runner.demo import run_demo

    return run_demo(args.out, args.steps, args.force)


def cmd_results(args: argparse.Namespace) -> int:
    from .results import run_results
    from .runner.grid import split_values

    names = split_values(args.only, "--only") if args.only is not None else []
    not_blank("a results root")("--out", args.out)  # Path("") is ".": the working directory
    return run_results(names, args.out, args.doc, args.seeds, args.steps, args.force, args.dry_run)


NEGATIVE = re.compile(r"^-(\d|\.\d|inf)", re.IGNORECASE)


def negatives_attached(words: list[str]) -> list[str]:
    """`--flag -80GB` as `--flag=-80GB`: argparse takes a word that starts with '-' for a flag and says
    "expected one argument"; attached, the value reaches the flag's own check, which names what is
    wrong with it (must be > 0, ...). Only where the word after a --flag is a negative number."""
    out: list[str] = []
    for word in words:
        if out and out[-1].startswith("--") and "=" not in out[-1] and NEGATIVE.match(word):
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def whole_count(name: str, value: float) -> None:
    """A count of parameters is a whole number: `--params 1.5` would plan a model of one parameter
    (1.5e9, or 1.5B in words, was meant)."""
    check(float(value).is_integer(), f"{name} is a count of parameters, got {value:g}: not a whole number (1.5e9?)")


# What `wansync plan`'s own numbers must be (a config key's rules live with the key): one line each.
MAX_PARAMS = 1e15  # a thousand times the largest models trained: beyond it, a typo
PLAN_RULES = (
    ("params", in_range(1, MAX_PARAMS, high_included=True)),
    ("params", whole_count),
    ("step_time", positive),
    ("throughput", positive),
    ("tokens_per_step", positive),
    ("target_exposed", in_range(0, 100, low_included=False, high_included=True)),
)


def check_plan_flags(args: argparse.Namespace) -> None:
    for key, rule in PLAN_RULES:
        value = getattr(args, key)
        if value is None:
            continue
        check(math.isfinite(value), f"--{key.replace('_', '-')} must be a finite number, got {value}")
        rule(f"--{key.replace('_', '-')}", value)
    # one source of the step time and of the model's size: another would be ignored
    sources = [
        f
        for f, given in (
            ("--step-time", args.step_time is not None),
            ("--measure", args.measure),
            ("--step-times", args.step_times is not None),
        )
        if given
    ]
    check(len(sources) <= 1, f"give one of --step-time, --measure and --step-times, not {' and '.join(sources)}")
    rule_flags = [
        f for f, v in (("--tokens-per-step", args.tokens_per_step), ("--throughput", args.throughput)) if v is not None
    ]
    if sources and rule_flags:
        raise ConfigError(
            f"{' and '.join(rule_flags)} feed{'s' if len(rule_flags) == 1 else ''} the FLOPs rule, "
            f"which {sources[0]} replaces: drop {'it' if len(rule_flags) == 1 else 'them'}"
        )
    if args.params is not None and "model" in given_keys(args):
        raise ConfigError("--params sizes the model, so --model would be ignored: give one of the two")


PLAN_OWN_FLAGS = (
    "strategies",
    "params",
    "step_time",
    "measure",
    "step_times",
    "tokens_per_step",
    "throughput",
    "gpu_memory",
    "target_exposed",
)


def check_fixed_plan(args: argparse.Namespace) -> None:
    """`--intellect-1` and `--table` plan settings of their own: a flag given beside them would be ignored,
    so it is refused (`--table` takes `--target-exposed`, its H column's target)."""
    which = "--intellect-1" if args.intellect_1 else "--table" if args.table else None
    if which is None:
        return
    if args.intellect_1 and args.table:
        raise ConfigError("plan: --intellect-1 and --table are two tables: give one")
    taken = ("target_exposed",) if args.table else ()
    given = sorted(
        {*(k for k in PLAN_OWN_FLAGS if getattr(args, k) not in (None, False) and k not in taken), *given_keys(args)}
    )
    if given:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in given)
        raise ConfigError(
            f"plan {which} prints its own settings and would ignore {flags}: drop "
            f"{'it' if len(given) == 1 else 'them'}, or plan your setting without {which}"
        )


def plan_strategies(args: argparse.Namespace) -> list[str] | None:
    """`--strategies A,B,...` or `all`: the registry's names, each known, none twice; None without it."""
    if args.strategies is None:
        return None
    from .runner.grid import available_strategies, check_strategies, split_values

    if "strategy" in given_keys(args):
        raise ConfigError("plan: --strategies and --strategy both name the strategy: give one of them")
    words = split_values(args.strategies, "--strategies")
    if "all" in words and len(words) > 1:
        raise ConfigError(f"--strategies {args.strategies}: all names every strategy, so it stands alone")
    return available_strategies() if words == ["all"] else check_strategies(words, " in --strategies")


def plan_configs(args: argparse.Namespace, names: list[str]) -> tuple[list[Config], list[str], list[str]]:
    """Each strategy's config for `plan --strategies`, the names kept, and why any was left out: `all`
    leaves out a strategy of one rank per worker (`planner.keys.ONE_RANK_PER_WORKER`) when the workers
    have several, where a strategy named is refused in one line."""
    from .planner.keys import ONE_RANK_PER_WORKER
    from .runner.grid import split_values

    every = split_values(args.strategies, "--strategies") == ["all"]

    def of(name: str) -> Config:
        return build_config(args.config, {**config_flags(args), "strategy": name})

    later = [n for n in names if every and n in ONE_RANK_PER_WORKER]
    built = {n: of(n) for n in names if n not in later}
    ranks = next(iter(built.values())).ranks_per_worker
    left_out = [f"{n}: it runs one rank per learner, and these workers have {ranks}" for n in later if ranks > 1]
    built |= {n: of(n) for n in later if ranks == 1}
    kept = [n for n in names if n in built]
    return [built[n] for n in kept], kept, left_out


def cmd_plan(args: argparse.Namespace) -> int:
    from . import planner

    check_plan_flags(args)
    check_fixed_plan(args)
    if args.intellect_1:
        from .planner.published import table

        print(table())
        return 0
    if args.table:
        print(planner.table_preamble())
        planner.print_large_table(args.target_exposed if args.target_exposed is not None else planner.TARGET_PCT)
        return 0
    from .planner.keys import check_plan_keys
    from .strategies import option_names

    names = plan_strategies(args)
    given = given_keys(args)
    left_out: list[str] = []
    if names is None:
        cfgs = [config_from_args(args)]
    else:
        cfgs, names, left_out = plan_configs(args, names)
    check_options_apply(cfgs, given)  # `plan --strategy ddp --codec int8` planned fp32
    check_plan_keys(given, {o for c in cfgs for o in option_names(c.strategy)}, bool(args.measure))
    cfg = cfgs[0]
    print(
        planner.plan_command(
            cfg,
            steps=cfg.steps if "steps" in given else None,
            strategies=names,
            given=frozenset(given),
            left_out=left_out,
            params=args.params,
            step_s=args.step_time,
            measure=args.measure,
            step_times=args.step_times,
            target_pct=args.target_exposed,
            tokens_per_step=args.tokens_per_step,
            flops=args.throughput,
            gpu_memory=args.gpu_memory,
        )
    )
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        refuse_on_command_line(words)
    except WansyncError as e:
        print(f"wansync: error: {one_line(str(e))}", file=sys.stderr)
        sys.exit(2)
    args = build_parser().parse_args(negatives_attached(words))
    try:
        with sigterm_raises():
            code = {
                "train": cmd_train,
                "demo": cmd_demo,
                "compare": cmd_experiment,
                "sweep": cmd_experiment,
                "report": cmd_report,
                "plan": cmd_plan,
                "results": cmd_results,
            }[args.command](args)
    except WansyncError as e:
        print(f"wansync: error: {one_line(str(e))}", file=sys.stderr)
        code = 1
    except (KeyboardInterrupt, Terminated) as e:  # the workers are ended and reaped by now
        print(
            "wansync: interrupted" if isinstance(e, KeyboardInterrupt) else f"wansync: terminated ({e})",
            file=sys.stderr,
        )
        exit_now(exit_status(e))
    sys.exit(code)
