"""`wansync compare` / `sweep` as a user runs them: a real micro compare, resume, failures, bad input."""

from __future__ import annotations

import csv
import json

import pytest

from cli_harness import TINY, wansync
from wansync.runner import experiments as X
from wansync.cli import main
from wansync.config import build_config
from wansync.errors import ConfigError

pytestmark = pytest.mark.timeout(240)

MICRO = ["--workers", "2", "--steps", "4", "--eval-every", "2", "--sync-every", "2", "--quiet", *TINY]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def compare_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cmp") / "exp"
    r = wansync("compare", "--strategies", "ddp,local_sgd", "--seeds", "2", "--out", str(out), *MICRO, timeout=200)
    assert r.returncode == 0, r.stderr[-2000:]
    return out, r


def test_compare_two_strategies_two_seeds(compare_dir):
    out, r = compare_dir
    for s in ("ddp", "local_sgd"):
        for k in (0, 1):
            summary = json.loads((out / s / f"seed{k}" / "summary.json").read_text())
            assert summary["strategy"] == s and summary["seed"] == k and summary["steps"] == 4
    rows = _rows(out / "summary.csv")
    assert [row["setting"] for row in rows] == ["ddp", "local_sgd"]
    assert all(row["seeds_ok"] == "2" and row["status"] == "ok" for row in rows)
    for key in (
        "final_mean",
        "final_std",
        "best_mean",
        "final_ppl_mean",
        "steps_to_target_mean",
        "time_to_target_s_mean",
        "exposed_comm_pct_mean",
        "bytes_sent_mean",
        "sync_events_mean",
    ):
        assert key in rows[0]
    assert float(rows[0]["bytes_sent_mean"]) > float(rows[1]["bytes_sent_mean"]) > 0  # DDP sends every step
    assert float(rows[1]["sync_events_mean"]) == 2
    assert all(0 <= float(row["peer_wait_pct_mean"]) <= float(row["exposed_comm_pct_mean"]) + 1 for row in rows)
    assert len(_rows(out / "runs.csv")) == 4
    report = (out / "report.md").read_text()
    assert "| ddp " in report and "DDP's final validation loss" in report
    assert "final val ppl" in r.stdout and "report:" in r.stdout


