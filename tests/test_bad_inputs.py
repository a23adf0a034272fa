"""Every way a user can get the input wrong ends in one clear line and a non-zero exit.

`python tests/test_bad_inputs.py` prints the table of inputs and the messages they produce.
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path
from typing import Callable

import pytest

from cli_harness import wansync
from wansync.strategies import STRATEGIES

Setup = Callable[[Path], list[str]]


def flags(*args: str) -> Setup:
    return lambda tmp: ["train", "--out", str(tmp / "run"), *args]


def config_file(text: str) -> Setup:
    def make(tmp: Path) -> list[str]:
        (tmp / "c.toml").write_text(text)
        return ["train", "--out", str(tmp / "run"), "--config", str(tmp / "c.toml")]

    return make


_FINISHED: list[Path] = []


def _finished_template() -> Path:
    """One real 2-step run with a checkpoint, made once and copied for every case that needs it."""
    if not _FINISHED:
        import tempfile
        import atexit
        import shutil

        root = Path(tempfile.mkdtemp(prefix="wansync-done-"))
        atexit.register(shutil.rmtree, root, True)
        run = root / "done"
        r = wansync(
            "train",
            "--strategy",
            "local_sgd",
            "--workers",
            "1",
            "--steps",
            "2",
            "--out",
            str(run),
            "--model",
            "tiny",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--eval-batches",
            "1",
            "--quiet",
            timeout=240,
        )
        assert r.returncode == 0, r.stderr
        _FINISHED.append(run)
    return _FINISHED[0]


def finished_run(mutate: Callable[[Path], None] | None, *extra: str) -> Setup:
    """A real finished run with a checkpoint, optionally damaged, then --resume."""

    def make(tmp: Path) -> list[str]:
        import shutil

        run = tmp / "done"
        shutil.copytree(_finished_template(), run)
        if mutate:
            mutate(run)
        return ["train", "--resume", str(run), *extra]

    return make


def _ckpt(run: Path) -> Path:
    return next((run / "checkpoints").glob("step*/rank0.pt"))


def corrupt(run: Path) -> None:
    _ckpt(run).write_bytes(b"this is not a checkpoint" * 10)


def truncate(run: Path) -> None:
    p = _ckpt(run)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def foreign_dir(tmp: Path) -> list[str]:
    (tmp / "foreign").mkdir()
    (tmp / "foreign" / "notes.txt").write_text("hello")
    return ["train", "--resume", str(tmp / "foreign")]


def data_dir(kind: str) -> Setup:
    def make(tmp: Path) -> list[str]:
        d = tmp / "data"
        d.mkdir()
        if kind == "empty_text":
            (d / "empty.txt").write_text("")
            return ["train", "--out", str(tmp / "run"), "--workers", "1", "--data", str(d / "empty.txt")]
        if kind == "cifar_missing":
            (d / "train").write_bytes(pickle.dumps({b"data": b"", b"fine_labels": []}))
            return ["train", "--out", str(tmp / "run"), "--workers", "1", "--model", "cnn", "--data", f"cifar100:{d}"]
        if kind == "cifar_truncated":
            for name in ("train", "test", "meta"):
                (d / name).write_bytes(pickle.dumps({b"data": bytes(3072 * 4), b"fine_labels": [0] * 4})[:40])
            return ["train", "--out", str(tmp / "run"), "--workers", "1", "--model", "cnn", "--data", f"cifar100:{d}"]
        if kind == "imagefolder_empty":
            (d / "train").mkdir()
            return [
                "train",
                "--out",
                str(tmp / "run"),
                "--workers",
                "1",
                "--model",
                "cnn",
                "--data",
                f"imagefolder:{d}",
            ]
        if kind in ("imagefolder_no_val", "imagefolder_corrupt"):
            for c in ("cat", "dog"):
                (d / "train" / c).mkdir(parents=True)
                (d / "train" / c / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
            if kind == "imagefolder_corrupt":
                (d / "val" / "cat").mkdir(parents=True)
                (d / "val" / "cat" / "b.png").write_bytes(b"garbage")
            return [
                "train",
                "--out",
                str(tmp / "run"),
                "--workers",
                "1",
                "--model",
                "cnn",
                "--data",
                f"imagefolder:{d}",
            ]
        if kind == "fmnist_truncated":
            for name in (
                "train-images-idx3-ubyte",
                "train-labels-idx1-ubyte",
                "t10k-images-idx3-ubyte",
                "t10k-labels-idx1-ubyte",
            ):
                (d / f"{name}.gz").write_bytes(gzip.compress(b"\x00\x00\x08\x03" + bytes(100))[:30])
            return [
                "train",
                "--out",
                str(tmp / "run"),
                "--workers",
                "1",
                "--model",
                "cnn",
                "--data",
                f"fashion-mnist:{d}",
            ]
        raise AssertionError(kind)

    return make


CASES: list[tuple[str, Setup, str]] = [
    ("--sync-every 0", flags("--strategy", "local_sgd", "--sync-every", "0"), "sync_every must be >= 1, got 0"),
    ("--strategy nope", flags("--strategy", "nope"), "unknown strategy 'nope'"),
    ("--workers 0", flags("--workers", "0"), "workers must be >= 1, got 0"),
    ("--steps abc", flags("--steps", "abc"), "steps must be an integer, got 'abc'"),
    ("--steps 0", flags("--steps", "0"), "steps must be >= 1, got 0"),
    ("--data /no/such.txt", flags("--data", "/no/such.txt"), "data path not found: /no/such.txt"),
    ("--model gpt5", flags("--model", "gpt5"), "unknown model 'gpt5'"),
    ("--lr -1", flags("--lr", "-1"), "lr must be > 0, got -1.0"),
    ("--lr nan", flags("--lr", "nan"), "lr must be a finite number, got nan"),
    ("--batch-size 0", flags("--batch-size", "0"), "batch_size must be >= 1, got 0"),
    ("--seq-len 1", flags("--seq-len", "1"), "seq_len must be >= 2, got 1"),
    (
        "--seq-len beyond the model's",
        flags("--model", "micro", "--seq-len", "512"),
        "seq_len must be in [1, 256] for model 'micro', got 512",
    ),
    ("--tokenizer wordpiece", flags("--tokenizer", "wordpiece"), "tokenizer must be byte or bpe"),
    ("--optimizer lamb", flags("--optimizer", "lamb"), "optimizer must be one of adamw, sgd, muon"),
    ("--lr-schedule step", flags("--lr-schedule", "step"), "lr_schedule must be constant or cosine"),
    ("--momentum 1.5", flags("--momentum", "1.5"), "momentum must be in [0, 1), got 1.5"),
    ("--on-nonfinite ignore", flags("--on-nonfinite", "ignore"), "on_nonfinite must be abort or skip"),
    ("--peer-timeout 0", flags("--peer-timeout", "0"), "peer_timeout must be in [1, 86400], got 0.0"),
    ("--backend mpi", flags("--backend", "mpi"), "backend must be gloo or nccl"),
    *(
        [("--backend nccl without a GPU", flags("--backend", "nccl"), "--backend nccl needs CUDA GPUs")]
        if not __import__("torch").cuda.is_available()
        else []
    ),
    ("--val-fraction 1.5", flags("--val-fraction", "1.5"), "val_fraction must be in (0, 1)"),
    ("--eval-every 0", flags("--eval-every", "0"), "eval_every must be >= 1, got 0"),
    ("--threads -1", flags("--threads", "-1"), "threads must be >= 0, got -1"),
    ("--wan rtt=abc", flags("--wan", "rtt=abc"), "rtt"),
    ("--wan rtt=10ms,bw=0gbit", flags("--wan", "rtt=10ms,bw=0gbit"), "bandwidth"),
    ("--wan moon", flags("--wan", "moon"), "moon"),
    ("--bogus-flag 1", flags("--bogus-flag", "1"), "unrecognized arguments: --bogus-flag"),
    ("--config /no/such.toml", flags("--config", "/no/such.toml"), "config file not found: /no/such.toml"),
    ("config: invalid TOML", config_file("[run\nsteps = 3\n"), "is not valid TOML"),
    ("config: unknown key", config_file("[strategy]\nsync_evry = 3\n"), "unknown config key 'sync_evry'"),
    ("config: unknown section", config_file("[training]\nsteps = 3\n"), "unknown section [training]"),
    ("config: wrong type", config_file("[run]\nsteps = 'ten'\n"), "steps must be an integer, got 'ten'"),
    ("config: key in the wrong section", config_file("[model]\nsteps = 3\n"), "key 'steps' belongs in [run]"),
    ("--resume /no/such/dir", lambda tmp: ["train", "--resume", "/no/such/dir"], "is not a directory"),
    ("--resume a foreign directory", foreign_dir, "is not a wansync run directory"),
    (
        "--resume a run without checkpoints",
        finished_run(lambda run: __import__("shutil").rmtree(run / "checkpoints")),
        "no checkpoint in",
    ),
    ("--resume a corrupted checkpoint", finished_run(corrupt, "--steps", "4"), "is corrupted or truncated"),
    ("--resume a truncated checkpoint", finished_run(truncate, "--steps", "4"), "is corrupted or truncated"),
    ("--resume with --lr 1", finished_run(None, "--lr", "1"), "cannot change lr when resuming"),
    (
        "--resume with --steps below the checkpoint",
        finished_run(None, "--steps", "1"),
        "is below the checkpoint's step 2",
    ),
    ("an empty text corpus", data_dir("empty_text"), "empty"),
    ("a CIFAR directory with missing files", data_dir("cifar_missing"), "test"),
    ("a truncated CIFAR file", data_dir("cifar_truncated"), "cifar"),
    ("a malformed image folder", data_dir("imagefolder_empty"), "has no class directories"),
    ("a truncated Fashion-MNIST file", data_dir("fmnist_truncated"), "is truncated or corrupt"),
    ("an image folder without a val/ split", data_dir("imagefolder_no_val"), "has no val/ (or test/) split"),
    ("an image folder with a corrupt image", data_dir("imagefolder_corrupt"), "cannot read image"),
]


def out_under_a_file(tmp: Path) -> list[str]:
    (tmp / "file.txt").write_text("x")
    return ["train", "--out", str(tmp / "file.txt" / "run")]


def out_is_a_file(tmp: Path) -> list[str]:
    (tmp / "file.txt").write_text("x")
    return ["train", "--out", str(tmp / "file.txt")]


def out_foreign(tmp: Path) -> list[str]:
    (tmp / "work" / "checkpoints").mkdir(parents=True)
    (tmp / "work" / "checkpoints" / "my_model.pt").write_bytes(b"theirs")
    return ["train", "--out", str(tmp / "work")]


def corpus(content: bytes, folder: bool = False) -> Setup:
    def make(tmp: Path) -> list[str]:
        path = tmp / "corpus" / "a.txt" if folder else tmp / "corpus.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        return ["train", "--out", str(tmp / "run"), "--data", str(path.parent if folder else path)]

    return make


def report_on(kind: str) -> Setup:
    def make(tmp: Path) -> list[str]:
        target = tmp / "target"
        if kind == "file":
            target.write_text("not a directory")
        elif kind in ("empty", "foreign"):
            target.mkdir()
            if kind == "foreign":
                (target / "notes.txt").write_text("hello")
                (target / "data.json").write_text("[1, 2, 3]")
        elif kind == "damaged":
            target.mkdir()
            (target / "config.toml").write_bytes(b"\xff\xfe not toml")
            (target / "metrics.jsonl").write_bytes(b'{"type": "eval", "step": "x"}\n[1, 2]\n\xff\xfe\n{torn')
            return ["report", str(target), "--no-plots"]
        return ["report", str(target if kind != "proc" else "/proc"), "--no-plots"]

    return make


def edited_config(old: str, new: str) -> Callable[[Path], None]:
    def mutate(run: Path) -> None:
        text = (run / "config.toml").read_text()
        assert old in text
        (run / "config.toml").write_text(text.replace(old, new))

    return mutate


BIG = str(2**70)
CASES += [
    # item 9: output paths the operating system refuses
    (
        "--out on a pseudo file system (/proc)",
        lambda tmp: ["train", "--out", "/proc/wansync-run"],
        "cannot create run directory /proc/wansync-run",
    ),
    ("--out on sysfs", lambda tmp: ["train", "--out", "/sys/kernel/wansync-run"], "cannot create run directory"),
    ("--out an over-long name", lambda tmp: ["train", "--out", str(tmp / ("a" * 300))], "file name too long"),
    ("--out below a regular file", out_under_a_file, "cannot create run directory"),
    ("--out an existing file", out_is_a_file, "exists and is not a directory"),
    (
        "--out /proc (a non-empty system directory)",
        lambda tmp: ["train", "--out", "/proc"],
        "not empty and not a wansync run",
    ),
    ("--out a folder holding someone's checkpoints/", out_foreign, "not empty and not a wansync run"),
    (
        "--out an existing run without --force",
        lambda tmp: ["train", "--out", finished_run(None)(tmp)[2]],
        "already holds a wansync run",
    ),
    # an empty --data value; binary corpora
    ("--data ''", flags("--data", ""), "data must name a dataset"),
    ("--data '   '", flags("--data", "   "), "data must name a dataset"),
    ("a binary corpus file", corpus(b"\x7fELF\x00\x01\x02" * 100), "is binary"),
    ("a corpus folder with a binary .txt", corpus(b"PK\x03\x04\x00\x00" * 50, folder=True), "is binary"),
    # report on things it did not write
    ("report on a file", report_on("file"), "is not a directory"),
    ("report on an empty directory", report_on("empty"), "no runs found"),
    ("report on a foreign directory", report_on("foreign"), "no runs found"),
    ("report on /proc (racy: either it cannot read it or finds no runs)", report_on("proc"), "/proc"),
    # combinations that make no sense
    (
        "--warmup-steps 50 --steps 10",
        flags("--warmup-steps", "50", "--steps", "10"),
        "warmup_steps (50) must not exceed steps (10)",
    ),
    (
        "plan --strategy ddp --codec int8 (it planned fp32)",
        lambda tmp: ["plan", "--strategy", "ddp", "--codec", "int8", "--params", "1e9", "--wan", "lan"],
        "ddp has no option codec",
    ),
    (
        "--wan two-site --workers 1",
        flags("--wan", "two-site", "--workers", "1"),
        "has 2 sites but the run has 1 workers",
    ),
    ("--wan ...,sites=3 --workers 2", flags("--wan", "rtt=10ms,bw=1gbit,sites=3", "--workers", "2"), "has 3 sites"),
    (
        "--wan two-site --workers 1 --ranks-per-worker 2 (sites hold whole workers)",
        flags("--wan", "two-site", "--workers", "1", "--ranks-per-worker", "2"),
        "has 2 sites but the run has 1 workers",
    ),
    ("--ranks-per-worker 0", flags("--ranks-per-worker", "0"), "ranks_per_worker must be >= 1, got 0"),
    (
        "--workers 2**20 --ranks-per-worker 2**20",
        flags("--workers", str(2**20), "--ranks-per-worker", str(2**20)),
        "workers x ranks_per_worker is too large",
    ),
    # integers too large for the C++ side; floats that are not finite
    ("--seed 2**70", flags("--seed", BIG), "seed is too large"),
    ("--threads 2**40", flags("--threads", str(2**40)), "threads is too large"),
    ("--batch-size 2**40", flags("--batch-size", str(2**40)), "batch_size is too large"),
    ("--workers 2**33", flags("--workers", str(2**33)), "workers is too large"),
    ("--steps 2**70", flags("--steps", BIG), "steps is too large"),
    ("--sync-every 2**70", flags("--strategy", "local_sgd", "--sync-every", BIG), "sync_every is too large"),
    ("--weight-decay inf", flags("--weight-decay", "inf"), "weight_decay must be a finite number"),
    ("--grad-clip inf", flags("--grad-clip", "inf"), "grad_clip must be a finite number"),
    ("--width inf", flags("--width", "inf"), "width must be a finite number"),
    ("--peer-timeout inf", flags("--peer-timeout", "inf"), "peer_timeout must be a finite number"),
    # resume: what it would ignore, a finished run, a hand-edited config
    ("--resume with --config", finished_run(None, "--config", "/dev/null", "--steps", "4"), "--config cannot be used"),
    ("--resume with --preset", finished_run(None, "--preset", "cpdp-wan"), "--preset cannot be used"),
    ("--resume with --force", finished_run(None, "--force"), "--force cannot be used"),
    (
        "--resume with another --out",
        finished_run(None, "--out", "/tmp/elsewhere", "--steps", "4"),
        "--out cannot be given with --resume",
    ),
    ("--resume a finished run", finished_run(None), "already finished all 2 steps"),
    (
        "--resume with another --ranks-per-worker",
        finished_run(None, "--ranks-per-worker", "2", "--steps", "4"),
        "cannot change ranks_per_worker when resuming",
    ),
    (
        "--resume after config.toml was edited (lr)",
        finished_run(edited_config("lr = 0.003", "lr = 0.1"), "--steps", "4"),
        "(changed: lr)",
    ),
    (
        "--resume after config.toml was edited (strategy)",
        finished_run(edited_config('strategy = "local_sgd"', 'strategy = "ddp"'), "--steps", "4"),
        "changed: ",
    ),
]


# a sparse exchange's knobs (sparseloco, demo)
SPARSE = ("--strategy", "sparseloco")
CASES += [
    ("sparseloco --density 0", flags(*SPARSE, "--density", "0"), "density must be in (0, 1], got 0.0"),
    ("sparseloco --density 1.5", flags(*SPARSE, "--density", "1.5"), "density must be in (0, 1], got 1.5"),
    ("sparseloco --density nan", flags(*SPARSE, "--density", "nan"), "density must be a finite number"),
    ("demo --density 0", flags("--strategy", "demo", "--density", "0"), "density must be in (0, 1]"),
    ("sparseloco --chunk 0", flags(*SPARSE, "--chunk", "0"), "chunk must be >= 1, got 0"),
    (
        "sparseloco --chunk larger than every tensor",
        flags(*SPARSE, "--chunk", "2000"),
        "chunk 2000 is larger than every tensor of the model (its longest side is 1024)",
    ),
    ("sparseloco --bits 1", flags(*SPARSE, "--bits", "1"), "bits must be one of 2, 3, 4, 5, 6, 7, 8"),
    ("sparseloco --bits 16", flags(*SPARSE, "--bits", "16"), "or 32 (values unquantized), got 16"),
    (
        "sparseloco --topk larger than a chunk",
        flags(*SPARSE, "--topk", "5000"),
        "topk must be at most a chunk's values (64 x 64 = 4096), got 5000",
    ),
    ("sparseloco --topk and --density", flags(*SPARSE, "--topk", "5", "--density", "0.1"), "give density or topk"),
    ("sparseloco --aggregate sum", flags(*SPARSE, "--aggregate", "sum"), "aggregate must be chosen or all"),
    ("sparseloco --error-decay 1.5", flags(*SPARSE, "--error-decay", "1.5"), "error_decay must be in [0, 1]"),
    ("sparseloco --codec int8", flags(*SPARSE, "--codec", "int8"), "sparseloco has no option codec"),
    ("demo --dct", flags("--strategy", "demo", "--dct"), "demo has no option dct"),
    (
        "demo --momentum-decay 1",
        flags("--strategy", "demo", "--momentum-decay", "1"),
        "momentum_decay must be in [0, 1)",
    ),
    (
        "demo --optimizer adamw",
        flags("--strategy", "demo", "--optimizer", "adamw"),
        "demo replaces the inner optimizer's update",
    ),
    ("demo --momentum 0.9", flags("--strategy", "demo", "--momentum", "0.9"), "--momentum would be ignored"),
    ("demo --fault-tolerant", flags("--strategy", "demo", "--fault-tolerant"), "demo: it exchanges at every step"),
]


# an uneven world: topology files and slow policies
TOPOLOGY = """
[sites.a]
workers = 2
speeds = [1.0, 0.5]
[sites.b]
workers = 2
[[links]]
sites = ["a", "b"]
rtt = "20ms"
bw = "1gbit"
[[schedules]]
links = "all"
steps = [{ at = "10s", scale = 0.1 }, { at = "20s", scale = 1.0 }]
"""


def topology(text: str, suffix: str = ".toml", workers: int = 4) -> Setup:
    def make(tmp: Path) -> list[str]:
        path = tmp / f"sites{suffix}"
        path.write_text(text)
        return ["train", "--out", str(tmp / "run"), "--workers", str(workers), "--wan", str(path)]

    return make


CASES += [
    (
        "--wan FILE: a pair with no link",
        topology(TOPOLOGY.replace('sites = ["a", "b"]', 'from = "a"\nto = "b"')),
        "no link from 'b' to 'a' (only a to b is given)",
    ),
    (
        "--wan FILE: a site with no workers",
        topology(TOPOLOGY.replace("workers = 2\n[[links]]", "workers = 0\n[[links]]")),
        "[sites.b] workers: a site with no workers",
    ),
    ("--wan FILE: a zero speed", topology(TOPOLOGY.replace("[1.0, 0.5]", "[1.0, 0.0]")), "speed must be positive"),
    (
        "--wan FILE: a schedule going back in time",
        topology(TOPOLOGY.replace('at = "20s"', 'at = "5s"')),
        "schedule steps go back in time: 5 s after 10 s",
    ),
    ("--wan FILE: an unknown key", topology("colour = 1\n" + TOPOLOGY), "the top level: unknown key 'colour'"),
    (
        "--wan FILE: a file that does not parse",
        topology(TOPOLOGY.replace('rtt = "20ms"', "rtt = 20ms")),
        "does not parse: line %d: " % (TOPOLOGY.splitlines().index('rtt = "20ms"') + 1),
    ),
    ("--wan FILE.yaml that does not parse", topology("sites:\n  a: [1\n", suffix=".yaml"), "does not parse: line 3"),
    (
        "--wan FILE with 4 workers, --workers 3",
        topology(TOPOLOGY, workers=3),
        "has 4 workers (a 2, b 2) but the run has 3",
    ),
    (
        "--wan a directory",
        lambda tmp: ["train", "--out", str(tmp / "run"), "--wan", str(tmp) + "/"],
        "is a directory, not a regular file",
    ),
    ("--wan a missing FILE", flags("--wan", "/nonexistent/sites.toml"), "topology file not found"),
    (
        "--slow-policy fast",
        flags("--strategy", "diloco", "--slow-policy", "fast"),
        "slow_policy must be one of wait, deadline, balanced",
    ),
    (
        "cpdp --slow-policy balanced",
        flags("--strategy", "cpdp", "--slow-policy", "balanced"),
        "cpdp takes slow_policy wait only",
    ),
    (
        "--deadline without its policy",
        flags("--strategy", "diloco", "--deadline", "5"),
        "deadline 5 s does nothing under slow_policy wait",
    ),
    (
        "--slow-policy balanced --fault-tolerant",
        flags("--strategy", "diloco", "--slow-policy", "balanced", "--fault-tolerant"),
        "takes slow_policy wait only",
    ),
    (
        "ddp --slow-policy balanced",
        flags("--strategy", "ddp", "--slow-policy", "balanced"),
        "ddp has no option slow_policy",
    ),
    (
        "local_sgd --overlap-rounds",
        flags("--strategy", "local_sgd", "--overlap-rounds"),
        "local_sgd has no option overlap_rounds (it would be ignored)",
    ),
    (
        "--overlap-rounds --fault-tolerant",
        flags("--strategy", "diloco", "--overlap-rounds", "--fault-tolerant"),
        "--fault-tolerant does not take overlap_rounds",
    ),
]


if "slowmo" in STRATEGIES:
    CASES.append(
        ("--strategy slowmo --slowmo-beta 1.0", flags("--strategy", "slowmo", "--slowmo-beta", "1.0"), "slowmo_beta")
    )
if "streaming" in STRATEGIES:
    CASES.append(
        ("--strategy streaming --fragments 99", flags("--strategy", "streaming", "--fragments", "99"), "fragments")
    )
    CASES.append(("--strategy streaming --codec zip", flags("--strategy", "streaming", "--codec", "zip"), "zip"))


def run_case(setup: Setup, tmp: Path) -> tuple[int, str]:
    """The CLI on the case's arguments in a process of its own (`cli_harness`: forked, so that it
    forks its workers as a user's `wansync` does), and what it wrote to stderr."""
    r = wansync(*setup(tmp), timeout=240)
    return r.returncode, r.stderr


def test_report_reads_past_damaged_config_and_metrics_lines(tmp_path):
    code, err = run_case(report_on("damaged"), tmp_path)
    assert code == 0 and err == ""  # the run is listed as incomplete, nothing raised


@pytest.mark.timeout(300)  # the first resume case trains the template run
@pytest.mark.parametrize("label, setup, expect", CASES, ids=[c[0] for c in CASES])
def test_bad_input(tmp_path, label, setup, expect):
    code, err = run_case(setup, tmp_path)
    assert code != 0, f"{label}: exit 0"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"{label}: {err}"
    assert lines[0].startswith("wansync: error: ") and "Traceback" not in err
    assert expect.lower() in lines[0].lower(), f"{label}: {lines[0]}"


if __name__ == "__main__":  # print the table: input | message
    import tempfile

    print("| # | input | message |\n|---|---|---|")
    for i, (label, setup, _) in enumerate(CASES, 1):
        with tempfile.TemporaryDirectory() as d:
            code, err = run_case(setup, Path(d))
        print(f"| {i} | {label} | `{err.strip()}` (exit {code}) |")
