"""A run directory is never destroyed by accident, has one writer at a time, and resumes only
what was checkpointed (issue 16, items 1, 2 and 8)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from cli_harness import start, wansync


pytestmark = pytest.mark.timeout(180)

SMALL = [
    "--model",
    "tiny",
    "--batch-size",
    "2",
    "--seq-len",
    "16",
    "--eval-batches",
    "1",
    "--threads",
    "1",
    "--quiet",
    "--workers",
    "1",
    "--strategy",
    "local_sgd",
]


def cli(capsys, *argv: str) -> tuple[int, str]:
    """The CLI in a process of its own (`cli_harness`), as a user runs it: exit status, stderr."""
    r = wansync(*argv, timeout=240)
    return r.returncode, r.stderr


def cli_here(capsys, *argv: str) -> tuple[int, str]:
    """The CLI in this process, for a test that replaces a piece of it."""
    from wansync.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return int(e.value.code or 0), capsys.readouterr().err


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """One finished 2-step run, copied by the tests that change it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    r = wansync("train", *SMALL, "--steps", "2", "--out", str(run), timeout=240)
    assert r.returncode == 0, r.stderr
    return run


def copy_of(finished: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    return run


def one_error_line(err: str, expect: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wansync: error: "), err
    assert expect in lines[0], lines[0]


# ---- item 1 ------------------------------------------------------------------------------------


def test_a_folder_that_is_not_a_run_is_refused_and_left_alone(tmp_path, capsys):
    theirs = tmp_path / "work" / "checkpoints" / "my_model.pt"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"someone else's model")
    code, err = cli(capsys, "train", *SMALL, "--steps", "1", "--out", str(tmp_path / "work"))
    assert code != 0
    one_error_line(err, "not empty and not a wansync run")
    assert theirs.read_bytes() == b"someone else's model"
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["checkpoints"]


def test_an_earlier_run_is_kept_unless_force_and_force_replaces_it_only_after_validation(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    code, err = cli(capsys, "train", *SMALL, "--steps", "1", "--out", str(run))
    assert code != 0
    one_error_line(err, f"--resume {run} continues it, --force replaces it")
    code, err = cli(
        capsys, "train", *SMALL, "--steps", "1", "--force", "--data", str(tmp_path / "nope.txt"), "--out", str(run)
    )
    assert code != 0
    one_error_line(err, "data path not found")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # nothing lost
    code, err = cli(capsys, "train", *SMALL, "--steps", "1", "--force", "--out", str(run))
    assert code == 0, err
    assert json.loads((run / "summary.json").read_text())["steps"] == 1


# ---- item 2 ------------------------------------------------------------------------------------


def test_a_second_command_on_a_running_directory_is_refused_with_the_holders_pid(finished, tmp_path, capsys):
    out = tmp_path / "busy"
    first = start("train", *SMALL, "--steps", "100000", "--out", str(out))
    try:
        deadline = time.monotonic() + 60
        while not (out / "metrics.jsonl").is_file() and first.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert first.running(), first.stderr()
        config = (out / "config.toml").read_text()
        code, err = cli(capsys, "train", *SMALL, "--lr", "0.1", "--steps", "1", "--force", "--out", str(out))
        assert code != 0
        one_error_line(err, f"another wansync process (PID {first.pid}) is running in it")
        code, err = cli(capsys, "train", "--resume", str(out))
        assert code != 0
        one_error_line(err, f"PID {first.pid}")
        assert (out / "config.toml").read_text() == config
        assert first.running()
    finally:
        first.terminate()
        first.result(timeout=60)


def test_workers_take_their_config_from_the_launcher_not_the_file(tmp_path, capsys):
    from wansync.runner import launch

    seen = {}

    def spawn(cfg, run_dir, config, resume=False):
        (run_dir / "config.toml").write_text("[run]\nstrategy = 'ddp'\n")  # another process rewrites it
        seen["config"] = config
        return 1, "stopped by the test"

    real = launch.spawn
    launch.spawn = spawn
    try:
        code, err = cli_here(capsys, "train", *SMALL, "--lr", "0.25", "--steps", "1", "--out", str(tmp_path / "r"))
    finally:
        launch.spawn = real
    assert code != 0 and "stopped by the test" in err
    assert "lr = 0.25" in seen["config"] and 'strategy = "local_sgd"' in seen["config"]


# ---- item 8 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit, changed",
    [
        (
            "lr = 0.003",
            "lr = 0.5",
        ),
        ('strategy = "local_sgd"', 'strategy = "ddp"'),
    ],
)
def test_a_hand_edited_config_is_refused_on_resume_naming_the_keys(finished, tmp_path, capsys, edit, changed):
    run = copy_of(finished, tmp_path)
    text = (run / "config.toml").read_text()
    assert edit in text
    (run / "config.toml").write_text(text.replace(edit, changed))
    code, err = cli(capsys, "train", "--resume", str(run), "--steps", "3")
    assert code != 0
    one_error_line(err, "no longer matches the checkpoint of step 2 (changed: ")
    assert changed.split(" = ")[0] in err.split("changed: ")[1]


def test_resuming_a_finished_run_says_so_and_appends_nothing(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    metrics = (run / "metrics.jsonl").read_text()
    code, err = cli(capsys, "train", "--resume", str(run))
    assert code != 0
    one_error_line(err, "already finished all 2 steps")
    assert (run / "metrics.jsonl").read_text() == metrics


@pytest.mark.parametrize(
    "extra, flag",
    [(["--config", "c.toml"], "--config"), (["--preset", "cpdp-wan"], "--preset"), (["--out", "elsewhere"], "--out")],
)
def test_options_resume_would_ignore_are_refused(finished, tmp_path, capsys, extra, flag):
    run = copy_of(finished, tmp_path)
    (tmp_path / "c.toml").write_text("[optim]\nlr = 0.5\n")
    extra = [str(tmp_path / e) if e in ("c.toml", "elsewhere") else e for e in extra]
    code, err = cli(capsys, "train", "--resume", str(run), "--steps", "3", *extra)
    assert code != 0
    one_error_line(err, f"{flag} cannot be")
