"""`wansync train` as a user runs it: a real run, and every way to get it wrong."""

from __future__ import annotations

import json
import time

import pytest

from cli_harness import TINY, no_process_left, wansync
from wansync.cli import main

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One real run, given by a config file (strategy, steps, sync_every 3) and flags (sync_every 4
    overrides the file), read by the two tests below."""
    root = tmp_path_factory.mktemp("train")
    cfg = root / "c.toml"
    cfg.write_text("[run]\nstrategy = 'local_sgd'\nsteps = 12\n[strategy]\nsync_every = 3\n")
    out = root / "run"
    r = wansync(
        "train",
        "--config",
        str(cfg),
        "--sync-every",
        "4",
        "--workers",
        "2",
        "--eval-every",
        "6",
        "--out",
        str(out),
        *TINY,
    )
    assert r.returncode == 0, r.stderr
    return out, r


def test_train_writes_the_run_directory(trained):
    out, r = trained
    summary = json.loads((out / "summary.json").read_text())
    for key in ("final_val_loss", "best_val_loss", "steps", "wall_clock_s", "strategy", "workers"):
        assert key in summary
    assert summary["strategy"] == "local_sgd" and summary["workers"] == 2 and summary["steps"] == 12
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kinds = {r["type"] for r in records}
    assert kinds == {"step", "eval", "sync"}
    assert all(r["drift"] > 0 for r in records if r["type"] == "sync")  # each boundary's drift
    assert [r["step"] for r in records if r["type"] == "sync"] == [4, 8, 12]
    assert [r["step"] for r in records if r["type"] == "eval"] == [6, 12]
    config = (out / "config.toml").read_text()
    assert "sync_every = 4" in config and 'strategy = "local_sgd"' in config
    assert "val_ppl" in r.stdout


def test_config_file_then_flags_override(trained):
    out, _ = trained
    summary = json.loads((out / "summary.json").read_text())
    assert summary["options"]["sync_every"] == 4 and summary["steps"] == 12  # flag over file; file
    assert summary["strategy"] == "local_sgd"  # file only


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sync-every", "0", "--strategy", "local_sgd"], "sync_every must be >= 1, got 0"),
        (["--strategy", "nope"], "unknown strategy 'nope'"),
        (["--workers", "0"], "workers must be >= 1, got 0"),
        (["--steps", "abc"], "steps must be an integer, got 'abc'"),
        (["--data", "/no/such/corpus.txt"], "data path not found: /no/such/corpus.txt"),
        (["--model", "gpt5"], "unknown model 'gpt5'"),
        (["--lr", "-1"], "lr must be > 0, got -1.0"),
        (["--config", "/no/such.toml"], "config file not found: /no/such.toml"),
        (["--bogus-flag", "1"], "unrecognized arguments: --bogus-flag"),
    ],
)
def test_bad_input_is_one_clear_line_and_nonzero(tmp_path, capsys, args, message):
    """Through `main` in-process (the launcher rejects these before any worker exists); the same
    from a real process: test_bad_config_file_key."""
    t0 = time.monotonic()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["train", "--out", str(tmp_path / "run"), *args])
    stderr = capsys.readouterr().err
    assert int(e.value.code or 0) != 0
    assert message in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert "Traceback" not in stderr
    assert time.monotonic() - t0 < 30


def test_bad_config_file_key(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[run]\nstrategy = 'local_sgd'\n[strategy]\nsync_evry = 3\n")
    r = wansync("train", "--config", str(cfg), "--out", str(tmp_path / "run"))
    assert r.returncode != 0 and "unknown config key 'sync_evry'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "action, expect",
    [
        ("kill", "rank 1 was killed by SIGKILL"),
        ("exit", "rank 1 failed during step 3: RuntimeError: injected failure at step 3"),
    ],
)
def test_a_worker_crashing_mid_run_ends_all_with_one_message(tmp_path, action, expect):
    out = tmp_path / "run"
    t0 = time.monotonic()
    r = wansync(
        "train",
        "--strategy",
        "ddp",
        "--workers",
        "2",
        "--steps",
        "50",
        "--out",
        str(out),
        *TINY,
        env={"WANSYNC_FAULT": f"rank=1,step=3,action={action}"},
        timeout=120,
    )
    assert r.returncode != 0
    assert expect in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert time.monotonic() - t0 < 60
    assert no_process_left(out)
