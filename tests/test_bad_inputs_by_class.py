"""The second hostile probe's seven classes of defects (docs/reliability.md), one table of cases each.

Every case runs the CLI in-process as a user would and asserts its exit status, exactly one line on
stderr naming the cause, no traceback, and that every file that existed before (under the case's
directory) is still there, byte for byte, with nothing added: a refused command writes nothing. The
class-2 cases (waits of a fault-tolerant run) are in test_bounded_waits.py; the classes 4 and 6
also have cases where the command succeeds (a resume repeating the run's own flags, a report listing
a damaged run), asserted by their own tests below.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from typing import Callable

import pytest

from cli_harness import wansync
from test_bad_inputs import finished_run, flags
from test_report import fake_run
from wansync.analysis import report as R
from wansync.results import BEGIN, END
from wansync.rundir.lock import RunLock

Setup = Callable[[Path], list[str]]
_HELD: list[RunLock] = []  # locks a case holds while its command runs


@pytest.fixture(autouse=True)
def _release_locks():
    yield
    while _HELD:
        _HELD.pop().__exit__(None, None, None)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root (links as their target's name), by relative path."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = b"-> " + os.readlink(p).encode()
        elif p.is_file():
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code, _, err = run_cli_out(argv, capsys)
    return code, err


def run_cli_out(argv: list[str], capsys) -> tuple[int, str, str]:
    """The CLI in a process of its own (`cli_harness`: forked, with this process's environment)."""
    r = wansync(*argv, timeout=240)
    return r.returncode, r.stdout, r.stderr


# ---------------------------------------------------------------- setups: what a directory holds


def a_run(root: Path) -> Path:
    """One finished (hand-made) run under root/ddp/seed0."""
    return fake_run(root / "ddp" / "seed0", "ddp", 0, [3.0, 2.5, 2.0])


def report_over(*theirs: str, run: bool = True, extra: list[str] | None = None) -> Setup:
    """`report DIR` on a directory holding files of the user's (`theirs`) and, with `run`, a run."""

    def make(tmp: Path) -> list[str]:
        d = tmp / "mine"
        d.mkdir()
        if run:
            a_run(d)
        for name in theirs:
            (d / name).write_text(f"the user's own {name}\n")
        return ["report", str(d), "--no-plots", *(extra or [])]

    return make


def report_through_a_link(tmp: Path) -> list[str]:
    a_run(tmp / "mine")
    (tmp / "notes.md").write_text("my notes\n")
    (tmp / "mine" / "report.md").symlink_to(tmp / "notes.md")
    return ["report", str(tmp / "mine"), "--no-plots"]


def report_edited_since(tmp: Path) -> list[str]:
    a_run(tmp / "mine")
    R.report(tmp / "mine", plots=False)
    with open(tmp / "mine" / "report.md", "a") as f:
        f.write("\nmy conclusions, added by hand\n")
    return ["report", str(tmp / "mine"), "--no-plots"]


def report_while_locked(tmp: Path) -> list[str]:
    a_run(tmp / "mine")
    (tmp / "mine" / ".lock").write_text("")
    _HELD.append(RunLock(tmp / "mine").__enter__())
    return ["report", str(tmp / "mine"), "--no-plots"]


MICRO = ["--model", "micro", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1"]


def experiment_over(command: str, *extra: str, holds: Callable[[Path], None]) -> Setup:
    """`compare`/`sweep`/`demo` with --out a directory set up by `holds`."""

    def make(tmp: Path) -> list[str]:
        out = tmp / "exp"
        out.mkdir()
        holds(out)
        if command == "demo":
            return ["demo", "--out", str(out), "--steps", "2", *extra]
        head = (
            ["compare", "--strategies", "ddp,local_sgd"]
            if command == "compare"
            else ["sweep", "--strategy", "local_sgd", "--grid", "sync_every=2,4"]
        )
        return [*head, "--workers", "1", *MICRO, "--out", str(out), *extra]

    return make


def users_report(out: Path) -> None:
    (out / "report.md").write_text("# my report\n")


def wansync_experiment_with_users_report(out: Path) -> None:
    (out / "experiment.json").write_text(json.dumps({"runs": []}))
    (out / "report.md").write_text("# my report\n")


def foreign_run_dir(out: Path) -> None:
    (out / "experiment.json").write_text(json.dumps({"runs": []}))
    (out / "ddp" / "seed0").mkdir(parents=True)
    (out / "ddp" / "seed0" / "summary.json").write_text('{"accuracy": 0.9}')


def a_train_run(out: Path) -> None:
    (out / "config.toml").write_text('[run]\nstrategy = "ddp"\n')


def locked(out: Path) -> None:
    (out / "experiment.json").write_text(json.dumps({"runs": []}))
    (out / ".lock").write_text("")
    _HELD.append(RunLock(out).__enter__())


def results_page(text: str) -> Setup:
    """`wansync results` rewriting a page that holds `text` (a smoke run: nothing may train)."""

    def make(tmp: Path) -> list[str]:
        (tmp / "page.md").write_text(text)
        return [
            "results",
            "--only",
            "cpdp-k-sweep",
            "--steps",
            "1",
            "--seeds",
            "1",
            "--doc",
            str(tmp / "page.md"),
            "--out",
            str(tmp / "runs"),
        ]

    return make


def results_out_foreign(tmp: Path) -> list[str]:
    (tmp / "runs" / "cpdp-k-sweep").mkdir(parents=True)
    (tmp / "runs" / "cpdp-k-sweep" / "data.csv").write_text("1,2,3\n")
    (tmp / "page.md").write_text("# page\n")
    return [
        "results",
        "--only",
        "cpdp-k-sweep",
        "--steps",
        "1",
        "--seeds",
        "1",
        "--doc",
        str(tmp / "page.md"),
        "--out",
        str(tmp / "runs"),
    ]


CLASS_1: list[tuple[str, Setup, str]] = [
    ("report over the user's report.md", report_over("report.md"), "refusing to replace"),
    ("report over the user's summary.csv", report_over("summary.csv"), "summary.csv: wansync did not write it"),
    ("report over the user's runs.csv", report_over("runs.csv"), "runs.csv: wansync did not write it"),
    ("report over the user's pareto.png", report_over("pareto.png"), "pareto.png: wansync did not write it"),
    ("report over a report.md linked to the user's notes", report_through_a_link, "refusing to replace"),
    ("report over a report.md edited since wansync wrote it", report_edited_since, "or it changed since"),
    (
        "report where only a foreign summary.json lies (not a run)",
        report_over("report.md", "summary.json", run=False),
        "no runs found",
    ),
    ("report while another process holds the directory", report_while_locked, "another wansync process"),
    (
        "compare --out a folder holding the user's report.md",
        experiment_over("compare", holds=users_report),
        "not empty and not a wansync experiment",
    ),
    (
        "compare --out an experiment with the user's report.md",
        experiment_over("compare", holds=wansync_experiment_with_users_report),
        "refusing to replace",
    ),
    (
        "compare --dry-run --out an experiment with the user's report.md",
        experiment_over("compare", "--dry-run", holds=wansync_experiment_with_users_report),
        "refusing to replace",
    ),
    (
        "compare into a run directory that is not a run",
        experiment_over("compare", holds=foreign_run_dir),
        "not empty and not a wansync run",
    ),
    (
        "sweep --out a train run's directory",
        experiment_over("sweep", holds=a_train_run),
        "not a wansync experiment directory",
    ),
    (
        "demo --out a folder holding the user's report.md",
        experiment_over("demo", holds=users_report),
        "not empty and not a wansync experiment",
    ),
    (
        "compare into an experiment another compare is running",
        experiment_over("compare", holds=locked),
        "another wansync process",
    ),
    (
        "results on a page with a begin marker and no end marker",
        results_page(f"# R\n\n{BEGIN}\nmy text, which must survive\n"),
        "1 begin and 0 end markers",
    ),
    (
        "results on a page with the end marker first",
        results_page(f"# R\n{END}\nmine\n{BEGIN}\n"),
        "1 begin and 1 end markers",
    ),
    (
        "results on a page with two generated blocks",
        results_page(f"{BEGIN}\na\n{END}\nmine\n{BEGIN}\nb\n{END}\n"),
        "2 begin and 2 end markers",
    ),
    (
        "results --out a root whose table folder is someone else's",
        results_out_foreign,
        "not empty and not a wansync experiment",
    ),
]


# ---------------------------------------------------------------- class 3: validate before work


def a_file(name: str = "file.txt") -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        (tmp / name).write_text("x")
        return tmp / name

    return make


def compare_out(where: Callable[[Path], str], command: str = "compare") -> Setup:
    def make(tmp: Path) -> list[str]:
        out = where(tmp)
        if command == "compare":
            return ["compare", "--strategies", "ddp", "--workers", "1", *MICRO, "--out", out]
        if command == "sweep":
            return [
                "sweep",
                "--strategy",
                "local_sgd",
                "--grid",
                "sync_every=2,4",
                "--workers",
                "1",
                *MICRO,
                "--out",
                out,
            ]
        if command == "demo":
            return ["demo", "--steps", "2", "--out", out]
        return [
            "results",
            "--only",
            "cpdp-k-sweep",
            "--steps",
            "1",
            "--seeds",
            "1",
            "--doc",
            str(tmp / "p.md"),
            "--out",
            out,
        ]

    return make


def exp(*argv: str) -> Setup:
    return lambda tmp: [*argv, "--workers", "1", *MICRO, "--out", str(tmp / "exp")]


def results_doc(where: Callable[[Path], str]) -> Setup:
    return lambda tmp: [
        "results",
        "--only",
        "cpdp-k-sweep",
        "--steps",
        "1",
        "--seeds",
        "1",
        "--doc",
        where(tmp),
        "--out",
        str(tmp / "runs"),
    ]


def ddp_config_with_sync_every(tmp: Path) -> list[str]:
    (tmp / "c.toml").write_text("[strategy]\nsync_every = 4\n")
    return ["train", "--out", str(tmp / "run"), "--strategy", "ddp", "--config", str(tmp / "c.toml")]


LONG = "a" * 300
CLASS_3: list[tuple[str, Setup, str]] = [
    (
        "results --doc in a folder that does not exist (outside the repository)",
        results_doc(lambda tmp: str(tmp / "docs" / "results.md")),
        "its folder",
    ),
    ("results --doc a directory", results_doc(lambda tmp: str(tmp)), "is a directory, not a regular file"),
    ("results --doc ''", results_doc(lambda tmp: ""), "--doc must name the page"),
    ("compare --out a file", compare_out(lambda tmp: str(a_file()(tmp))), "exists and is not a directory"),
    ("sweep --out a file", compare_out(lambda tmp: str(a_file()(tmp)), "sweep"), "exists and is not a directory"),
    ("demo --out a file", compare_out(lambda tmp: str(a_file()(tmp)), "demo"), "exists and is not a directory"),
    (
        "results --out a file",
        compare_out(lambda tmp: (tmp / "p.md").write_text("") or str(a_file()(tmp)), "results"),
        "is a regular file, not a directory; choose another --out",
    ),
    ("compare --out under /proc", compare_out(lambda tmp: "/proc/wansync-exp"), "cannot create experiment directory"),
    (
        "sweep --out under /sys",
        compare_out(lambda tmp: "/sys/kernel/wansync-exp", "sweep"),
        "cannot create experiment directory",
    ),
    (
        "demo --out under /proc",
        compare_out(lambda tmp: "/proc/wansync-demo", "demo"),
        "cannot create experiment directory",
    ),
    ("compare --out a name over 255 bytes", compare_out(lambda tmp: str(tmp / LONG)), "file name too long"),
    (
        "results --out a name over 255 bytes",
        compare_out(lambda tmp: (tmp / "p.md").write_text("") or str(tmp / LONG), "results"),
        "file name too long",
    ),
    (
        "compare --out below a regular file",
        compare_out(lambda tmp: str(a_file()(tmp) / "exp")),
        "cannot create experiment directory",
    ),
    ("--resume ''", lambda tmp: ["train", "--resume", ""], "--resume must name a run directory"),
    ("--config ''", flags("--config", ""), "config must name a TOML file"),
    ("--preset ''", flags("--preset", ""), "unknown preset ''"),
    ("compare --preset ''", exp("compare", "--preset", ""), "unknown preset ''"),
    ("compare --out ''", lambda tmp: ["compare", "--strategies", "ddp", "--out", ""], "out must name a run directory"),
    ("demo --out ''", lambda tmp: ["demo", "--out", ""], "out must name a run directory"),
    ("report ''", lambda tmp: ["report", ""], "RUN_DIR must name a directory"),
    ("results --only ''", lambda tmp: ["results", "--only", "", "--dry-run"], "--only: no values given"),
    (
        "ddp --sync-every 4 (ddp has no such option)",
        flags("--strategy", "ddp", "--sync-every", "4"),
        "ddp has no option sync_every",
    ),
    ("ddp with sync_every in the --config file", ddp_config_with_sync_every, "ddp has no option sync_every"),
    (
        "compare --strategies ddp,cpdp --fragments 2",
        exp("compare", "--strategies", "ddp,cpdp", "--fragments", "2"),
        "ddp and cpdp have no option fragments",
    ),
    (
        "sweep of ddp over sync_every",
        exp("sweep", "--strategy", "ddp", "--grid", "sync_every=2,4"),
        "ddp has no option sync_every",
    ),
    (
        "--lighthouse without --fault-tolerant",
        flags("--lighthouse", "127.0.0.1:29510"),
        "--lighthouse apply to fault-tolerant runs only",
    ),
    (
        "--max-restarts without --fault-tolerant",
        flags("--max-restarts", "1"),
        "--max-restarts applies to fault-tolerant runs and to async_diloco",
    ),
    (
        "--lighthouse as a URL",
        flags("--strategy", "diloco", "--fault-tolerant", "--lighthouse", "http://h:29510"),
        "lighthouse must be HOST:PORT",
    ),
    (
        "--lighthouse with port 99999",
        flags("--strategy", "diloco", "--fault-tolerant", "--lighthouse", "h:99999"),
        "lighthouse must be HOST:PORT",
    ),
    (
        "--lighthouse without a host",
        flags("--strategy", "diloco", "--fault-tolerant", "--lighthouse", ":29510"),
        "lighthouse must be HOST:PORT",
    ),
    ("--grid 'wan=;lan' (an empty value)", exp("sweep", "--grid", "wan=;lan"), "an empty value in ';lan'"),
    (
        "--grid sync_every=1,,2",
        exp("sweep", "--strategy", "local_sgd", "--grid", "sync_every=1,,2"),
        "an empty value in '1,,2'",
    ),
    (
        "--grid sync_every=1,2, (a trailing comma)",
        exp("sweep", "--strategy", "local_sgd", "--grid", "sync_every=1,2,"),
        "an empty value",
    ),
    ("--strategies ddp,,local_sgd", exp("compare", "--strategies", "ddp,,local_sgd"), "an empty value"),
    ("--strategies ''", exp("compare", "--strategies", ""), "--strategies: no values given"),
    (
        "--seeds 3 --grid seed=1,2",
        exp("compare", "--strategies", "ddp", "--seeds", "3", "--grid", "seed=1,2"),
        "--seeds and --grid seed=... both set the seeds",
    ),
    (
        "--strategies with --grid strategy=",
        exp("compare", "--strategies", "ddp", "--grid", "strategy=ddp,local_sgd"),
        "--strategies and --grid strategy=... both name the strategies",
    ),
    (
        "--strategies with --strategy",
        exp("compare", "--strategies", "ddp", "--strategy", "local_sgd"),
        "--strategies and --strategy both name the strategies",
    ),
    (
        "--sync-every 4 with --grid sync_every=2,8",
        exp("sweep", "--strategy", "local_sgd", "--sync-every", "4", "--grid", "sync_every=2,8"),
        "--sync-every is also swept by --grid sync_every",
    ),
    (
        "compare where one run cannot start (streaming --fragments 99)",
        exp("compare", "--strategies", "ddp,streaming", "--fragments", "99"),
        "streaming seed 0: fragments",
    ),
    (
        "sweep whose second data path is missing",
        exp("sweep", "--strategy", "ddp", "--grid", "data=shakespeare,/no/x"),
        "ddp__data=-no-x seed 0: data path not found",
    ),
]


# ---------------------------------------------------------------- class 4: resume accepts what did not change

CLASS_4: list[tuple[str, Setup, str]] = [
    (
        "--resume with its own --workers and a new --lr",
        finished_run(None, "--workers", "1", "--lr", "1"),
        "cannot change lr",
    ),
    ("--resume with its own --seed and a new --lr", finished_run(None, "--seed", "0", "--lr", "1"), "cannot change lr"),
    (
        "--resume with its own --ranks-per-worker and --strategy, a new --lr",
        finished_run(None, "--ranks-per-worker", "1", "--strategy", "local_sgd", "--lr", "1"),
        "cannot change lr",
    ),
    (
        "--resume with its own --lr written otherwise (3e-3), a new --seq-len",
        finished_run(None, "--lr", "3e-3", "--seq-len", "8"),
        "cannot change seq_len",
    ),
    (
        "--resume with its own --sync-every (8) and a new --model",
        finished_run(None, "--sync-every", "8", "--model", "micro"),
        "cannot change model",
    ),
    (
        "--resume with another --sync-every",
        finished_run(None, "--sync-every", "4", "--steps", "4"),
        "cannot change sync_every",
    ),
]


# ---------------------------------------------------------------- class 5: numbers in range


def torchrun_env(**extra: str) -> Setup:
    def make(tmp: Path) -> list[str]:
        env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", **extra}
        _ENV.update(env)
        return ["train", "--out", str(tmp / "run")]

    return make


_ENV: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _case_env(monkeypatch):
    """The environment a case's setup asks for (set before its command runs, by `run_case`)."""
    _ENV.clear()
    yield monkeypatch
    _ENV.clear()


HUGE = "x" * (50 << 20)
CLASS_5: list[tuple[str, Setup, str]] = [
    ("--peer-timeout 1e-4", flags("--peer-timeout", "1e-4"), "peer_timeout must be in [1, 86400], got 0.0001"),
    ("--peer-timeout 1e14", flags("--peer-timeout", "1e14"), "peer_timeout must be in [1, 86400]"),
    ("--peer-timeout 1e308", flags("--peer-timeout", "1e308"), "peer_timeout must be in [1, 86400]"),
    ("--threads 20000", flags("--threads", "20000"), "threads must be at most this machine's"),
    (
        "--threads beyond the cores",
        flags("--threads", str((os.cpu_count() or 1) + 1)),
        "threads must be at most this machine's",
    ),
    ("--ranks-per-worker 1000", flags("--ranks-per-worker", "1000"), "would start 2000 processes on this machine"),
    ("--workers 5000", flags("--workers", "5000"), "workers x ranks_per_worker is too large"),
    ("--workers 1000 --ranks-per-worker 1", flags("--workers", "1000"), "would start 1000 processes"),
    (
        "compare --workers 1000 (checked before the first run)",
        lambda tmp: ["compare", "--strategies", "ddp", "--workers", "1000", "--out", str(tmp / "exp")],
        "would start 1000 processes",
    ),
    (
        "--max-restarts 10**6",
        flags("--strategy", "diloco", "--fault-tolerant", "--max-restarts", str(10**6)),
        "max_restarts must be in [0, 1000]",
    ),
    ("LOCAL_RANK=5 in a world of 2", torchrun_env(LOCAL_RANK="5"), "LOCAL_RANK must be an integer in [0, 1]"),
    (
        "report --target-loss inf",
        lambda tmp: ["report", str(a_run(tmp / "r").parent.parent), "--target-loss", "inf"],
        "target_loss must be a finite number",
    ),
    (
        "report --target-loss nan",
        lambda tmp: ["report", str(a_run(tmp / "r").parent.parent), "--target-loss", "nan"],
        "target_loss must be a finite number",
    ),
    (
        "report --target-loss -1",
        lambda tmp: ["report", str(a_run(tmp / "r").parent.parent), "--target-loss", "-1"],
        "target_loss must be > 0",
    ),
    (
        "report --target-acc 500",
        lambda tmp: ["report", str(a_run(tmp / "r").parent.parent), "--target-acc", "500"],
        "target_acc must be in (0, 100]",
    ),
    ("train --target-acc 0", flags("--target-acc", "0"), "target_acc must be in (0, 100]"),
    (
        "compare --seeds 10**6",
        exp("compare", "--strategies", "ddp", "--seeds", str(10**6)),
        "seeds must be in [1, 1000]",
    ),
    (
        "results --seeds 10**9",
        lambda tmp: ["results", "--seeds", str(10**9), "--dry-run"],
        "--seeds must be in [1, 1000]",
    ),
    (
        "a grid of more than 10,000 runs",
        exp(
            "sweep",
            "--strategy",
            "local_sgd",
            "--grid",
            "sync_every=" + ",".join(map(str, range(1, 201))),
            "--grid",
            "seed=" + ",".join(map(str, range(100))),
        ),
        "the grid has 20000 runs",
    ),
    ("an error that would echo a 50 MB value", flags("--strategy", HUGE), "unknown strategy 'xxx"),
    ("an error that would echo a line break", flags("--data", "no\nsuch"), "data path not found: no\\nsuch"),
]


# ---------------------------------------------------------------- class 7: messages that point at the cause


def a_fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "fifo")
    return tmp / "fifo"


def corpus_of_a_fifo(tmp: Path) -> list[str]:
    (tmp / "corpus").mkdir()
    os.mkfifo(tmp / "corpus" / "a.txt")
    return ["train", "--out", str(tmp / "run"), "--data", str(tmp / "corpus")]


CLASS_7: list[tuple[str, Setup, str]] = [
    (
        "--config a directory",
        lambda tmp: ["train", "--out", str(tmp / "run"), "--config", str(tmp)],
        "is a directory, not a regular file",
    ),
    ("--config /dev/null", flags("--config", "/dev/null"), "/dev/null is a character device, not a regular file"),
    (
        "--config a FIFO",
        lambda tmp: ["train", "--out", str(tmp / "run"), "--config", str(a_fifo(tmp))],
        "is a FIFO, not a regular file",
    ),
    (
        "--config not UTF-8",
        lambda tmp: (tmp / "c.toml").write_bytes(b"[run]\nsteps = 3 # \xff\n")
        and ["train", "--out", str(tmp / "run"), "--config", str(tmp / "c.toml")],
        "is not UTF-8 text (byte",
    ),
    (
        "--config of 2 MB",
        lambda tmp: (tmp / "c.toml").write_text("# " + "x" * (2 << 20))
        and ["train", "--out", str(tmp / "run"), "--config", str(tmp / "c.toml")],
        "is too large for a config file",
    ),
    (
        "--config with a byte-order mark is read (its steps = 0 is what is refused)",
        lambda tmp: (tmp / "c.toml").write_bytes("\ufeff[run]\nsteps = 0\n".encode())
        and ["train", "--out", str(tmp / "run"), "--config", str(tmp / "c.toml")],
        "steps must be >= 1, got 0",
    ),
    (
        "--data a FIFO",
        lambda tmp: ["train", "--out", str(tmp / "run"), "--data", str(a_fifo(tmp))],
        "is a FIFO, not a text file or a directory",
    ),
    ("--data /dev/zero", flags("--data", "/dev/zero"), "/dev/zero is a character device"),
    (
        "--data cifar100: a file",
        lambda tmp: ["train", "--out", str(tmp / "run"), "--model", "cnn", "--data", f"cifar100:{a_file()(tmp)}"],
        "not a directory of images",
    ),
    ("--data a folder whose only .txt is a FIFO", corpus_of_a_fifo, "no .txt or .md files under corpus directory"),
    (
        "--lighthouse with a space in its host",
        flags("--strategy", "diloco", "--fault-tolerant", "--lighthouse", "no host:1"),
        "lighthouse must be HOST:PORT",
    ),
]

CASES = (
    [(1, *c) for c in CLASS_1]
    + [(3, *c) for c in CLASS_3]
    + [(4, *c) for c in CLASS_4]
    + [(5, *c) for c in CLASS_5]
    + [(7, *c) for c in CLASS_7]
)


@pytest.mark.timeout(300)  # the first resume case trains the template run
@pytest.mark.parametrize("cls, label, setup, expect", CASES, ids=[f"class{c[0]}: {c[1]}" for c in CASES])
def test_refused_in_one_line_touching_nothing(tmp_path, capsys, _case_env, cls, label, setup, expect):
    argv = setup(tmp_path)
    for k, v in _ENV.items():
        _case_env.setenv(k, v)
    before = snapshot(tmp_path)
    code, err = run_cli(argv, capsys)
    assert code != 0, f"{label}: exit 0"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"{label}: {err[:3000]}"
    assert lines[0].startswith("wansync: error: ") and "Traceback" not in err and len(lines[0]) < 1200
    assert expect.lower() in lines[0].lower(), f"{label}: {lines[0][:1000]}"
    after = snapshot(tmp_path)
    assert (
        after == before
    ), f"{label}: changed {sorted(set(after) ^ set(before) | {k for k in before if after.get(k) != before[k]})}"


# ---------------------------------------------------------------- class 6: reports never call a damaged run ok


def damaged(how: Callable[[Path], None]) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        root = tmp / "exp"
        fake_run(root / "local_sgd" / "seed0", "local_sgd", 0, [3.0, 2.6, 2.1])
        how(fake_run(root / "ddp" / "seed0", "ddp", 0, [3.0, 2.5, 2.0]))
        return root

    return make


def cut_metrics(keep: float) -> Callable[[Path], None]:
    def how(run: Path) -> None:
        data = (run / "metrics.jsonl").read_bytes()
        (run / "metrics.jsonl").write_bytes(data[: int(len(data) * keep)])

    return how


def write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda run: (run / name).write_bytes(data)


CLASS_6 = [
    ("a summary.json of {}", write("summary.json", b"{}"), "summary.json is not a wansync summary"),
    ("a summary.json that is a list", write("summary.json", b"[1, 2]"), "summary.json is not a wansync summary"),
    ("a summary.json that is not UTF-8", write("summary.json", b"\xff\xfe{"), "summary.json is not a wansync summary"),
    (
        "a summary.json without steps",
        write("summary.json", json.dumps({"strategy": "ddp", "final_val_loss": 2.0}).encode()),
        "summary.json is not a wansync summary",
    ),
    ("a metrics.jsonl cut in its last line", cut_metrics(0.97), "a torn or truncated file"),
    ("a metrics.jsonl cut to half", cut_metrics(0.5), "metrics.jsonl"),
    (
        "a metrics.jsonl without its last evaluation",
        lambda run: (run / "metrics.jsonl").write_text(
            "".join((run / "metrics.jsonl").read_text().splitlines(True)[:-1])
        ),
        "stops short: the run has 30 steps, its last evaluation is at step 20",
    ),
    ("no metrics.jsonl", lambda run: (run / "metrics.jsonl").unlink(), "metrics.jsonl cannot be read"),
    (
        "a FIFO for metrics.jsonl (reading it would block for ever)",
        lambda run: (run / "metrics.jsonl").unlink() or os.mkfifo(run / "metrics.jsonl"),
        "metrics.jsonl cannot be read",
    ),
    (
        "a FIFO for summary.json",
        lambda run: (run / "summary.json").unlink() or os.mkfifo(run / "summary.json"),
        "incomplete (no summary.json",
    ),
    (
        "a garbage line inside metrics.jsonl",
        lambda run: (run / "metrics.jsonl").write_text("not json\n" + (run / "metrics.jsonl").read_text()),
        "line 1 is not a JSON record",
    ),
]


@pytest.mark.parametrize("label, how, expect", CLASS_6, ids=[c[0] for c in CLASS_6])
def test_class6_a_damaged_run_is_reported_damaged_never_ok(tmp_path, capsys, label, how, expect):
    root = damaged(how)(tmp_path)
    code, err = run_cli(["report", str(root), "--no-plots"], capsys)
    assert code == 0 and err == "", err  # the report is written; the run is a row
    with open(root / "runs.csv", newline="") as f:
        status = {r["setting"]: r["status"] for r in csv.DictReader(f)}
    assert status["local_sgd"] == "ok" and status["ddp"] != "ok" and expect in status["ddp"], status
    assert status["ddp"] in (root / "report.md").read_text()


# ---------------------------------------------------------------- what is accepted now


def test_class1_a_report_replaces_its_own_files_and_force_replaces_the_users(tmp_path, capsys):
    root = tmp_path / "mine"
    a_run(root)
    assert run_cli(["report", str(root), "--no-plots"], capsys)[0] == 0
    assert run_cli(["report", str(root), "--no-plots"], capsys)[0] == 0  # its own files: replaced
    (root / "report.md").write_text("the user's own\n")
    assert run_cli(["report", str(root), "--no-plots"], capsys)[0] == 1
    assert (root / "report.md").read_text() == "the user's own\n"
    assert run_cli(["report", str(root), "--no-plots", "--force"], capsys)[0] == 0
    assert (root / "report.md").read_text().startswith("# wansync report")


def test_class1_report_force_replaces_a_link_and_never_writes_through_it(tmp_path, capsys):
    """A link the user left at DIR/report.md and DIR/pareto.png: --force replaces the links with the report's
    files; the files they pointed to keep their bytes (the report used to write its plot through the link)."""
    root = tmp_path / "mine"
    a_run(root)
    theirs = tmp_path / "elsewhere"
    theirs.mkdir()
    for name in ("report.md", "pareto.png"):
        (theirs / name).write_text(f"the user's own {name}\n")
        (root / name).symlink_to(theirs / name)
    assert run_cli(["report", str(root)], capsys)[0] == 1  # a link is not wansync's
    assert run_cli(["report", str(root), "--force"], capsys)[0] == 0
    for name in ("report.md", "pareto.png"):
        assert not (root / name).is_symlink() and (root / name).is_file()
        assert (theirs / name).read_text() == f"the user's own {name}\n"


@pytest.mark.parametrize("where", ["/", "~"])
def test_class1_a_report_never_searches_the_whole_file_system_or_a_home(capsys, where):
    import os

    code, err = run_cli(["report", os.path.expanduser(where), "--no-plots"], capsys)
    assert code == 1 and "refusing to search all of" in err and err.count("\n") == 1, err


def test_class3_a_grid_key_a_strategy_lacks_runs_that_strategy_once(tmp_path, capsys):
    """`--grid strategy=ddp,local_sgd --grid sync_every=2,4` used to train two identical ddp runs."""
    code, out, err = run_cli_out(
        [
            "compare",
            "--grid",
            "strategy=ddp,local_sgd",
            "--grid",
            "sync_every=2,4",
            "--dry-run",
            "--out",
            str(tmp_path / "exp"),
        ],
        capsys,
    )
    assert code == 0, err
    assert "3 runs: " in out and "all 3 runs are valid" in out and out.count("/ddp/seed0") == 1


def test_class3_wan_none_is_no_emulated_link_in_a_grid(tmp_path, capsys):
    from wansync.runner import experiments as X
    from wansync.config import build_config

    specs = X.grid_runs(
        build_config(overrides={"out": str(tmp_path)}),
        ["ddp", "local_sgd"],
        1,
        X.parse_grid(["wan=none;two-site", "sync_every=2,4"]),
    )
    assert [s.label for s in specs] == [
        "ddp__wan=none",
        "ddp__wan=two-site",
        "local_sgd__wan=none__sync_every=2",
        "local_sgd__wan=none__sync_every=4",
        "local_sgd__wan=two-site__sync_every=2",
        "local_sgd__wan=two-site__sync_every=4",
    ]
    assert specs[0].cfg.wan == "" and specs[0].cfg.topology is None


@pytest.mark.timeout(300)
def test_class4_a_resume_that_repeats_the_runs_own_flags_continues(tmp_path, capsys):
    argv = finished_run(
        None,
        "--workers",
        "1",
        "--ranks-per-worker",
        "1",
        "--seed",
        "0",
        "--lr",
        "0.003",
        "--strategy",
        "local_sgd",
        "--sync-every",
        "8",
        "--model",
        "tiny",
        "--steps",
        "3",
    )(tmp_path)
    code, err = run_cli([*argv, "--quiet"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "done" / "summary.json").read_text())["steps"] == 3


def _fail_under_torchrun(rank, world_size, corpus):
    """A worker under torchrun whose workload fails: what it raises, and what it printed itself."""
    import contextlib
    import io
    import socket
    import torch.distributed as dist
    from wansync.config import build_config
    from wansync.runner import worker

    dist.destroy_process_group()  # run_ranks' own group: the worker makes its own
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("WANSYNC_LAUNCHED", None)
    cfg = build_config(overrides={"data": corpus, "workers": 1, "model": "micro", "steps": 1})
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        try:
            worker.run(cfg, Path(corpus).parent / "run")
            raised = ""
        except Exception as e:  # noqa: BLE001 - the test inspects it
            raised = f"{type(e).__name__}: {e}"
    return raised, printed.getvalue()


def test_class7_a_worker_under_torchrun_leaves_its_one_line_to_the_command(tmp_path):
    """It raises its line for the CLI to print, once; it used to print it too (twice on the terminal)."""
    from wansync.runner.localgroup import run_ranks

    (tmp_path / "empty.txt").write_text("")
    raised, printed = run_ranks(_fail_under_torchrun, 1, str(tmp_path / "empty.txt"), timeout=120)[0]
    assert raised.startswith("WansyncError: rank 0: ") and "empty" in raised and printed == ""
    assert (tmp_path / "run" / "logs" / "rank0.err").read_text().strip() == raised.removeprefix("WansyncError: ")


if __name__ == "__main__":  # the table: class | input | message
    sys.exit(pytest.main([__file__, "-q"]))


def test_class1_train_force_removes_only_what_the_run_wrote(tmp_path):
    """`train --out RUN --force` over a finished run: a note of the user's in RUN/logs/ and the files behind a
    link RUN/tensorboard stay; the run's own logs, checkpoints and metrics are replaced."""
    from cli_harness import TINY, wansync

    run = tmp_path / "run"
    args = ["train", "--strategy", "ddp", "--workers", "1", "--steps", "2", "--quiet", "--out", str(run), *TINY]
    assert wansync(*args, timeout=120).returncode == 0
    (run / "logs").mkdir(exist_ok=True)
    (run / "logs" / "notes.txt").write_text("mine\n")
    (run / "logs" / "rank0.err").write_text("an old failure\n")
    elsewhere = tmp_path / "boards"
    elsewhere.mkdir()
    (elsewhere / "events.out.tfevents.1.host").write_text("someone else's\n")
    (run / "tensorboard").symlink_to(elsewhere)
    r = wansync(*args, "--force", timeout=120)
    assert r.returncode == 0, r.stderr
    assert (run / "logs" / "notes.txt").read_text() == "mine\n"
    assert not (run / "logs" / "rank0.err").exists()
    assert (elsewhere / "events.out.tfevents.1.host").read_text() == "someone else's\n"
    assert not (run / "tensorboard").exists()  # the link itself was the run's name: removed
    assert (run / "summary.json").is_file() and (run / "checkpoints" / "step00000002").is_dir()
