"""Round 3 of the bad-input pass (issue 49): the surfaces added since round 2, case by case.

Every case is a hostile input a user can give one of the wave-4 surfaces: `--codec`/`--codec-collective`/
`--error-feedback`, the sparse strategies' knobs, topology files and `--wan` links, `--adapt`,
`--overlap-rounds`, `--slow-policy`/`--deadline`, `--model`/`--data` plug-ins and `hf:`, the `ws.Run`/
`ws.strategy`/`ws.FaultTolerance` API, `wansync plan`, `wansync results`, `wansync report`, checkpoint and
resume flags, the Hugging Face Trainer and the agreement of torchrun's nodes. Each asserts a refusal in
one line that names the flag or rule, the exit status (command line), that every file under the case's
directory is still there byte for byte with nothing added, and that nothing is left running. The table
in docs/reliability.md ("Round 3 (wave 4 surfaces)") counts the cases by surface; a test below keeps it
true.

How each kind runs, to stay fast (17 s for the file on two busy cores, 6 s of it CPU; 2026-12-05):
- `Cli`: `wansync.cli.main` in this process (an early refusal costs milliseconds); `fork=True` runs it
  in a process of its own (`cli_harness`), for a plug-in of the user's that the command imports.
- `Call`: a function in this process (a topology file's parser, the nodes' agreement, a factory); it
  writes only the file it reads, and every file that was there keeps its bytes.
- `Api`: a call of the public API that needs a process group, run with the others in one 1-rank gloo
  group started at the beginning of the module (`run_ranks`), so its start (and transformers' import for
  the Trainer's cases) overlaps the other cases.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from cli_harness import wansync
from wansync.runner.workerproc import live_workers
from test_report import fake_run
from wansync.errors import WansyncError

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"
Argv = Callable[[Path], list[str]]


# ---------------------------------------------------------------- the three kinds of case


@dataclass(frozen=True)
class Cli:
    """`wansync ARGV` (ARGV built in the case's directory) exits `code` with one line holding `expect`."""

    label: str
    argv: Argv
    expect: str
    code: int = 1
    fork: bool = False


@dataclass(frozen=True)
class Call:
    """`call(tmp)` raises a WansyncError of one line holding `expect`."""

    label: str
    call: Callable[[Path], Any]
    expect: str


@dataclass(frozen=True)
class Api:
    """`call(env)` in the 1-rank group raises `kind` with one line holding `expect`."""

    label: str
    call: Callable[[Any], Any]
    expect: str
    kind: str = "ConfigError"


# the smallest run, should a case be accepted by mistake (flags given later replace these)
SMALL = [
    "--steps",
    "1",
    "--model",
    "micro",
    "--workers",
    "1",
    "--batch-size",
    "2",
    "--seq-len",
    "16",
    "--eval-batches",
    "1",
    "--quiet",
]


def train(*args: str) -> Argv:
    return lambda tmp: ["train", "--out", str(tmp / "run"), *SMALL, *args]


def compare(*args: str) -> Argv:
    return lambda tmp: ["compare", "--out", str(tmp / "exp"), *SMALL, *args]


def sweep(*args: str) -> Argv:
    return lambda tmp: ["sweep", "--out", str(tmp / "exp"), *SMALL, *args]


def plan(*args: str) -> Argv:
    return lambda tmp: ["plan", "--wan", "lan", "--step-time", "1", "--params", "1e9", *args]


def plan_bare(*args: str) -> Argv:
    """`plan` with only the flags the case gives."""
    return lambda tmp: ["plan", *args]


def with_file(name: str, content: str | bytes, then: Callable[[Path], list[str]]) -> Argv:
    """A file of the user's at tmp/name, then the command `then(path)` names it in."""

    def make(tmp: Path) -> list[str]:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return then(path)

    return make


def config(text: str, *args: str) -> Argv:
    return with_file(
        "c.toml", text, lambda p: ["train", "--out", str(p.parent / "run"), *SMALL, "--config", str(p), *args]
    )


# ---------------------------------------------------------------- surface: codec

CODEC_CLI = [
    Cli(
        "local_sgd --codec INT8 (codec names are lower case)",
        train("--strategy", "local_sgd", "--codec", "INT8"),
        "unknown codec 'INT8'",
    ),
    Cli("local_sgd --codec '' (empty)", train("--strategy", "local_sgd", "--codec", ""), "unknown codec ''"),
    Cli(
        "local_sgd --codec 'int8 ' (a trailing space)",
        train("--strategy", "local_sgd", "--codec", "int8 "),
        "unknown codec 'int8 '",
    ),
    Cli(
        "diloco --codec-collective ring",
        train("--strategy", "diloco", "--codec", "int8", "--codec-collective", "ring"),
        "codec_collective must be one of auto, allgather, reduce_scatter, got 'ring'",
    ),
    Cli(
        "cpdp --codec-collective reduce-scatter (a hyphen)",
        train("--strategy", "cpdp", "--codec", "int8", "--codec-collective", "reduce-scatter"),
        "got 'reduce-scatter'",
    ),
    Cli(
        "diloco --codec-collective allgather with fp32",
        train("--strategy", "diloco", "--codec-collective", "allgather"),
        "codec_collective allgather is how a lossy codec's mean travels",
    ),
    Cli(
        "slowmo --error-feedback with fp32",
        train("--strategy", "slowmo", "--error-feedback"),
        "error_feedback needs a lossy codec",
    ),
    Cli(
        "slowmo --error-feedback maybe (a switch takes no value)",
        train("--strategy", "slowmo", "--error-feedback", "maybe"),
        "unrecognized arguments: maybe",
        2,
    ),
    Cli(
        "slowmo --error-feedback=yes",
        train("--strategy", "slowmo", "--error-feedback=yes"),
        "ignored explicit argument 'yes'",
        2,
    ),
    Cli(
        "ddp --codec-collective allgather",
        train("--strategy", "ddp", "--codec-collective", "allgather"),
        "ddp has no option codec_collective",
    ),
    Cli(
        "ddp --no-error-feedback (the negation is given too)",
        train("--strategy", "ddp", "--no-error-feedback"),
        "ddp has no option error_feedback",
    ),
    Cli("demo --codec int8", train("--strategy", "demo", "--codec", "int8"), "demo has no option codec"),
    Cli(
        "sparseloco --error-feedback",
        train("--strategy", "sparseloco", "--error-feedback"),
        "sparseloco has no option error_feedback",
    ),
    Cli(
        "compare ddp,sparseloco --codec int8 (neither has it)",
        compare("--strategies", "ddp,sparseloco", "--codec", "int8"),
        "ddp and sparseloco have no option codec",
    ),
    Cli(
        "sweep --grid codec=int8,zip (checked before any run)",
        sweep("--strategy", "diloco", "--grid", "codec=int8,zip"),
        "diloco__codec=zip seed 0: unknown codec 'zip'",
    ),
    Cli(
        "sweep --grid error_feedback=true,maybe",
        sweep("--strategy", "diloco", "--codec", "int8", "--grid", "error_feedback=true,maybe"),
        "error_feedback must be true or false, got 'maybe'",
    ),
    Cli("plan --codec zip", plan("--strategy", "diloco", "--codec", "zip"), "unknown codec 'zip'"),
    Cli(
        "plan --error-feedback with fp32",
        plan("--strategy", "diloco", "--error-feedback"),
        "error_feedback needs a lossy codec",
    ),
    Cli(
        "plan streaming --codec-collective allgather with fp32",
        plan("--strategy", "streaming", "--codec-collective", "allgather"),
        "is how a lossy codec's mean travels",
    ),
    Cli("config: codec = 8", config("[strategy]\ncodec = 8\n", "--strategy", "diloco"), "codec must be a str, got 8"),
    Cli(
        "config: codec = ['int8'] (an array)",
        config("[strategy]\ncodec = ['int8']\n", "--strategy", "diloco"),
        "codec must be a str, got ['int8']",
    ),
    Cli(
        "config: codec in [run]",
        config('[run]\ncodec = "int8"\n', "--strategy", "diloco"),
        "key 'codec' belongs in [strategy], not [run]",
    ),
    Cli(
        "config: error_feedback = 1",
        config("[strategy]\nerror_feedback = 1\n", "--strategy", "diloco"),
        "error_feedback must be true or false, got 1",
    ),
]

CODEC_API = [
    Api("ws.strategy(codec=8)", lambda env: env.strategy("diloco", codec=8), "codec must be a string, got 8"),
    Api(
        "ws.strategy(error_feedback='yes')",
        lambda env: env.strategy("diloco", codec="int8", error_feedback="yes"),
        "error_feedback must be true or false, got 'yes'",
    ),
    Api(
        "ws.strategy('ddp', codec='int8')",
        lambda env: env.strategy("ddp", codec="int8"),
        "strategy ddp has no option 'codec'",
    ),
    Api(
        "ws.strategy(fault_tolerant=..., codec='int8')",
        lambda env: env.strategy("diloco", codec="int8", fault_tolerant=env.ft()),
        "fp32 only",
    ),
]


# ---------------------------------------------------------------- surface: sparse

SPARSE = ("--strategy", "sparseloco")
SPARSE_CLI = [
    Cli("sparseloco --density inf", train(*SPARSE, "--density", "inf"), "density must be a finite number, got inf"),
    Cli("sparseloco --topk -1", train(*SPARSE, "--topk", "-1"), "topk must be >= 0, got -1"),
    Cli("sparseloco --topk 2**70", train(*SPARSE, "--topk", str(2**70)), "topk is too large"),
    Cli("sparseloco --bits 2.5", train(*SPARSE, "--bits", "2.5"), "bits must be an integer, got '2.5'"),
    Cli("sparseloco --quant-range 0", train(*SPARSE, "--quant-range", "0"), "quant_range must be > 0, got 0.0"),
    Cli("sparseloco --quant-range nan", train(*SPARSE, "--quant-range", "nan"), "quant_range must be a finite number"),
    Cli("sparseloco --quant-range=-inf", train(*SPARSE, "--quant-range=-inf"), "quant_range must be a finite number"),
    Cli(
        "sparseloco --aggregate CHOSEN",
        train(*SPARSE, "--aggregate", "CHOSEN"),
        "aggregate must be chosen or all, got 'CHOSEN'",
    ),
    Cli("sparseloco --aggregate ''", train(*SPARSE, "--aggregate", ""), "aggregate must be chosen or all, got ''"),
    Cli("sparseloco --error-decay nan", train(*SPARSE, "--error-decay", "nan"), "error_decay must be a finite number"),
    Cli(
        "demo --error-decay (sparseloco's)",
        train("--strategy", "demo", "--error-decay", "0.5"),
        "demo has no option error_decay",
    ),
    Cli(
        "sparseloco --momentum-decay (demo's)",
        train(*SPARSE, "--momentum-decay", "0.5"),
        "sparseloco has no option momentum_decay",
    ),
    Cli(
        "demo --sync-every (it exchanges every step)",
        train("--strategy", "demo", "--sync-every", "4"),
        "demo has no option sync_every",
    ),
    Cli(
        "demo --slow-policy deadline",
        train("--strategy", "demo", "--slow-policy", "deadline"),
        "demo has no option slow_policy",
    ),
    Cli(
        "sparseloco --codec-collective allgather",
        train(*SPARSE, "--codec-collective", "allgather"),
        "sparseloco has no option codec_collective",
    ),
    Cli(
        "sparseloco --model cnn --chunk 100000 (a vision model's tensors)",
        lambda tmp: [
            a for a in train(*SPARSE, "--model", "cnn", "--chunk", "100000")(tmp) if a not in ("--seq-len", "16")
        ],
        "chunk 100000 is larger than every tensor of the model (its longest side is 2048)",
    ),
    Cli(
        "compare local_sgd,diloco --density 0.1",
        compare("--strategies", "local_sgd,diloco", "--density", "0.1"),
        "local_sgd and diloco have no option density",
    ),
    Cli(
        "sweep --grid density=0.1,0",
        sweep(*SPARSE, "--grid", "density=0.1,0"),
        "sparseloco__density=0 seed 0: density must be in (0, 1], got 0.0",
    ),
    Cli("plan sparseloco --density 0", plan(*SPARSE, "--density", "0"), "density must be in (0, 1], got 0.0"),
    Cli("config: density = true", config("[strategy]\ndensity = true\n", *SPARSE), "density must be a float, got True"),
    Cli("config: topk = 4.5", config("[strategy]\ntopk = 4.5\n", *SPARSE), "topk must be an integer, got 4.5"),
    Cli(
        "config: density = nan (a TOML literal)",
        config("[strategy]\ndensity = nan\n", *SPARSE),
        "density must be a finite number, got nan",
    ),
]

SPARSE_API = [
    Api(
        "ws.strategy(density='0.1') (a string)",
        lambda env: env.strategy("sparseloco", density="0.1"),
        "density must be a number, got '0.1'",
    ),
    Api(
        "ws.strategy(density=tensor(0.1))",
        lambda env: env.strategy("sparseloco", density=env.torch.tensor(0.1)),
        "density must be a number, got tensor",
    ),
    Api(
        "ws.strategy(topk=True)", lambda env: env.strategy("sparseloco", topk=True), "topk must be an integer, got True"
    ),
    Api(
        "ws.strategy(chunk=2**70) (larger than the model)",
        lambda env: env.strategy("sparseloco", chunk=2**70),
        "is larger than every tensor of the model (its longest side is 8)",
    ),
    Api(
        "ws.strategy('demo', SGD with momentum)",
        lambda env: env.strategy("demo", momentum=0.9),
        "not SGD with momentum",
    ),
]


# ---------------------------------------------------------------- surface: topology

BASE = """[sites.a]
workers = 2
[sites.b]
workers = 2
[[links]]
sites = ["a", "b"]
rtt = "20ms"
bw = "1gbit"
"""
SCHEDULE = '[[schedules]]\nlinks = "all"\n'


def topo(text: str, suffix: str = ".toml") -> Callable[[Path], Any]:
    """The topology file of `text` read as `--wan` reads it."""

    def call(tmp: Path) -> Any:
        from wansync.net.wan import parse_wan

        path = tmp / f"sites{suffix}"
        path.write_text(text)
        return parse_wan(str(path))

    return call


def site_a(line: str) -> str:
    """BASE with `line` in site a (after its workers)."""
    return BASE.replace("workers = 2\n[sites.b]", f"workers = 2\n{line}\n[sites.b]", 1)


def site_a_workers(value: str) -> str:
    return BASE.replace("workers = 2\n[sites.b]", f"{value}\n[sites.b]", 1)


def on_link(old: str, new: str) -> str:
    assert old in BASE
    return BASE.replace(old, new, 1)


TOPOLOGY_CALL = [
    Call("an empty file", topo(""), "no [sites]: give at least one site"),
    Call("[sites] with no site", topo("[sites]\n"), "[sites]: no site"),
    Call(
        "workers = '2' (a string)",
        topo(site_a_workers('workers = "2"')),
        "[sites.a] workers: expected a whole number of workers, got '2'",
    ),
    Call("workers = true", topo(site_a_workers("workers = true")), "expected a whole number of workers, got True"),
    Call("a site without workers", topo(site_a_workers('ports = "rank"')), "[sites.a] workers: missing"),
    Call(
        "workers = 2**63-1 (it built a list of that many speeds)",
        topo(site_a_workers(f"workers = {2**63 - 1}")),
        "workers: a run has at most 4096 processes",
    ),
    Call(
        "speeds = [1.0, nan]",
        topo(site_a("speeds = [1.0, nan]")),
        "[sites.a] speeds[1]: expected a finite number, " "got nan",
    ),
    Call(
        "a site's link = 'wan' (not lan nor a table)",
        topo(site_a('link = "wan"')),
        "[sites.a] link: expected a table, got a string ('wan')",
    ),
    Call("rtt = '' (empty)", topo(on_link('rtt = "20ms"', 'rtt = ""')), "rtt: expected a non-empty string"),
    Call(
        "rtt = '1e999s' (infinite: a collective would wait for ever)",
        topo(on_link('rtt = "20ms"', 'rtt = "1e999s"')),
        "rtt must be >= 0 and finite, got inf",
    ),
    Call("rtt = '-5ms'", topo(on_link('rtt = "20ms"', 'rtt = "-5ms"')), "rtt='-5ms': expected a number with a unit"),
    Call(
        "bw = '1e999gbit' (infinite)",
        topo(on_link('bw = "1gbit"', 'bw = "1e999gbit"')),
        "bandwidth must be a positive finite rate, got inf",
    ),
    Call(
        "bw = '125mb/s' (bytes need an upper-case B)",
        topo(on_link('bw = "1gbit"', 'bw = "125mb/s"')),
        "bw='125mb/s': expected a rate like",
    ),
    Call(
        "jitter = '1e400ms' (infinite)",
        topo(on_link('bw = "1gbit"', 'bw = "1gbit"\njitter = "1e400ms"')),
        "jitter must be >= 0 and finite, got inf",
    ),
    Call(
        "mtu = '1500' (a string)",
        topo(on_link('bw = "1gbit"', 'bw = "1gbit"\nmtu = "1500"')),
        "mtu: expected a whole number of bytes, got '1500'",
    ),
    Call(
        "sites = ['a'] (one end)",
        topo(on_link('sites = ["a", "b"]', 'sites = ["a"]')),
        "sites: expected two site names, got 1",
    ),
    Call(
        "sites = ['a', 1] (a number for a name)",
        topo(on_link('sites = ["a", "b"]', 'sites = ["a", 1]')),
        "[[links]] #1 sites: a site is named by a string, got a number (1): quote it",
    ),
    Call("a link naming no sites", topo(on_link('sites = ["a", "b"]\n', "")), "which sites? give sites = [a, b]"),
    Call(
        "[links] as a table, not an array",
        topo(on_link("[[links]]", "[links]")),
        "[[links]]: expected an array, got " "a table",
    ),
    Call("[worker] without its link", topo(BASE + "[worker]\n"), "[worker]: missing link"),
    Call(
        "[worker] link = {bw} without rtt",
        topo(BASE + '[worker]\nlink = { bw = "1gbit" }\n'),
        "[worker] link: missing rtt",
    ),
    Call(
        "[compute] step = '0s'",
        topo(BASE + '[compute]\nstep = "0s"\n'),
        "[compute] step: must be a positive finite " "time",
    ),
    Call(
        "[compute] step = 250 (no unit)",
        topo(BASE + "[compute]\nstep = 250\n"),
        "[compute] step: expected a non-empty string, got a number (250)",
    ),
    Call("[compute] without step", topo(BASE + "[compute]\n"), "[compute]: missing step"),
    Call(
        "[compute] step = '1e999s' (infinite)",
        topo(BASE + '[compute]\nstep = "1e999s"\n'),
        "[compute] step: must be a positive finite time, got '1e999s'",
    ),
    Call(
        "a schedule without links",
        topo(BASE + '[[schedules]]\nsteps = [{ at = "1s", scale = 0.5 }]\n'),
        '[[schedules]] #1 links: missing: "all"',
    ),
    Call(
        "a step's scale = 0",
        topo(BASE + SCHEDULE + 'steps = [{ at = "1s", scale = 0 }]\n'),
        "scale must be positive and finite, got 0.0",
    ),
    Call(
        "a step's scale = inf",
        topo(BASE + SCHEDULE + 'steps = [{ at = "1s", scale = inf }]\n'),
        "steps[0] scale: expected a finite number, got inf",
    ),
    Call(
        "a step at '-1s'",
        topo(BASE + SCHEDULE + 'steps = [{ at = "-1s", scale = 0.5 }]\n'),
        "at='-1s': expected a number with a unit",
    ),
    Call(
        "a step at '1e999s' (never)",
        topo(BASE + SCHEDULE + 'steps = [{ at = "1e999s", scale = 0.5 }]\n'),
        "a schedule step's time must be >= 0 s, got inf",
    ),
    Call(
        "a step's rtt = '1e999s'",
        topo(BASE + SCHEDULE + 'steps = [{ at = "1s", rtt = "1e999s" }]\n'),
        "a schedule step's rtt must be >= 0 and finite, got inf",
    ),
    Call(
        "a schedule of an unknown site's links",
        topo(BASE + '[[schedules]]\nlinks = [["a", "zz"]]\n' 'steps = [{ at = "1s", scale = 0.5 }]\n'),
        "links[0]: unknown site 'zz'",
    ),
    Call(
        "steps as a table, not an array",
        topo(BASE + SCHEDULE + 'steps = { at = "1s", scale = 0.5 }\n'),
        "steps: expected an array, got a table",
    ),
    Call(
        "traffic seed = -1",
        topo(BASE + SCHEDULE + 'traffic = { seed = -1, every = "1s", low = 0.5 }\n'),
        "traffic seed: expected a whole number >= 0, got -1",
    ),
    Call(
        "traffic low above high",
        topo(BASE + SCHEDULE + 'traffic = { seed = 1, every = "1s", low = 0.9, high = 0.5 }\n'),
        "need 0 < low <= high <= 1",
    ),
    Call(
        "traffic every '0s'",
        topo(BASE + SCHEDULE + 'traffic = { seed = 1, every = "0s", low = 0.5 }\n'),
        "traffic: every must be a positive time",
    ),
    Call(
        "traffic without its seed",
        topo(BASE + SCHEDULE + 'traffic = { every = "1s", low = 0.5 }\n'),
        "traffic: missing seed",
    ),
    Call("name = '' (empty)", topo('name = ""\n' + BASE), "name: expected a non-empty string"),
    Call("name given twice (TOML)", topo('name = "x"\nname = "y"\n' + BASE), "does not parse: line 2"),
    Call(
        "[sites.a] declared twice (TOML)",
        topo(BASE + "[sites.a]\nworkers = 1\n"),
        "Cannot declare ('sites', 'a') twice",
    ),
    Call(
        "site a given twice (YAML kept the last without a word)",
        topo(
            "sites:\n  a: {workers: 2}\n  b: {workers: 2}\n  a: {workers: 1}\nlinks:\n"
            "  - {sites: [a, b], rtt: 20ms, bw: 1gbit}\n",
            ".yaml",
        ),
        "does not parse: line 4: key 'a' given twice",
    ),
    Call(
        "a YAML site named 1 (a number to YAML)",
        topo(
            "sites:\n  1: {workers: 2}\n  b: {workers: 2}\nlinks:\n  - {sites: [1, b], rtt: 20ms, bw: 1gbit}\n", ".yaml"
        ),
        'line 2: the key 1 is read by YAML as a number (1), not a name (digits are numbers, yes/no/on/off booleans): quote it, e.g. "1"',
    ),
    Call(
        "a YAML site named yes (a boolean to YAML)",
        topo(
            "sites:\n  a: {workers: 2}\n  yes: {workers: 2}\nlinks:\n  - {sites: [a, yes], rtt: 20ms, bw: 1gbit}\n",
            ".yaml",
        ),
        "line 3: the key yes is read by YAML as a boolean (True), not a name",
    ),
    Call(
        'a YAML link naming a quoted site "2" unquoted',
        topo(
            'sites:\n  a: {workers: 2}\n  "2": {workers: 2}\nlinks:\n  - {sites: [a, 2], rtt: 20ms, bw: 1gbit}\n',
            ".yaml",
        ),
        "[[links]] #1 sites: a site is named by a string, got a number (2): quote it",
    ),
    Call(
        "an empty YAML file",
        topo("", ".yaml"),
        "expected a mapping of keys (name, sites, links, ...) at the top, got " "NoneType",
    ),
    Call(
        "--wan rtt=1e999s,bw=1gbit (a spec's infinite rtt)",
        lambda tmp: __import__("wansync.net.wan", fromlist=["parse_wan"]).parse_wan("rtt=1e999s,bw=1gbit"),
        "rtt must be >= 0 and finite, got inf",
    ),
]

TOPOLOGY_CLI = [
    Cli("--wan /dev/null", train("--wan", "/dev/null"), "/dev/null is a character device, not a regular file"),
    Cli(
        "--wan a dangling link",
        lambda tmp: (tmp / "sites.toml").symlink_to(tmp / "gone.toml") or train("--wan", str(tmp / "sites.toml"))(tmp),
        "topology file not found",
    ),
    Cli(
        "--wan FILE,bw=1gbit (a file takes no overrides)",
        with_file("sites.toml", BASE, lambda p: train("--workers", "4", "--wan", f"{p},bw=1gbit")(p.parent)),
        "unknown preset",
    ),
    Cli(
        "--wan worker=50us/1e999gbit",
        train("--wan", "rtt=1ms,bw=1gbit,worker=50us/1e999gbit"),
        "bandwidth must be a positive finite rate, got inf",
    ),
    Cli(
        "sweep --grid wan=lan;FILE whose file is a list",
        with_file(
            "sites.yaml", "- 1\n- 2\n", lambda p: sweep("--strategy", "diloco", "--grid", f"wan=lan;{p}")(p.parent)
        ),
        "seed 0: topology file",
    ),
]


# ---------------------------------------------------------------- surface: adapt

ADAPT = ("--strategy", "diloco", "--wan", "lan", "--workers", "2")
ADAPT_CLI = [
    Cli(
        "--adapt exposed=nan",
        train(*ADAPT, "--adapt", "exposed=nan"),
        "exposed=nan: the target must lie strictly " "between 0 and 100",
    ),
    Cli("--adapt exposed=inf%", train(*ADAPT, "--adapt", "exposed=inf%"), "the target must lie strictly between"),
    Cli("--adapt exposed= (empty)", train(*ADAPT, "--adapt", "exposed="), "a percentage like 5% is expected"),
    Cli("--adapt exposed=5%, (a trailing comma)", train(*ADAPT, "--adapt", "exposed=5%,"), "got ''"),
    Cli("--adapt EXPOSED=5% (keys are lower case)", train(*ADAPT, "--adapt", "EXPOSED=5%"), "got 'EXPOSED=5%'"),
    Cli(
        "--adapt exposed=5%;h=4..8 (a semicolon)",
        train(*ADAPT, "--adapt", "exposed=5%;h=4..8"),
        "a percentage like 5% is expected",
    ),
    Cli("--adapt h=0..8", train(*ADAPT, "--adapt", "exposed=5%,h=0..8"), "H needs 1 <= LOW <= HIGH"),
    Cli("--adapt h=4..8..16", train(*ADAPT, "--adapt", "exposed=5%,h=4..8..16"), "give a value or a range LOW..HIGH"),
    Cli(
        "--adapt h=1..10**20 (its planner would simulate for ever)",
        train(*ADAPT, "--adapt", f"exposed=5%,h=1..{10**20}"),
        "H up to 100,000",
    ),
    Cli(
        "--adapt with --sync-every 10**6 (its default h reaches 4 x 10**6)",
        train(*ADAPT, "--sync-every", str(10**6), "--adapt", "exposed=5%"),
        "H up to 100,000",
    ),
    Cli(
        "--adapt codec=INT8..fp4",
        train(*ADAPT, "--adapt", "exposed=5%,codec=INT8..fp4"),
        "'INT8' is not one of fp32, bf16, int8, fp4",
    ),
    Cli("--adapt codec= (empty)", train(*ADAPT, "--adapt", "exposed=5%,codec="), "'' is not one of"),
    Cli(
        "--adapt density=nan..0.001",
        train("--strategy", "sparseloco", "--wan", "lan", "--workers", "2", "--adapt", "exposed=5%,density=nan..0.001"),
        "give HIGH..LOW with 0 < LOW <= HIGH <= 1",
    ),
    Cli(
        "--adapt density=0.001..0.01 (LOW..HIGH)",
        train(
            "--strategy", "sparseloco", "--wan", "lan", "--workers", "2", "--adapt", "exposed=5%,density=0.001..0.01"
        ),
        "give HIGH..LOW",
    ),
    Cli(
        "compare diloco,local_sgd --adapt (local_sgd has no knob)",
        compare("--strategies", "diloco,local_sgd", "--wan", "lan", "--adapt", "exposed=5%"),
        "local_sgd seed 0: --adapt turns H and the compression of diloco and sparseloco",
    ),
    Cli(
        "sweep --grid adapt=exposed=5%;exposed=200%",
        sweep("--strategy", "diloco", "--wan", "lan", "--grid", "adapt=exposed=5%;exposed=200%"),
        "--adapt exposed=200%: the target must lie strictly between 0 and 100",
    ),
    Cli(
        "config: adapt = 5", config("adapt = 5\n", "--strategy", "diloco", "--wan", "lan"), "adapt must be a str, got 5"
    ),
]


# ---------------------------------------------------------------- surface: overlap-rounds

OVERLAP_CLI = [
    Cli(
        "ddp --no-overlap-rounds (the negation is given too)",
        train("--strategy", "ddp", "--no-overlap-rounds"),
        "ddp has no option overlap_rounds",
    ),
    Cli(
        "diloco --overlap-rounds=1",
        train("--strategy", "diloco", "--overlap-rounds=1"),
        "ignored explicit argument '1'",
        2,
    ),
    Cli(
        "config: overlap_rounds = 1",
        config("[strategy]\noverlap_rounds = 1\n", "--strategy", "diloco"),
        "overlap_rounds must be true or false, got 1",
    ),
    Cli(
        "compare local_sgd,cpdp --overlap-rounds",
        compare("--strategies", "local_sgd,cpdp", "--overlap-rounds"),
        "local_sgd and cpdp have no option overlap_rounds",
    ),
    Cli(
        "sweep --grid overlap_rounds=true,perhaps",
        sweep("--strategy", "diloco", "--grid", "overlap_rounds=true,perhaps"),
        "overlap_rounds must be true or false, got 'perhaps'",
    ),
    Cli(
        "plan streaming --overlap-rounds",
        plan("--strategy", "streaming", "--overlap-rounds"),
        "streaming has no option overlap_rounds",
    ),
]

OVERLAP_API = [
    Api(
        "ws.strategy(fault_tolerant=..., overlap_rounds=True)",
        lambda env: env.strategy("diloco", overlap_rounds=True, fault_tolerant=env.ft()),
        "does not take overlap_rounds",
    ),
]


# ---------------------------------------------------------------- surface: slow-policy

SLOW_CLI = [
    Cli(
        "--deadline nan",
        train("--strategy", "diloco", "--slow-policy", "deadline", "--deadline", "nan"),
        "deadline must be a finite number, got nan",
    ),
    Cli(
        "--deadline 5s (a unit)",
        train("--strategy", "diloco", "--slow-policy", "deadline", "--deadline", "5s"),
        "deadline must be a number, got '5s'",
    ),
    Cli("--slow-policy Wait", train("--strategy", "diloco", "--slow-policy", "Wait"), "got 'Wait'"),
    Cli(
        "--slow-policy ''",
        train("--strategy", "diloco", "--slow-policy", ""),
        "slow_policy must be one of wait, " "deadline, balanced, got ''",
    ),
    Cli("ddp --deadline 3", train("--strategy", "ddp", "--deadline", "3"), "ddp has no option deadline"),
    Cli(
        "compare diloco,cpdp --slow-policy balanced",
        compare("--strategies", "diloco,cpdp", "--slow-policy", "balanced"),
        "cpdp seed 0: cpdp takes slow_policy wait only",
    ),
    Cli(
        "sweep --grid slow_policy=wait,fast",
        sweep("--strategy", "diloco", "--grid", "slow_policy=wait,fast"),
        "diloco__slow_policy=fast seed 0: slow_policy must be one of",
    ),
    Cli(
        "plan --deadline -3",
        plan("--strategy", "diloco", "--slow-policy", "deadline", "--deadline=-3"),
        "deadline must be >= 0, got -3.0",
    ),
    Cli(
        "plan cpdp --slow-policy balanced",
        plan("--strategy", "cpdp", "--slow-policy", "balanced"),
        "cpdp takes slow_policy wait only",
    ),
    Cli(
        "config: slow_policy = 1",
        config("[strategy]\nslow_policy = 1\n", "--strategy", "diloco"),
        "slow_policy must be a str, got 1",
    ),
]

SLOW_API = [
    Api(
        "ws.strategy(deadline='5s')",
        lambda env: env.strategy("diloco", slow_policy="deadline", deadline="5s"),
        "deadline must be a number, got '5s'",
    ),
    Api(
        "ws.strategy(deadline=inf)",
        lambda env: env.strategy("diloco", slow_policy="deadline", deadline=float("inf")),
        "deadline must be >= 0, got inf",
    ),
]


# ---------------------------------------------------------------- surface: plug-ins


def plugin(code: str, flag: str = "--model", name: str = "mine.py", factory: str = "build", *args: str) -> Argv:
    return with_file(
        name, code, lambda p: ["train", "--out", str(p.parent / "run"), *SMALL, *args, flag, f"{p}:{factory}"]
    )


def call_factory_exiting(tmp: Path) -> Any:
    from wansync.workloads.factory import call_factory

    return call_factory(lambda spec: __import__("sys").exit(2), None, "mine.py:build", "--model")


PLUGIN_CLI = [
    Cli(
        "a plug-in that raises SystemExit(3) at import (exited 3, silent)",
        plugin("raise SystemExit(3)\n"),
        "importing mine.py failed: SystemExit: 3",
        fork=True,
    ),
    Cli(
        "a plug-in that calls sys.exit(0) at import (exited 0, untrained)",
        plugin("import sys\nsys.exit(0)\n"),
        "importing mine.py failed: SystemExit: 0",
        fork=True,
    ),
    Cli(
        "--model DIR.py:build (a directory)",
        lambda tmp: (tmp / "dir.py").mkdir() or train("--model", f"{tmp / 'dir.py'}:build")(tmp),
        "dir.py is a directory, not a Python file",
    ),
    Cli("a plug-in with a syntax error", plugin("def build(:\n"), "importing mine.py failed: SyntaxError", fork=True),
    Cli(
        "a plug-in importing a missing package",
        plugin("import no_such_dependency_xyz\n"),
        "ModuleNotFoundError: No module named 'no_such_dependency_xyz'",
        fork=True,
    ),
    Cli(
        "--model a dangling link.py:build",
        lambda tmp: (tmp / "link.py").symlink_to(tmp / "gone.py") or train("--model", f"{tmp / 'link.py'}:build")(tmp),
        "no such file",
    ),
    Cli(
        "--model FILE.py: (no name)",
        with_file("mine.py", "def build(spec): pass\n", lambda p: train("--model", f"{p}:")(p.parent)),
        "unknown model",
    ),
    Cli(
        "--model FILE.py:build.x (an attribute path it lacks)",
        plugin("def build(spec): pass\n", factory="build.x"),
        "has no attribute 'build.x'",
        fork=True,
    ),
    Cli("--model :build (no module)", train("--model", ":build"), "unknown model ':build'"),
    Cli(
        "--model my-models:build (a dash in a module name)",
        train("--model", "my-models:build"),
        "unknown model 'my-models:build'",
    ),
    Cli(
        "--data a workload file with a syntax error",
        plugin("def workload(:\n", "--data", factory="workload"),
        "--data",
        fork=True,
    ),
    Cli(
        "--model FILE.py:build --data cifar10 (no path)",
        plugin("def build(spec): pass\n", "--model", "mine.py", "build", "--data", "cifar10"),
        "--data 'cifar10' needs a path: cifar10:PATH",
        fork=True,
    ),
    Cli(
        "--model hf:FILE (a file, not a directory)",
        with_file("mine.py", "", lambda p: train("--model", f"hf:{p}")(p.parent)),
        "is not a directory (hf:PATH names a directory with a config.json)",
    ),
    Cli(
        "--model hf:DIR whose config.json is a directory",
        lambda tmp: (tmp / "llm" / "config.json").mkdir(parents=True) or train("--model", f"hf:{tmp / 'llm'}")(tmp),
        "has no config.json",
    ),
    Cli(
        "sweep --grid model=FILE.py:build;FILE.py:nope",
        with_file(
            "mine.py",
            "def build(spec): pass\n",
            lambda p: [
                "sweep",
                "--out",
                str(p.parent / "exp"),
                "--steps",
                "1",
                "--workers",
                "1",
                "--strategy",
                "ddp",
                "--grid",
                f"model={p}:build;{p}:nope",
            ],
        ),
        "has no attribute 'nope'",
        fork=True,
    ),
]

PLUGIN_CALL = [
    Call(
        "a factory that calls sys.exit(2)",
        call_factory_exiting,
        "--model mine.py:build: the factory raised " "SystemExit: 2",
    ),
]


# ---------------------------------------------------------------- surface: api (ws.Run, ws.strategy, ws.FaultTolerance)


def _evaluate_a_float(env: Any) -> Any:
    with env.run(out=None) as run:
        return run.evaluate(3.0)


API_API = [
    Api("ws.Run(out='') (it wrote into the working directory)", lambda env: env.run(out=""), "Run: out= is empty"),
    Api(
        "ws.Run(None) (an AttributeError inside)",
        lambda env: env.ws.Run(None, quiet=True),
        "Run: the first argument is the strategy ws.strategy(...) returned, got NoneType",
    ),
    Api(
        "ws.Run(out=123) (a TypeError inside)",
        lambda env: env.run(out=123),
        "Run: out= is a run directory's path (or None), got int 123",
    ),
    Api(
        "run.evaluate(3.0) (an AttributeError inside)",
        _evaluate_a_float,
        "Run.evaluate: metrics is a dict of names to numbers, e.g. {'val_loss': 3.0}, got float 3.0",
    ),
    Api(
        "ws.Run(out=a file of the user's)",
        lambda env: env.run(out=env.users_file),
        "exists and is not a directory (it is a regular file)",
    ),
    Api(
        "ws.Run(out=below a file)",
        lambda env: env.run(out=env.users_file / "run"),
        "Run: cannot create",
        "StorageError",
    ),
    Api(
        "ws.Run(tensorboard=a file of the user's)",
        lambda env: env.run(out=None, tensorboard=str(env.users_file)),
        "Run: tensorboard=",
    ),
    Api(
        "ws.Run(log_every=0) (a ZeroDivisionError at the first log)",
        lambda env: env.run(out=None, log_every=0),
        "log_every must be an integer >= 1, got 0",
    ),
    Api(
        "ws.Run(tensorboard=True) without out=",
        lambda env: env.run(out=None, tensorboard=True),
        "writes into the run directory: give out=",
        "ValueError",
    ),
    Api(
        "FaultTolerance(peer_timeout=inf) (a wait for ever)",
        lambda env: env.ft(peer_timeout=float("inf")),
        "peer_timeout must be a finite number of seconds > 0, got inf",
    ),
    Api(
        "FaultTolerance(peer_timeout=nan)",
        lambda env: env.ft(peer_timeout=float("nan")),
        "peer_timeout must be a finite number of seconds > 0, got nan",
    ),
    Api("FaultTolerance(peer_timeout='60')", lambda env: env.ft(peer_timeout="60"), "got '60'"),
    Api(
        "FaultTolerance(lighthouse='127.0.0.1:0')",
        lambda env: env.ft(lighthouse="127.0.0.1:0"),
        "the lighthouse must be HOST:PORT, got '127.0.0.1:0'",
    ),
    Api("FaultTolerance(workers=True)", lambda env: env.ft(workers=True), "workers must be an integer, got True"),
    Api("FaultTolerance(workers=2.5)", lambda env: env.ft(workers=2.5), "workers must be an integer, got 2.5"),
    Api("FaultTolerance(workers='two')", lambda env: env.ft(workers="two"), "workers must be an integer, got 'two'"),
    Api("FaultTolerance(workers=0)", lambda env: env.ft(workers=0, worker=0), "workers must be >= 1, got 0"),
    Api(
        "ws.strategy(fault_tolerant='yes')",
        lambda env: env.strategy("diloco", fault_tolerant="yes"),
        "fault_tolerant= takes a ws.FaultTolerance(...), got str",
    ),
    Api(
        "ws.strategy(fault_tolerant=..., group=...)",
        lambda env: env.strategy("diloco", fault_tolerant=env.ft(), group=env.dist.group.WORLD),
        "takes no group=",
    ),
    Api(
        "ws.strategy('DiLoCo') (names are lower case)", lambda env: env.strategy("DiLoCo"), "unknown strategy 'DiLoCo'"
    ),
    Api("ws.strategy(None, ...)", lambda env: env.strategy(None), "unknown strategy 'None'"),
    Api(
        "ws.strategy(codek='int8') (a typo)",
        lambda env: env.strategy("diloco", codek="int8"),
        "strategy diloco has no option 'codek'",
    ),
    Api(
        "ws.strategy(sync_every=2.5)",
        lambda env: env.strategy("diloco", sync_every=2.5),
        "sync_every must be an integer, got 2.5",
    ),
    Api(
        "ws.strategy(sync_every=nan)",
        lambda env: env.strategy("diloco", sync_every=float("nan")),
        "sync_every must be an integer, got nan",
    ),
]


# ---------------------------------------------------------------- surface: plan

PLAN_CLI = [
    Cli("plan --gpu-memory 80 (no unit)", plan("--gpu-memory", "80"), "--gpu-memory: '80' is not a size"),
    Cli("plan --gpu-memory=-80GB", plan("--gpu-memory=-80GB"), "it must be positive and finite"),
    Cli("plan --gpu-memory -80GB (two words)", plan("--gpu-memory", "-80GB"), "it must be positive and finite"),
    Cli(
        "plan --params 1.5",
        plan_bare("--wan", "lan", "--params", "1.5"),
        "--params is a count of parameters, got 1.5: not a whole number",
    ),
    Cli("plan --gpu-memory 1e999GB", plan("--gpu-memory", "1e999GB"), "it must be positive and finite"),
    Cli(
        "plan --tokens-per-step 0",
        plan_bare("--wan", "lan", "--params", "1e9", "--tokens-per-step", "0"),
        "--tokens-per-step must be > 0",
    ),
    Cli(
        "plan --step-time 0",
        plan_bare("--wan", "lan", "--params", "1e9", "--step-time", "0"),
        "--step-time must be > 0, got 0.0",
    ),
    Cli(
        "plan --step-time with --measure (--measure was ignored)",
        plan("--measure"),
        "give one of --step-time, --measure and --step-times, not --step-time and --measure",
    ),
    Cli(
        "plan --measure --params",
        plan_bare("--wan", "lan", "--params", "1e9", "--measure"),
        "--measure needs a named --model, not --params",
    ),
    Cli(
        "plan --step-times with --ranks-per-worker 2",
        lambda tmp: ["plan", "--wan", "lan", "--model", "tiny", "--step-times", str(tmp), "--ranks-per-worker", "2"],
        "--step-times replays one rank per worker",
    ),
    Cli(
        "plan --step-times a missing directory",
        lambda tmp: ["plan", "--wan", "lan", "--model", "tiny", "--step-times", str(tmp / "no-such-run")],
        "--step-times: no profile_rank0.json under",
    ),
    Cli(
        "plan --step-times a file",
        with_file("notes.txt", "mine\n", lambda p: ["plan", "--wan", "lan", "--model", "tiny", "--step-times", str(p)]),
        "--step-times: no profile_rank0.json under",
    ),
    Cli(
        "plan --params with --model (--model was ignored)",
        plan("--model", "tiny"),
        "--params sizes the model, so --model would be ignored",
    ),
    Cli(
        "plan --step-time with --tokens-per-step (ignored)",
        plan("--tokens-per-step", "1000"),
        "--tokens-per-step feeds the FLOPs rule, which --step-time replaces",
    ),
    Cli(
        "plan --wan uneven-3-region --workers 2",
        plan_bare("--wan", "uneven-3-region", "--workers", "2", "--params", "1e9", "--step-time", "1"),
        "the topology 'uneven-3-region' has 4 workers",
    ),
    Cli(
        "plan --wan ...,sites=3 --workers 2 (train refuses it; plan predicted it)",
        plan_bare("--wan", "rtt=10ms,bw=1gbit,sites=3", "--workers", "2", "--params", "1e9", "--step-time", "1"),
        "has 3 sites but the run has 2 workers",
    ),
    Cli(
        "plan --wan rtt=1e999s (it printed inf and nan)",
        plan_bare("--wan", "rtt=1e999s,bw=1gbit", "--params", "1e9", "--step-time", "1"),
        "rtt must be >= 0 and finite",
    ),
    Cli(
        "plan --sync-every 10**8 (it never answered)",
        plan("--strategy", "diloco", "--sync-every", str(10**8)),
        "the planner simulates each step of the warm-up and two periods",
    ),
    Cli(
        "plan post_local_sgd --switch-step 10**9 (it never answered)",
        plan("--strategy", "post_local_sgd", "--switch-step", str(10**9)),
        "switch_step 1000000000",
    ),
    Cli(
        "plan --model hf:/nonexistent",
        plan_bare("--wan", "lan", "--step-time", "1", "--model", "hf:/nonexistent"),
        "--model hf:/nonexistent: no such directory",
    ),
    Cli("plan --model gpt5", plan_bare("--wan", "lan", "--step-time", "1", "--model", "gpt5"), "unknown model 'gpt5'"),
    Cli("plan --params abc", plan_bare("--wan", "lan", "--params", "abc"), "argument --params: invalid float value", 2),
]


# ---------------------------------------------------------------- surface: results


def results(*args: str) -> Argv:
    return lambda tmp: [
        "results",
        "--only",
        "cpdp-k-sweep",
        "--steps",
        "1",
        "--seeds",
        "1",
        "--out",
        str(tmp / "runs"),
        *args,
    ]


def results_doc(make: Callable[[Path], Path]) -> Argv:
    return lambda tmp: results("--doc", str(make(tmp)))(tmp)


def fifo(tmp: Path, name: str = "fifo") -> Path:
    os.mkfifo(tmp / name)
    return tmp / name


def users(tmp: Path, name: str, content: bytes = b"the user's own\n") -> Path:
    (tmp / name).write_bytes(content)
    return tmp / name


RESULTS_CLI = [
    Cli("results --only nope", lambda tmp: ["results", "--only", "nope", "--dry-run"], "unknown results table 'nope'"),
    Cli(
        "results --only 'cpdp-k-sweep, ,x' (a blank value)",
        lambda tmp: ["results", "--only", "cpdp-k-sweep, ,x", "--dry-run"],
        "--only: an empty value",
    ),
    Cli("results --steps 0", lambda tmp: ["results", "--steps", "0", "--dry-run"], "--steps must be >= 1, got 0"),
    Cli(
        "results --steps abc",
        lambda tmp: ["results", "--steps", "abc", "--dry-run"],
        "argument --steps: invalid int",
        2,
    ),
    Cli(
        "results --seeds 2.5",
        lambda tmp: ["results", "--seeds", "2.5", "--dry-run"],
        "argument --seeds: invalid int",
        2,
    ),
    Cli(
        "results --doc a link to the user's page",
        results_doc(lambda tmp: (tmp / "link.md").symlink_to(users(tmp, "mine.md")) or tmp / "link.md"),
        "is a link, not a regular file",
    ),
    Cli("results --doc /dev/null", results("--doc", "/dev/null"), "--doc /dev/null is a character device"),
    Cli("results --doc a FIFO", results_doc(fifo), "is a FIFO, not a regular file"),
    Cli(
        "results --doc not UTF-8",
        results_doc(lambda tmp: users(tmp, "page.md", b"\xff\xfe page")),
        "cannot read",
    ),
    Cli(
        "results --doc whose figures folder is a file",
        results_doc(lambda tmp: users(tmp, "page_figures") and users(tmp, "page.md")),
        "cannot draw the page's figures into",
    ),
    Cli(
        "results --out a file (a FileExistsError after its dry run said valid)",
        lambda tmp: ["results", "--only", "cpdp-k-sweep", "--steps", "1", "--out", str(users(tmp, "notes.txt"))],
        "is a regular file, not a directory; choose another --out",
    ),
    Cli(
        "results --out a file --dry-run",
        lambda tmp: ["results", "--only", "cpdp-k-sweep", "--out", str(users(tmp, "notes.txt")), "--dry-run"],
        "is a regular file, not a directory; choose another --out",
    ),
    Cli(
        "results --out '' (it checked the working directory)",
        lambda tmp: ["results", "--only", "cpdp-k-sweep", "--out", "", "--dry-run"],
        "--out must name a results root, got an empty value",
    ),
]


# ---------------------------------------------------------------- surface: report


def a_run_dir(tmp: Path) -> Path:
    return fake_run(tmp / "exp" / "ddp" / "seed0", "ddp", 0, [3.0, 2.5, 2.0]).parent.parent


REPORT_CLI = [
    Cli("report a FIFO", lambda tmp: ["report", str(fifo(tmp))], "is not a directory"),
    Cli("report /dev/null", lambda tmp: ["report", "/dev/null"], "report: /dev/null is not a directory"),
    Cli("report a missing directory", lambda tmp: ["report", str(tmp / "nowhere")], "report: directory not found"),
    Cli("report a name with a line break", lambda tmp: ["report", str(tmp / "no\nsuch")], "directory not found: "),
    Cli(
        "report --target-acc nan",
        lambda tmp: ["report", str(a_run_dir(tmp)), "--target-acc", "nan"],
        "target_acc must be a finite number",
    ),
    Cli(
        "report --target-loss abc",
        lambda tmp: ["report", str(a_run_dir(tmp)), "--target-loss", "abc"],
        "argument --target-loss: invalid float value",
        2,
    ),
    Cli(
        "report where report.md is the user's directory",
        lambda tmp: (a_run_dir(tmp) / "report.md").mkdir() or ["report", str(tmp / "exp"), "--no-plots"],
        "report.md",
    ),
    Cli(
        "report where summary.csv is a FIFO (writing it would block)",
        lambda tmp: fifo(a_run_dir(tmp), "summary.csv") and ["report", str(tmp / "exp"), "--no-plots"],
        "summary.csv",
    ),
]


# ---------------------------------------------------------------- surface: resume (a real finished run, copied)

TEMPLATE: list[Path] = []


def resumable(tmp: Path) -> Path:
    """A copy of the finished 2-step run (local_sgd, `--wan` a topology file of one worker) in tmp/run, its
    topology file beside it at tmp/sites.toml (config.toml names that copy)."""
    template = TEMPLATE[0]
    shutil.copytree(template / "run", tmp / "run", symlinks=True)
    shutil.copy(template / "sites.toml", tmp / "sites.toml")
    cfg = tmp / "run" / "config.toml"
    cfg.write_text(cfg.read_text().replace(str(template / "sites.toml"), str(tmp / "sites.toml")))
    return tmp / "run"


def resume(*args: str, before: Callable[[Path], Any] | None = None) -> Argv:
    def make(tmp: Path) -> list[str]:
        run = resumable(tmp)
        if before is not None:
            before(run)
        return ["train", "--resume", str(run), *args]

    return make


def locked(run: Path) -> None:
    from wansync.rundir.lock import RunLock

    _HELD.append(RunLock(run).__enter__())


_HELD: list[Any] = []


def damaged_record(run: Path) -> None:
    meta = next((run / "checkpoints").glob("step*/rank0.json"))
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "config"}))


