"""`wansync --help` and every subcommand's import no torch (issue 60).

The parser is made of the config keys, the strategies' catalog and what `plan` reads, all torch-free;
a strategy's class brings torch when it is wanted. These tests look at the modules a fresh
interpreter has loaded (this one has torch already: conftest.py), never at the clock: the time that
saves is `benchmarks/cli_help.py`'s to measure.
"""

from __future__ import annotations

import json
import subprocess
import sys

# Each `--help` in turn, as the `wansync` command runs it (`python -m wansync`: `__main__`, then
# `cli.main`), in one fresh interpreter; after each: its exit status, whether it printed a usage, and
# whether torch is loaded. The subcommands are the parser's own, so a new one is checked too.
PROBE = r"""
import argparse, contextlib, io, json, runpy, sys

from wansync.cli import build_parser

sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
seen = {}
for words in [[]] + [[name] for name in sub.choices]:
    sys.argv = ["wansync", *words, "--help"]
    out, code = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module("wansync", run_name="__main__")
    except SystemExit as e:
        code = e.code
    seen[" ".join(sys.argv)] = {"code": code, "usage": out.getvalue().startswith("usage:"), "torch": "torch" in sys.modules}
print(json.dumps(seen))
"""


def _fresh(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_wansync_help_and_every_subcommands_help_import_no_torch():
    seen = json.loads(_fresh(PROBE))
    assert {"wansync --help", "wansync train --help", "wansync plan --help", "wansync compare --help"} <= set(seen)
    assert {cmd: r for cmd, r in seen.items() if r != {"code": 0, "usage": True, "torch": False}} == {}


def test_the_names_options_and_flags_of_every_strategy_come_without_torch():
    out = _fresh(
        "import sys\n"
        "from wansync import strategies\n"
        "from wansync.config import Config\n"
        "opts = strategies.make_options('streaming', fragments=2, codec='fp32')\n"
        "print(list(strategies.NAMES), strategies.option_names('cocodc')[:2], opts.fragments, 'torch' in sys.modules)"
    )
    assert out.split()[-1] == "False" and "'ddp'," in out and " 2 " in out


def test_a_strategy_class_brings_torch_when_it_is_wanted():
    out = _fresh(
        "import sys\n"
        "from wansync import strategies\n"
        "before = 'torch' in sys.modules\n"
        "cls = strategies.strategy_class('diloco')\n"
        "print(before, cls.__name__, 'torch' in sys.modules, list(strategies.STRATEGIES) == list(strategies.NAMES))"
    )
    assert out.split() == ["False", "DiLoCo", "True", "True"]


def test_the_codec_names_the_flags_offer_are_the_codec_registry():
    from wansync.comm.choices import CODEC_NAMES
    from wansync.comm.codecs import CODECS

    assert tuple(CODECS) == CODEC_NAMES
