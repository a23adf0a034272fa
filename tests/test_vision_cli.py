"""Vision through the CLI: data/model kinds, vision defaults, the LR rule, the CPDP presets (dry runs),
and one real vision compare on a tiny CIFAR-format directory (per-epoch test accuracy, report)."""

from __future__ import annotations

import csv
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from cli_harness import wansync
from wansync.runner import experiments as X
from wansync.cli import main
from wansync.config import build_config, replace
from wansync.errors import ConfigError
from wansync.trainer.optim import lr_at, peak_lr
from wansync.presets import PRESETS

pytestmark = pytest.mark.timeout(200)


def write_tiny_cifar(d: Path, n_train: int = 32, n_test: int = 16, classes: int = 100) -> Path:
    """A CIFAR-100 python-format directory (train, test, meta) with random 32x32 RGB images."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, n in (("train", n_train), ("test", n_test)):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        with open(d / name, "wb") as f:
            pickle.dump({b"data": data, b"fine_labels": [int(v) for v in rng.integers(0, 4, n)]}, f)
    with open(d / "meta", "wb") as f:
        pickle.dump({b"fine_label_names": [f"c{i}".encode() for i in range(classes)]}, f)
    return d


def _cli(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


# ---------------------------------------------------------------- defaults and the LR rule


def test_default_data_and_hyperparameters_follow_the_model_kind():
    lm = build_config(overrides={})
    assert (lm.model, lm.data, lm.batch_size, lm.optimizer, lm.lr, lm.weight_decay) == (
        "tiny",
        "shakespeare",
        16,
        "adamw",
        3e-3,
        0.0,
    )  # LM defaults unchanged
    v = build_config(overrides={"model": "cnn"})
    assert (v.data, v.batch_size, v.optimizer, v.lr, v.weight_decay, v.warmup_steps) == (
        "fashion-mnist",
        64,
        "sgd",
        0.1,
        5e-4,
        0,
    )
    a = build_config(overrides={"model": "resnet18", "optimizer": "adamw", "batch_size": 8})
    assert (a.data, a.batch_size, a.lr, a.weight_decay) == ("fashion-mnist", 8, 3e-3, 0.0)  # given keys win
    # a grid over the model: the default dataset follows the kind, a named one stays (and is rejected later)
    assert replace(lm, model="cnn").data == "fashion-mnist" and replace(v, model="tiny").data == "shakespeare"
    assert replace(build_config(overrides={"data": "cifar100:/x"}), model="cnn").data == "cifar100:/x"


def test_linear_lr_scaling():
    c = build_config(
        overrides={
            "model": "cnn",
            "workers": 4,
            "batch_size": 256,
            "lr_scaling": "linear",
            "warmup_steps": 0,
            "lr_schedule": "constant",
        }
    )
    assert peak_lr(c) == pytest.approx(0.4) and lr_at(c, 5, world_size=4) == pytest.approx(0.4)
    assert peak_lr(c, world_size=2) == pytest.approx(0.2)
    assert peak_lr(replace(c, lr_scaling="none")) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="lr_scaling must be none or linear"):
        build_config(overrides={"lr_scaling": "sqrt"})


# ---------------------------------------------------------------- dataset / model kind errors


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "cnn", "--data", "mnist2"], "unknown vision dataset 'mnist2'"),
        (
            ["--model", "tiny", "--data", "fashion-mnist"],
            "model 'tiny' is a language model and cannot train on the image",
        ),
        (["--model", "small", "--data", "cifar100:/x"], "cannot train on the image dataset 'cifar100:/x'"),
        (["--model", "cnn", "--data", "shakespeare"], "vision model 'cnn' needs an image dataset, got 'shakespeare'"),
        (["--model", "vit_s", "--data", "hf:allenai/c4"], "needs an image dataset, got 'hf:allenai/c4'"),
        (["--model", "resnet18", "--data", "cifar100"], "'cifar100' needs a path: cifar100:PATH"),
        (["--model", "cnn", "--data", "imagefolder:/no/such/dir"], "data path not found: /no/such/dir"),
    ],
)
def test_dataset_and_model_kind_must_match(tmp_path, capsys, argv, message):
    """Checked in the launching process: train stops before writing anything, and so does compare,
    which checks every run before the first (one line naming the first that cannot start)."""
    code, _, err = _cli(capsys, "train", *argv, "--out", str(tmp_path / "x"))
    assert code != 0 and err.startswith("wansync: error: ") and len(err.strip().splitlines()) == 1, err
    assert message in err, err
    assert not (tmp_path / "x").exists()
    code, _, err = _cli(capsys, "compare", "--strategies", "ddp,local_sgd", *argv, "--out", str(tmp_path / "c"))
    assert code != 0 and err.startswith("wansync: error: ddp seed 0: ") and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "c").exists()  # nothing started, nothing written


def test_a_text_path_for_a_vision_model(tmp_path, capsys):
    (tmp_path / "plays.txt").write_text("to be or not to be\n")
    code, _, err = _cli(
        capsys, "train", "--model", "cnn", "--data", str(tmp_path / "plays.txt"), "--out", str(tmp_path / "x")
    )
    assert code != 0 and "needs an image dataset" in err and "a text corpus" in err
    assert len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- the CPDP presets

EXPECTED = {
    "cpdp-k-sweep": ["ddp", *(f"cpdp__sync_every={k}" for k in (1, 2, 4, 8, 16, 32))],
    "cpdp-beta": ["cpdp__slowmo_beta=0", "cpdp__slowmo_beta=0.3", "cpdp__slowmo_beta=0.9"],
    "cpdp-lr-protocol": [f"{s}__lr_scaling={r}" for s in ("ddp", "local_sgd", "cpdp") for r in ("none", "linear")],
    "cpdp-ablation": ["ddp", "local_sgd", "slowmo", "cpdp__slowmo_beta=0", "cpdp__slowmo_beta=0.3"],
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_cpdp_presets_expand_to_their_grid(tmp_path, capsys, name):
    preset = PRESETS[name]
    assert any("LR rule" in n for n in preset.notes)  # spec §8: the rule is stated
    for command in ("compare", "sweep"):
        code, out, err = _cli(capsys, command, "--preset", name, "--dry-run", "--out", str(tmp_path / "p"))
        assert code == 0, err
        labels = [Path(line.split()[0]).parent.name for line in out.splitlines() if "/seed0  ok" in line]
        assert labels == EXPECTED[name], out
        assert f"all {len(labels)} runs are valid" in out
        assert "model cnn, data fashion-mnist, 4 workers, wan two-site" in out
    assert not (tmp_path / "p").exists()
    cfg = build_config(overrides=preset.values)
    specs = X.grid_runs(cfg, [], 1, None, tmp_path / "p", cells=preset.runs)
    assert [s.label for s in specs] == EXPECTED[name]
    by = {s.label: s.cfg for s in specs}
    if name == "cpdp-k-sweep":
        assert [by[f"cpdp__sync_every={k}"].sync_every for k in (1, 32)] == [1, 32]
    if name == "cpdp-lr-protocol":  # the falsifier's cell: K=4, lr 0.4
        c = by["cpdp__lr_scaling=linear"]
        assert c.sync_every == 4 and peak_lr(c) == pytest.approx(0.4)
        assert peak_lr(by["ddp__lr_scaling=none"]) == pytest.approx(0.1)
    if name == "cpdp-ablation":
        assert by["slowmo"].slowmo_beta == 0.3 and by["cpdp__slowmo_beta=0"].slowmo_beta == 0.0


def test_preset_cells_with_strategies_grid_and_flags(tmp_path, capsys):
    code, out, err = _cli(
        capsys,
        "compare",
        "--preset",
        "cpdp-ablation",
        "--strategies",
        "cpdp,diloco",
        "--grid",
        "seed=0,1",
        "--dry-run",
        "--out",
        str(tmp_path / "p"),
    )
    assert code == 0, err
    dirs = [line.split()[0] for line in out.splitlines() if "  ok  " in line]
    assert [Path(d).relative_to(tmp_path / "p").as_posix() for d in dirs] == [
        "cpdp__slowmo_beta=0/seed0",
        "cpdp__slowmo_beta=0/seed1",
        "cpdp__slowmo_beta=0.3/seed0",
        "cpdp__slowmo_beta=0.3/seed1",
        "diloco/seed0",
        "diloco/seed1",
    ]
    code, out, err = _cli(
        capsys,
        "sweep",
        "--preset",
        "cpdp-k-sweep",
        "--grid",
        "sync_every=2,4",
        "--dry-run",
        "--out",
        str(tmp_path / "p"),
    )  # the grid replaces K
    assert code == 0 and "ddp/seed0" in out and "cpdp__sync_every=4/seed0" in out, err
    assert out.count("  ok  ") == 3  # ddp has no sync_every: it runs once, not twice
    code, _, err = _cli(
        capsys, "compare", "--preset", "cpdp-k-sweep", "--sync-every", "8", "--dry-run", "--out", str(tmp_path / "p")
    )
    assert code != 0 and "--sync-every is swept by preset cpdp-k-sweep (1, 2, 4, 8, 16, 32)" in err
    assert len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- a real vision compare


def test_vision_compare_on_a_tiny_cifar_directory(tmp_path):
    """2 strategies, 2 workers, 2 epochs of a 32-image CIFAR-100 directory: an evaluation with test_acc at
    every epoch end, summary.json with peak and final accuracy, and accuracy columns in the report."""
    data = write_tiny_cifar(tmp_path / "cifar")
    out = tmp_path / "exp"
    # 16 images per worker at batch 4: 4 steps per epoch; 8 steps = 2 epochs; eval_every 100: epoch ends only
    r = wansync(
        "compare",
        "--strategies",
        "ddp,cpdp",
        "--model",
        "cnn",
        "--width",
        "0.25",
        "--data",
        f"cifar100:{data}",
        "--workers",
        "2",
        "--batch-size",
        "4",
        "--steps",
        "8",
        "--eval-every",
        "100",
        "--sync-every",
        "2",
        "--threads",
        "1",
        "--quiet",
        "--no-augment",
        "--out",
        str(out),
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    for s in ("ddp", "cpdp"):
        run = out / s / "seed0"
        evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
        assert [e["step"] for e in evals] == [4, 8]  # end of epoch 1, end of epoch 2 (the final one)
        assert all("test_acc" in e and 0 <= e["test_acc"] <= 100 for e in evals)
        assert evals[0]["epoch"] >= 1 and evals[-1]["epoch"] >= 2
        summary = json.loads((run / "summary.json").read_text())
        assert summary["data"] == f"cifar100:{data}" and summary["model"] == "cnn"
        assert summary["peak_test_acc"] == max(e["test_acc"] for e in evals)
        assert summary["final_test_acc"] == evals[-1]["test_acc"]
        assert summary["peak_lr"] == pytest.approx(0.1) and summary["lr_scaling"] == "none"  # vision SGD default
    with open(out / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["setting"] for row in rows] == ["ddp", "cpdp"] and all(row["status"] == "ok" for row in rows)
    assert "final test acc %" in r.stdout and "peak test acc %" in r.stdout
    assert "peak test acc" in (out / "report.md").read_text()


@pytest.mark.skipif(
    not (Path("/usr/share/datasets/fashion-mnist") / "train-images-idx3-ubyte.gz").is_file(),
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist); CI installs it",
)
def test_the_readmes_cnn_example_prints_no_torch_warning(tmp_path):
    """`wansync train --model cnn --strategy cpdp` (README): DDP's reducer warned of grad strides on
    the first convolution's size-1 input-channel dimension, 8 lines a rank."""
    r = wansync(
        "train", "--model", "cnn", "--strategy", "cpdp", "--workers", "2", "--steps", "4", "--eval-batches", "1",
        "--quiet", "--out", str(tmp_path / "run"), fresh=True,  # a process of its own, as a user's shell starts
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Warning" not in r.stderr and "Grad strides" not in r.stdout + r.stderr, r.stderr