RESUME_CLI = [
    Cli("--resume with --codec int8", resume("--codec", "int8", "--steps", "4"), "cannot change codec when resuming"),
    Cli("--resume with --adapt", resume("--adapt", "exposed=5%", "--steps", "4"), "cannot change adapt when resuming"),
    Cli(
        "--resume with --wan lan (a topology file's run)",
        resume("--wan", "lan", "--steps", "4"),
        "cannot change wan when resuming",
    ),
    Cli(
        "--resume with --slow-policy balanced",
        resume("--slow-policy", "balanced", "--steps", "4"),
        "cannot change slow_policy when resuming",
    ),
    Cli("--resume with --overlap-rounds", resume("--overlap-rounds", "--steps", "4"), "cannot change overlap_rounds"),
    Cli(
        "--resume with --model FILE.py:build",
        resume("--model", "mine.py:build", "--steps", "4"),
        "cannot change model when resuming",
    ),
    Cli(
        "--resume after the topology file was edited",
        resume(
            "--steps",
            "4",
            before=lambda run: (run.parent / "sites.toml").write_text(
                (run.parent / "sites.toml").read_text() + '[compute]\nstep = "1s"\n'
            ),
        ),
        "no longer matches the checkpoint of step 2 (changed: wan)",
    ),
    Cli(
        "--resume when the topology file moved and the run's copy is gone",
        resume(
            "--steps", "4", before=lambda run: ((run.parent / "sites.toml").unlink(), (run / "topology.toml").unlink())
        ),
        "topology file not found",
    ),
    Cli("--resume a file", lambda tmp: ["train", "--resume", str(users(tmp, "notes.txt"))], "is not a directory"),
    Cli("--resume a run another process holds", resume("--steps", "4", before=locked), "another wansync process"),
    Cli(
        "--resume a run whose config.toml is not UTF-8",
        resume(
            "--steps",
            "4",
            before=lambda run: (run / "config.toml").write_bytes(b"\xff\xfe" + (run / "config.toml").read_bytes()),
        ),
        "is not valid TOML",
    ),
    Cli(
        "--resume a run whose config.toml is a directory",
        resume("--steps", "4", before=lambda run: ((run / "config.toml").unlink(), (run / "config.toml").mkdir())),
        "is not a wansync run directory (no config.toml)",
    ),
    Cli(
        "--resume a checkpoint that records no configuration",
        resume("--steps", "4", before=damaged_record),
        "does not record the configuration it was written under",
    ),
    Cli(
        "--resume with --checkpoint-every -1",
        resume("--checkpoint-every", "-1", "--steps", "4"),
        "checkpoint_every must be >= 0, got -1",
    ),
    Cli("train --checkpoint-every 2**40", train("--checkpoint-every", str(2**40)), "checkpoint_every is too large"),
]


