"""Every way a user can get the input wrong ends in one clear line and a non-zero exit.

`python tests/test_bad_inputs.py` prints the table of inputs and the messages they produce.
"""
from __future__ import annotations

import gzip
import pickle
import sys
from pathlib import Path
from typing import Callable

import pytest

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
        from wansync.cli import main
        import atexit
        import shutil
        root = Path(tempfile.mkdtemp(prefix="wansync-done-"))
        atexit.register(shutil.rmtree, root, True)
        run = root / "done"
        with pytest.raises(SystemExit) as e:
            main(["train", "--strategy", "local_sgd", "--workers", "1", "--steps", "2", "--out", str(run),
                  "--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--quiet"])
        assert e.value.code == 0
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
            return ["train", "--out", str(tmp / "run"), "--workers", "1", "--model", "cnn", "--data", f"imagefolder:{d}"]
        if kind in ("imagefolder_no_val", "imagefolder_corrupt"):
            for c in ("cat", "dog"):
                (d / "train" / c).mkdir(parents=True)
                (d / "train" / c / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
            if kind == "imagefolder_corrupt":
                (d / "val" / "cat").mkdir(parents=True)
                (d / "val" / "cat" / "b.png").write_bytes(b"garbage")
            return ["train", "--out", str(tmp / "run"), "--workers", "1", "--model", "cnn", "--data", f"imagefolder:{d}"]
        if kind == "fmnist_truncated":
            for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                         "t10k-labels-idx1-ubyte"):
                (d / f"{name}.gz").write_bytes(gzip.compress(b"\x00\x00\x08\x03" + bytes(100))[:30])
            return ["train", "--out", str(tmp / "run"), "--workers", "1", "--model", "cnn", "--data", f"fashion-mnist:{d}"]
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
    ("--lr nan", flags("--lr", "nan"), "lr must be > 0, got nan"),
    ("--batch-size 0", flags("--batch-size", "0"), "batch_size must be >= 1, got 0"),
    ("--seq-len 1", flags("--seq-len", "1"), "seq_len must be >= 2, got 1"),
    ("--tokenizer wordpiece", flags("--tokenizer", "wordpiece"), "tokenizer must be byte or bpe"),
    ("--optimizer lamb", flags("--optimizer", "lamb"), "optimizer must be adamw or sgd"),
    ("--lr-schedule step", flags("--lr-schedule", "step"), "lr_schedule must be constant or cosine"),
    ("--momentum 1.5", flags("--momentum", "1.5"), "momentum must be in [0, 1), got 1.5"),
    ("--on-nonfinite ignore", flags("--on-nonfinite", "ignore"), "on_nonfinite must be abort or skip"),
    ("--peer-timeout 0", flags("--peer-timeout", "0"), "peer_timeout must be > 0"),
    ("--backend mpi", flags("--backend", "mpi"), "backend must be gloo or nccl"),
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
    ("--resume a run without checkpoints", finished_run(lambda run: __import__("shutil").rmtree(run / "checkpoints")),
     "no checkpoint in"),
    ("--resume a corrupted checkpoint", finished_run(corrupt), "is corrupted or truncated"),
    ("--resume a truncated checkpoint", finished_run(truncate), "is corrupted or truncated"),
    ("--resume with --lr 1", finished_run(None, "--lr", "1"), "cannot change lr when resuming"),
    ("--resume with --steps below the checkpoint", finished_run(None, "--steps", "1"),
     "is below the checkpoint's step 2"),
    ("an empty text corpus", data_dir("empty_text"), "empty"),
    ("a CIFAR directory with missing files", data_dir("cifar_missing"), "test"),
    ("a truncated CIFAR file", data_dir("cifar_truncated"), "cifar"),
    ("a malformed image folder", data_dir("imagefolder_empty"), "has no class directories"),
    ("a truncated Fashion-MNIST file", data_dir("fmnist_truncated"), "is truncated or corrupt"),
    ("an image folder without a val/ split", data_dir("imagefolder_no_val"), "has no val/ (or test/) split"),
    ("an image folder with a corrupt image", data_dir("imagefolder_corrupt"), "cannot read image"),
]
if "slowmo" in STRATEGIES:
    CASES.append(("--strategy slowmo --slowmo-beta 1.0", flags("--strategy", "slowmo", "--slowmo-beta", "1.0"),
                  "slowmo_beta"))
if "streaming" in STRATEGIES:
    CASES.append(("--strategy streaming --fragments 99", flags("--strategy", "streaming", "--fragments", "99"),
                  "fragments"))
    CASES.append(("--strategy streaming --codec zip", flags("--strategy", "streaming", "--codec", "zip"), "zip"))


def run_case(setup: Setup, tmp: Path, capsys) -> tuple[int, str]:
    from wansync.cli import main
    argv = setup(tmp)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    return int(e.value.code or 0), capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("label, setup, expect", CASES, ids=[c[0] for c in CASES])
def test_bad_input(tmp_path, capsys, label, setup, expect):
    code, err = run_case(setup, tmp_path, capsys)
    assert code != 0, f"{label}: exit 0"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"{label}: {err}"
    assert lines[0].startswith("wansync: error: ") and "Traceback" not in err
    assert expect.lower() in lines[0].lower(), f"{label}: {lines[0]}"


if __name__ == "__main__":                       # print the table: input | message
    import tempfile

    class _Cap:
        def readouterr(self):
            import io
            out = sys.stderr.getvalue() if isinstance(sys.stderr, io.StringIO) else ""
            sys.stderr = io.StringIO()
            return type("R", (), {"err": out})()
    import io
    print("| # | input | message |\n|---|---|---|")
    for i, (label, setup, _) in enumerate(CASES, 1):
        with tempfile.TemporaryDirectory() as d:
            real = sys.stderr
            sys.stderr = io.StringIO()
            try:
                code, err = run_case(setup, Path(d), _Cap())
            finally:
                sys.stderr = real
            print(f"| {i} | {label} | `{err.strip()}` (exit {code}) |")