def test_plots_are_readable_pngs(compare_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg

    out, _ = compare_dir
    names = [
        "loss_vs_step.png",
        "loss_vs_wallclock.png",
        "pareto.png",
        "time_breakdown.png",
        "bytes.png",
        "exposed_over_time.png",
    ]
    for name in names:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE, name
        img = mpimg.imread(out / name)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300, name
        assert f"]({name})" in (out / "report.md").read_text()


def test_second_call_skips_finished_runs(compare_dir):
    out, _ = compare_dir
    before = {p: p.stat().st_mtime_ns for p in out.glob("*/seed*/summary.json")}
    r = wansync("compare", "--strategies", "ddp,local_sgd", "--seeds", "2", "--out", str(out), *MICRO, timeout=150)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("skipped") >= 4 and "0 runs trained, 4 skipped" in r.stdout
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/seed*/summary.json")} == before


def test_a_changed_config_is_not_finished(compare_dir):
    out, _ = compare_dir
    base = build_config(
        overrides={
            "workers": 2,
            "steps": 4,
            "eval_every": 2,
            "sync_every": 2,
            "model": "micro",
            "batch_size": 4,
            "seq_len": 32,
            "eval_batches": 2,
            "threads": 1,
        }
    )
    same = X.grid_runs(base, ["local_sgd"], 2, None, out)
    assert all(X.is_finished(s) for s in same)
    # threads/quiet/log_every only change presentation
    assert all(X.is_finished(s) for s in X.grid_runs(base, ["local_sgd"], 2, None, out, threads=2))
    changed = X.grid_runs(build_config(overrides={**vars(base), "steps": 5}), ["local_sgd"], 2, None, out)
    assert not any(X.is_finished(s) for s in changed)


def test_a_failed_run_is_marked_not_fatal(tmp_path):
    """A grid of two runs: one fine, one with a worker failure injected mid-run. (A run that could not
    even start, a missing data path, is refused before any run: `check_experiment`.)"""
    out = tmp_path / "exp"
    micro = [*MICRO[2:], "--steps", "3"]  # MICRO without its --workers
    r = wansync(
        "sweep",
        "--strategy",
        "local_sgd",
        "--grid",
        "workers=1,2",
        "--out",
        str(out),
        *micro,
        timeout=150,
        env={"WANSYNC_FAULT": "rank=1,step=2,action=exit"},
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("wansync: error: 1 of 2 runs failed") and len(r.stderr.strip().splitlines()) == 1
    fault = json.loads((out / "local_sgd__workers=2" / "seed0" / "failed.json").read_text())
    assert "injected failure at step 2" in fault["message"]
    rows = {row["setting"]: row for row in _rows(out / "summary.csv")}
    assert list(rows) == ["local_sgd__workers=1", "local_sgd__workers=2"]
    assert rows["local_sgd__workers=1"]["status"] == "ok"
    assert rows["local_sgd__workers=2"]["status"] == f"failed: {fault['message']}"
    report = (out / "report.md").read_text()
    assert "## Failed runs" in report and "injected failure at step 2" in report
    assert (out / "loss_vs_step.png").read_bytes()[:8] == PNG_SIGNATURE  # plots of the runs that finished
    assert "1 runs trained, 0 skipped (finished earlier), 1 failed" in r.stdout


def _cli(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    err = capsys.readouterr().err
    return e.value.code, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["compare", "--strategies", "ddp,nope"],
            "unknown strategy 'nope' (available: ddp, demo, local_sgd",
        ),
        (["compare", "--steps", "3"], "compare needs --strategies"),
        (["sweep", "--grid", "sync_evry=1,2"], "--grid: unknown config key 'sync_evry'"),
        (["sweep", "--grid", "sync_every=1,two"], "sync_every must be an integer, got 'two'"),
        (["sweep", "--grid", "sync_every"], "expected key=value1,value2"),
        (["sweep", "--strategy", "local_sgd"], "sweep needs at least one --grid"),
        (["compare", "--strategies", "ddp", "--seeds", "0"], "seeds must be in [1, 1000], got 0"),
        (
            ["compare", "--preset", "gpt5-paper"],
            "unknown preset 'gpt5-paper' (available: cocodc-paper, cpdp-wan, cpdp-k-sweep",
        ),
        (["compare", "--strategies", "ddp", "--workers", "0"], "workers must be >= 1, got 0"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    code, err = _cli(capsys, *argv, "--out", str(tmp_path / "x"))
    assert code != 0
    assert message in err and err.startswith("wansync: error: ") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


def test_bad_input_from_the_shell(tmp_path):
    r = wansync("compare", "--strategies", "ddp,nope", "--out", str(tmp_path / "x"), timeout=150)
    assert r.returncode != 0 and r.stderr.startswith("wansync: error: unknown strategy 'nope'")
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_grid_values_take_the_key_type():
    g = X.parse_grid(
        [
            "sync_every=1,2",
            "lr=1e-3,3e-3",
            "grad_phase=true,false",
            "wan=two-site;rtt=10ms,bw=1gbit",
            "slowmo_beta=none,0.3",
        ]
    )
    assert g == {
        "sync_every": [1, 2],
        "lr": [0.001, 0.003],
        "grad_phase": [True, False],
        "wan": ["two-site", "rtt=10ms,bw=1gbit"],
        "slowmo_beta": [None, 0.3],
    }
    specs = X.grid_runs(build_config(overrides={"out": "o"}), ["local_sgd"], 2, X.parse_grid(["sync_every=2,4"]))
    assert [str(s.run_dir) for s in specs] == [
        "o/local_sgd__sync_every=2/seed0",
        "o/local_sgd__sync_every=2/seed1",
        "o/local_sgd__sync_every=4/seed0",
        "o/local_sgd__sync_every=4/seed1",
    ]
    assert [s.cfg.sync_every for s in specs] == [2, 2, 4, 4] and [s.cfg.seed for s in specs] == [0, 1, 0, 1]
    with pytest.raises(ConfigError, match="cannot be swept"):
        X.parse_grid(["out=a,b"])


def test_presets_validate_in_a_dry_run(tmp_path, capsys):
    import importlib.util

    # the preset's CIFAR-100 path is not on this machine: the dry run says so in one line, trains nothing
    code, err = _cli(capsys, "compare", "--preset", "cpdp-wan", "--dry-run", "--out", str(tmp_path / "p"))
    assert code != 0 and "9 of 9 runs are invalid; first: ddp seed 0: data path not found: data/cifar-100-python" in err
    assert len(err.strip().splitlines()) == 1
    if importlib.util.find_spec("datasets") is not None:
        code, err = _cli(capsys, "compare", "--preset", "cocodc-paper", "--dry-run", "--out", str(tmp_path / "p"))
        assert code == 0, err
    assert not (tmp_path / "p").exists()


def test_dry_run_prints_the_resolved_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(
            [
                "compare",
                "--preset",
                "cpdp-wan",
                "--strategies",
                "ddp,local_sgd",
                "--seeds",
                "2",
                "--dry-run",
                "--data",
                "fashion-mnist",
                "--out",
                str(tmp_path / "p"),
            ]
        )
    captured = capsys.readouterr()
    assert e.value.code == 0, captured.err
    assert "preset cpdp-wan" in captured.out and "4 runs: model resnet50" in captured.out
    assert "8 workers, wan two-site" in captured.out and "sync_every=4" in captured.out
    assert "all 4 runs are valid" in captured.out


def test_a_preset_strategy_missing_from_the_registry_is_one_line(tmp_path, capsys, monkeypatch):
    from wansync import strategies

    monkeypatch.setattr(
        strategies, "STRATEGIES", {k: v for k, v in strategies.STRATEGIES.items() if k not in ("streaming", "cocodc")}
    )
    code, err = _cli(capsys, "compare", "--preset", "cocodc-paper", "--dry-run", "--out", str(tmp_path / "p"))
    assert code != 0 and "preset cocodc-paper needs strategies streaming, cocodc, not available" in err
    assert len(err.strip().splitlines()) == 1


def test_parallel_runs_split_the_threads(tmp_path, monkeypatch):
    """--parallel N: N runs at once, threads per worker split between them (train faked: no processes)."""
    import threading
    from wansync.runner import run

    seen, active, peak = [], [0], [0]
    lock = threading.Lock()

    def fake_train(cfg, force=False, torchrun=None):
        import time

        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.2)
        with lock:
            active[0] -= 1
        if cfg.seed == 1:
            from wansync.errors import WansyncError

            raise WansyncError("boom")
        seen.append((cfg.strategy, cfg.seed, cfg.threads))
        return {"strategy": cfg.strategy}

    monkeypatch.setattr(run, "train", fake_train)
    base = build_config(overrides={"workers": 2})
    threads = X.default_threads(2, 2)
    specs = X.grid_runs(base, ["ddp", "local_sgd"], 2, None, tmp_path / "p", threads=threads)
    outcomes = X.execute(specs, parallel=2, log=lambda s: None)
    assert [(o.spec.strategy, o.spec.seed, o.status) for o in outcomes] == [
        ("ddp", 0, "ok"),
        ("ddp", 1, "failed"),
        ("local_sgd", 0, "ok"),
        ("local_sgd", 1, "failed"),
    ]
    assert peak[0] == 2 and all(t == threads for _, _, t in seen)
    assert json.loads((tmp_path / "p" / "ddp" / "seed1" / "failed.json").read_text())["message"] == "boom"