# ---------------------------------------------------------------- surface: hf-trainer


def trainer_with(**settings: Any) -> Callable[[Any], Any]:
    def call(env: Any) -> Any:
        from wansync.integrations.hf import WansyncTrainer

        return WansyncTrainer(model=None, args=types.SimpleNamespace(**settings), strategy="diloco")

    return call


def trainer_without_group(env: Any) -> Any:
    import transformers
    from wansync.integrations.hf import WansyncTrainer

    env.dist.destroy_process_group()  # the last case: the group is gone after it
    args = transformers.TrainingArguments(output_dir=str(env.scratch / "hf"), use_cpu=True, report_to=[], max_steps=1)
    return WansyncTrainer(model=env.model(), args=args, strategy="diloco")


def step_with_closure(env: Any) -> Any:
    from wansync.integrations.hf import StrategyStep

    return StrategyStep(env.sync).step(closure=lambda: 0.0)


def resume_from_a_foreign_checkpoint(env: Any) -> Any:
    import transformers
    from wansync.integrations.hf import WansyncTrainer

    args = transformers.TrainingArguments(output_dir=str(env.scratch / "hf"), use_cpu=True, report_to=[], max_steps=1)
    trainer = WansyncTrainer(model=env.model(), args=args, strategy="diloco")
    trainer.sync = env.sync
    folder = env.scratch / "checkpoint-8"
    folder.mkdir()
    return trainer._load_optimizer_and_scheduler(str(folder))


