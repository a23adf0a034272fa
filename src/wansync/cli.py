"""Command-line parsing only: every Config key is a flag (`sync_every` -> `--sync-every`)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Sequence

from . import __version__
from .config import Config, base_type, build_config
from .errors import WansyncError


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


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="wansync", description="Data-parallel training across slow links.")
    p.add_argument("--version", action="version", version=f"wansync {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("train", help="train one model with one strategy on M local workers (or under torchrun)")
    add_config_flags(t)
    d = sub.add_parser("demo", help="train the tiny LM on the bundled Shakespeare corpus with 2 workers")
    d.add_argument("--out", default="runs/demo", help="run directory")
    d.add_argument("--steps", type=int, default=150, help="training steps")
    return p


def cmd_train(args: argparse.Namespace) -> int:
    from .run import train
    summary = train(config_from_args(args))
    return 0 if summary is not None else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from .run import train
    cfg = build_config(overrides={"strategy": "local_sgd", "sync_every": 4, "workers": 2, "model": "tiny",
                                  "steps": args.steps, "eval_every": 25, "out": args.out})
    summary = train(cfg)
    print(f"final validation perplexity {summary['final_val_ppl']:.2f} after {summary['steps']} steps "
          f"in {summary['wall_clock_s']:.0f} s; run directory: {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = {"train": cmd_train, "demo": cmd_demo}[args.command](args)
    except WansyncError as e:
        print(f"wansync: error: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("wansync: interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)