HF_API = [
    Api("deepspeed=", trainer_with(deepspeed="ds.json"), "the Trainer's DeepSpeed (deepspeed=...) cannot run under it"),
    Api("fp16=True", trainer_with(fp16=True), "fp16 (its loss scaler may skip a step on one rank only; use bf16)"),
    Api("n_gpu=2 (DataParallel in one process)", trainer_with(n_gpu=2), "DataParallel over 2 GPUs in one process"),
    Api(
        "parallelism_config=",
        trainer_with(parallelism_config=object()),
        "a parallelism_config (tensor/context " "parallelism)",
    ),
    Api(
        "deepspeed, fsdp and fp16 at once (each named)",
        trainer_with(deepspeed="x", fsdp="full_shard", fp16=True),
        "DeepSpeed (deepspeed=...), FSDP (fsdp=...), fp16",
    ),
    Api("optimizer.step(closure) (LBFGS-style)", step_with_closure, "a wansync strategy's step takes no closure"),
    Api(
        "resume from a checkpoint a WansyncTrainer did not save",
        resume_from_a_foreign_checkpoint,
        "has no wansync_rank0.pt: it was not saved by a WansyncTrainer of 1 ranks",
    ),
    Api("without a process group", trainer_without_group, "torch.distributed is not initialized: call wansync.init()"),
]


# ---------------------------------------------------------------- surface: nodes (torchrun's agreement)


def topology_file(tmp: Path, name: str, text: str) -> str:
    (tmp / name).write_text(text)
    return str(tmp / name)


FOUR = BASE  # a topology of 4 workers (a 2, b 2)


def nodes(
    strategy: str,
    mine: dict[str, Any],
    theirs: dict[str, Any] | Callable[[Path], dict[str, Any]],
    mine_at: Callable[[Path], dict[str, Any]] | None = None,
) -> Callable[[Path], Any]:
    """Rank 0 started with `mine`, rank 1 with `theirs` (a function of tmp for files): what every rank
    compares at start-up (`runner.agreement`: the fingerprint and the schedule keys)."""

    def call(tmp: Path) -> Any:
        from wansync.config import build_config, fingerprint
        from wansync.runner.agreement import check_same, shared
        from wansync.strategies import resolve_options

        records = []
        for values in ({**mine, **(mine_at(tmp) if mine_at else {})}, theirs(tmp) if callable(theirs) else theirs):
            cfg = build_config(overrides={"strategy": strategy, **values})
            records.append({"config": shared(fingerprint(cfg, resolve_options(strategy, vars(cfg))), cfg), "start": 0})
        check_same(records[0], records[0], 1)  # the same flags agree
        return check_same(records[0], records[1], 1)

    return call


def file_nodes(edit: Callable[[str], str]) -> Callable[[Path], Any]:
    """Both nodes name sites.toml, but rank 1's file says something else (another machine, another copy)."""
    return nodes(
        "diloco",
        {"workers": 4},
        lambda tmp: {"workers": 4, "wan": topology_file(tmp, "theirs/sites.toml", edit(FOUR))},
        mine_at=lambda tmp: {"wan": topology_file(tmp, "sites.toml", FOUR)},
    )


def both_ranks_refuse(tmp: Path) -> Any:
    """Two ranks meeting in a store like torchrun's agent serves: each refuses the other's codec."""
    import datetime

    import torch.distributed as dist
    from wansync.runner.agreement import agree
    from wansync.runner.torchrun import TorchrunEnv

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    seen: dict[int, Any] = {}

    def rank(r: int) -> None:
        env = TorchrunEnv(r, 2, "127.0.0.1", server.port, 0, 1, "run", 0, agent_store=True)
        try:
            seen[r] = agree(env, {"strategy": "diloco", "codec": ["fp32", "int8"][r]}, 0, 20)
        except WansyncError as e:
            seen[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(e, WansyncError) for e in seen.values()) and len(seen) == 2, seen
    raise seen[1]


def plugin_content_differs(tmp: Path) -> Any:
    """Both nodes name model.py:build, but rank 1's copy of the file is another version."""
    from wansync.config import build_config, fingerprint
    from wansync.runner.agreement import check_same, shared
    from wansync.strategies import resolve_options

    records = []
    for body in ("def build(): ...\n", "def build(): return None\n"):
        (tmp / "model.py").write_text(body)
        cfg = build_config(overrides={"strategy": "diloco", "model": str(tmp / "model.py") + ":build"})
        records.append({"config": shared(fingerprint(cfg, resolve_options("diloco", vars(cfg))), cfg), "start": 0})
    return check_same(records[0], records[1], 1)


def mkdirs(tmp: Path) -> Path:
    (tmp / "theirs").mkdir(exist_ok=True)
    return tmp


NODES_CALL = [
    Call(
        "another codec",
        nodes("diloco", {}, {"codec": "int8"}),
        "different training flags (codec): rank 1 has " "codec=int8 where rank 0 has codec=fp32",
    ),
    Call(
        "another codec_collective",
        nodes("diloco", {"codec": "int8"}, {"codec": "int8", "codec_collective": "allgather"}),
        "(codec_collective)",
    ),
    Call(
        "error_feedback on one node",
        nodes("diloco", {"codec": "int8"}, {"codec": "int8", "error_feedback": True}),
        "(error_feedback)",
    ),
    Call(
        "another density",
        nodes("sparseloco", {"density": 0.01}, {"density": 0.02}),
        "(density): rank 1 has " "density=0.02",
    ),
    Call("another topk", nodes("sparseloco", {"topk": 8}, {"topk": 16}), "(topk)"),
    Call("another chunk", nodes("sparseloco", {}, {"chunk": 32}), "(chunk)"),
    Call("another bits", nodes("sparseloco", {}, {"bits": 4}), "(bits)"),
    Call("another quant_range", nodes("sparseloco", {}, {"quant_range": 5.0}), "(quant_range)"),
    Call("another aggregate", nodes("sparseloco", {}, {"aggregate": "all"}), "(aggregate)"),
    Call("another error_decay", nodes("sparseloco", {}, {"error_decay": 0.9}), "(error_decay)"),
    Call("dct on one node", nodes("sparseloco", {}, {"dct": True}), "(dct)"),
    Call("another momentum_decay (demo)", nodes("demo", {}, {"momentum_decay": 0.9}), "(momentum_decay)"),
    Call(
        "a topology file whose bandwidth differs",
        lambda tmp: file_nodes(lambda t: t.replace('bw = "1gbit"', 'bw = "2gbit"'))(mkdirs(tmp)),
        "(wan): rank 1 has wan=topology ",
    ),
    Call(
        "a topology file whose speeds differ",
        lambda tmp: file_nodes(
            lambda t: t.replace("workers = 2\n[sites.b]", "workers = 2\nspeeds = [1.0, 0.5]\n[sites.b]")
        )(mkdirs(tmp)),
        "(wan)",
    ),
    Call(
        "a topology file with a schedule on one node",
        lambda tmp: file_nodes(lambda t: t + SCHEDULE + 'steps = [{ at = "60s", scale = 0.1 }]\n')(mkdirs(tmp)),
        "(wan)",
    ),
    Call(
        "a topology file with an emulated step on one node",
        lambda tmp: file_nodes(lambda t: t + '[compute]\nstep = "250ms"\n')(mkdirs(tmp)),
        "(wan)",
    ),
    Call(
        "a topology file whose sites split the workers otherwise (3 + 1)",
        lambda tmp: file_nodes(
            lambda t: t.replace("workers = 2\n[sites.b]\nworkers = 2", "workers = 3\n[sites.b]\nworkers = 1")
        )(mkdirs(tmp)),
        "(wan)",
    ),
    Call(
        "a topology file on one node, a preset on the other",
        nodes(
            "diloco",
            {"workers": 4, "wan": "two-site"},
            lambda tmp: {"workers": 4, "wan": topology_file(tmp, "sites.toml", FOUR)},
        ),
        "(wan)",
    ),
    Call(
        "another adapt target",
        nodes("diloco", {"wan": "lan", "adapt": "exposed=5%"}, {"wan": "lan", "adapt": "exposed=10%"}),
        "(adapt): rank 1 has adapt=exposed=10%",
    ),
    Call(
        "adapt on one node only",
        nodes("diloco", {"wan": "lan"}, {"wan": "lan", "adapt": "exposed=5%"}),
        "where rank 0 has adapt=",
    ),
    Call(
        "another adapt H range",
        nodes("diloco", {"wan": "lan", "adapt": "exposed=5%,h=8..64"}, {"wan": "lan", "adapt": "exposed=5%,h=8..32"}),
        "(adapt)",
    ),
    Call("overlap_rounds on one node", nodes("diloco", {}, {"overlap_rounds": True}), "(overlap_rounds)"),
    Call("another slow_policy", nodes("diloco", {}, {"slow_policy": "balanced"}), "(slow_policy)"),
    Call(
        "another deadline",
        nodes("diloco", {"slow_policy": "deadline"}, {"slow_policy": "deadline", "deadline": 5.0}),
        "(deadline)",
    ),
    Call(
        "another --model plug-in", nodes("diloco", {"model": "mine.py:build"}, {"model": "mine.py:build2"}), "(model)"
    ),
    Call(
        "another --data plug-in",
        nodes("diloco", {"data": "mine.py:workload"}, {"data": "theirs.py:workload"}),
        "(data)",
    ),
    Call("the same --model file, another version of it", plugin_content_differs, "(model_file)"),
    Call(
        "codec and error_feedback both (each named)",
        nodes("diloco", {}, {"codec": "int8", "error_feedback": True}),
        "(codec, error_feedback)",
    ),
    Call(
        "more than four keys (the line names them all, shows four)",
        nodes("sparseloco", {}, {"density": 0.5, "chunk": 16, "bits": 4, "aggregate": "all", "dct": True}),
        "(aggregate, bits, chunk, dct, density): rank 1 has aggregate=all, bits=4, chunk=16, dct=True, ... where",
    ),
    Call(
        "a long adapt spec (cut to 40 characters in the line)",
        nodes("diloco", {"wan": "lan"}, {"wan": "lan", "adapt": "exposed=12.3456789%,h=16..2048,codec=bf16..fp4"}),
        "rank 1 has adapt=exposed=12.3456789%,h=16..2048,codec=bf1 where",
    ),
    Call(
        "through the store: both ranks refuse another codec",
        both_ranks_refuse,
        "different training flags (codec): rank 1 has codec=int8 where rank 0 has codec=fp32",
    ),
]


# ---------------------------------------------------------------- the surfaces, for the doc's table

SURFACES: dict[str, list[Any]] = {
    "codec": CODEC_CLI + CODEC_API,
    "sparse": SPARSE_CLI + SPARSE_API,
    "topology": TOPOLOGY_CALL + TOPOLOGY_CLI,
    "adapt": ADAPT_CLI,
    "overlap-rounds": OVERLAP_CLI + OVERLAP_API,
    "slow-policy": SLOW_CLI + SLOW_API,
    "plug-ins": PLUGIN_CLI + PLUGIN_CALL,
    "api": API_API,
    "plan": PLAN_CLI,
    "results": RESULTS_CLI,
    "report": REPORT_CLI,
    "resume": RESUME_CLI,
    "hf-trainer": HF_API,
    "nodes": NODES_CALL,
}


def of_kind(kind: type) -> list[tuple[str, Any]]:
    return [(s, c) for s, cases in SURFACES.items() for c in cases if isinstance(c, kind)]


def ids(cases: list[tuple[str, Any]]) -> list[str]:
    return [f"{s}: {c.label}" for s, c in cases]


# ---------------------------------------------------------------- what every case asserts


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root (links as their target's name, directories and FIFOs by their kind), by
    relative path; Python's own bytecode caches left out (an imported plug-in's __pycache__)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if "__pycache__" in p.parts:
            continue
        if p.is_symlink():
            out[rel] = b"-> " + os.readlink(p).encode()
        elif p.is_fifo():
            out[rel] = b"(fifo)"
        elif p.is_dir():
            out[rel] = b"(dir)"
        elif p.is_file():
            out[rel] = p.read_bytes()
    return out


def changed(before: dict[str, bytes], after: dict[str, bytes]) -> list[str]:
    return sorted(set(before) ^ set(after) | {k for k in before if after.get(k) != before[k]})


def one_line(text: str, expect: str, label: str) -> None:
    assert "\n" not in text.strip() and "Traceback" not in text, f"{label}: {text[:3000]}"
    assert expect in text, f"{label}: {text[:1000]}"
    assert len(text) < 1200, f"{label}: a line of {len(text)} characters"


def run_cli(case: Cli, argv: list[str], capsys: Any) -> tuple[int, str]:
    if case.fork:  # the user's code runs in a process of its own
        r = wansync(*argv, timeout=60)
        return r.returncode, r.stderr
    from wansync.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    return int(e.value.code or 0), capsys.readouterr().err


@pytest.fixture(autouse=True)
def _release_locks():
    yield
    while _HELD:
        _HELD.pop().__exit__(None, None, None)


def assert_cli_refuses(case: Cli, tmp: Path, capsys: Any) -> None:
    argv = case.argv(tmp)
    before = snapshot(tmp)
    code, err = run_cli(case, argv, capsys)
    assert code == case.code, f"{case.label}: exit {code}: {err[:2000]}"
    one_line(err, case.expect, case.label)
    assert err.startswith("wansync: error: "), err
    assert not changed(before, snapshot(tmp)), f"{case.label}: changed {changed(before, snapshot(tmp))}"
    for run in (tmp / "run", tmp / "exp"):  # no worker of the case's runs is left (none started)
        assert case.fork is False and not run.is_dir() or not live_workers(run), f"{case.label}: left {run} running"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "surface, case",
    [c for c in of_kind(Cli) if c[0] != "resume"],
    ids=ids([c for c in of_kind(Cli) if c[0] != "resume"]),
)
def test_the_command_line_refuses_in_one_line_touching_nothing(tmp_path, capsys, surface, case):
    assert_cli_refuses(case, tmp_path, capsys)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One real 2-step run (local_sgd, 1 worker, the micro LM, `--wan` a topology file), made once."""
    root = tmp_path_factory.mktemp("round3-finished")
    (root / "sites.toml").write_text("[sites.here]\nworkers = 1\n")
    r = wansync(
        "train",
        "--strategy",
        "local_sgd",
        "--workers",
        "1",
        "--steps",
        "2",
        "--model",
        "micro",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--eval-batches",
        "1",
        "--quiet",
        "--wan",
        str(root / "sites.toml"),
        "--out",
        str(root / "run"),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    TEMPLATE[:] = [root]
    return root


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "surface, case",
    [c for c in of_kind(Cli) if c[0] == "resume"],
    ids=ids([c for c in of_kind(Cli) if c[0] == "resume"]),
)
def test_resume_refuses_in_one_line_touching_nothing(tmp_path, capsys, finished_run, surface, case):
    assert_cli_refuses(case, tmp_path, capsys)


@pytest.mark.parametrize("surface, case", of_kind(Call), ids=ids(of_kind(Call)))
def test_refused_in_one_line(tmp_path, surface, case):
    before = snapshot(tmp_path)
    with pytest.raises(WansyncError) as e:
        case.call(tmp_path)
    one_line(str(e.value), case.expect, case.label)
    after = snapshot(tmp_path)
    assert not [k for k in changed(before, after) if k in before], f"{case.label}: changed the user's files"


# ---------------------------------------------------------------- the API's cases, in one 1-rank group


class Env:
    """What an API case needs in the rank: a small model, strategies, a run, a FaultTolerance."""

    def __init__(self, tmp: Path):
        import torch
        import torch.distributed as dist
        import wansync as ws

        self.torch, self.dist, self.ws = torch, dist, ws
        self.tmp, self.scratch = tmp / "user", tmp / "scratch"  # the user's files; the Trainer's output
        self.tmp.mkdir()
        self.scratch.mkdir()
        self.users_file = self.tmp / "notes.txt"
        self.users_file.write_text("the user's own\n")
        self.sync = self.strategy("local_sgd", sync_every=2)

    def model(self) -> Any:
        return self.torch.nn.Sequential(self.torch.nn.Linear(8, 8), self.torch.nn.Linear(8, 2))

    def strategy(self, name: Any, momentum: float = 0.0, **options: Any) -> Any:
        model = self.model()
        return self.ws.strategy(
            name, model, self.torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum), **options
        )

    def run(self, **kw: Any) -> Any:
        return self.ws.Run(self.sync, quiet=True, **kw)

    def ft(self, **kw: Any) -> Any:
        return self.ws.FaultTolerance(**{"lighthouse": "127.0.0.1:29999", "worker": 0, "workers": 2, **kw})


def _api_rank(rank: int, world: int, tmp: str) -> dict[str, tuple[str, str, list[str]]]:
    """Every Api case in order (the Trainer's last: one closes the group): label -> (exception type,
    message, files changed under tmp)."""
    env = Env(Path(tmp))
    out = {}
    for surface, case in of_kind(Api):
        before = snapshot(env.tmp)
        try:
            case.call(env)
            said = ("accepted", "", [])
        except Exception as e:  # noqa: BLE001 - the test reads what each case raised
            said = (type(e).__name__, str(e), [])
        out[f"{surface}: {case.label}"] = (said[0], said[1], changed(before, snapshot(env.tmp)))
    return out


_API: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def _api_results(tmp_path_factory):
    """The API's cases run beside the others from the module's start: their group's start, and the
    Trainer's import of transformers, overlap the command-line cases."""
    from wansync.runner.localgroup import run_ranks

    tmp = tmp_path_factory.mktemp("round3-api")

    def work() -> None:
        try:
            _API["results"] = run_ranks(_api_rank, 1, str(tmp), timeout=180)[0]
        except Exception as e:  # noqa: BLE001 - each API case reports it
            _API["error"] = e

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    _API["thread"] = thread
    yield
    thread.join(200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("surface, case", of_kind(Api), ids=ids(of_kind(Api)))
def test_the_api_refuses_in_one_line(surface, case):
    _API["thread"].join(200)
    assert "error" not in _API, _API.get("error")
    kind, message, touched = _API["results"][f"{surface}: {case.label}"]
    assert kind == case.kind, f"{case.label}: {kind}: {message}"
    one_line(message, case.expect, case.label)
    assert not touched, f"{case.label}: changed {touched}"


# ---------------------------------------------------------------- the doc's table counts these cases


def doc_table() -> dict[str, int]:
    """surface -> cases, from the table under "Round 3 (wave 4 surfaces)" in docs/reliability.md."""
    text = DOC.read_text()
    section = text.split("## Bad input", 1)[1].split("\n## ", 1)[0]
    part = section.split("### Round 3 (wave 4 surfaces)", 1)[1]
    rows = re.findall(r"^\| `?([a-z-]+)`? \| (\d+) \|", part, flags=re.M)
    return {name: int(n) for name, n in rows}


def test_the_docs_table_counts_every_case_by_surface():
    counts = {s: len(cases) for s, cases in SURFACES.items()}
    table = doc_table()
    total = table.pop("total", None)
    assert table == counts, f"docs/reliability.md says {table}, the tests hold {counts}"
    assert total == sum(counts.values()) >= 150, (total, sum(counts.values()))
    labels = [f"{s}: {c.label}" for s, cases in SURFACES.items() for c in cases]
    assert len(labels) == len(set(labels)), "two cases share a label"
