"""Every file wansync writes, with a link in its place (issue 61): a symbolic link, then a hard link, to a
file of someone else's. That file keeps its bytes (its SHA-256 before and after), and the writer either
replaced the link (a whole file written over a symbolic link) or refused in one line (a hard link; a
line appended, or a file kept in place, through any link). Unit-level calls of each writer, then the two
reported cases end to end: `train --resume RUN` with links at profile.json, logs/profile_rank0.json and
logs/rank1.pid, and `report --force` with summary.csv hard-linked. `rundir.files` itself first."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from wansync.errors import ConfigError, StorageError
from wansync.rundir import files

THEIRS = b'{"strategy": "ddp", "steps": 2, "note": "someone else\'s file, which wansync must never change"}\n'


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def plant(path: Path, how: str, content: bytes = THEIRS) -> Path:
    """A file of someone else's, beside the run's directory (in the test's own), and at `path` a `how`
    ("symlink", "hardlink") to it."""
    test_dir = next(p for p in path.parents if p.name.startswith("test_"))  # pytest's tmp_path
    theirs = test_dir / "theirs" / "_".join(path.relative_to(test_dir).parts)
    theirs.parent.mkdir(exist_ok=True)
    theirs.write_bytes(content)
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(path):
        path.unlink()
    if how == "symlink":
        path.symlink_to(theirs)
    else:
        os.link(theirs, path)
    return theirs


def one_line_refusal(call: Callable[[], Any], path: Path) -> str:
    with pytest.raises(ConfigError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message and str(path) in message, message
    return message


def check_writer(how: str, expect: str, path: Path, write: Callable[[], Any], content: bytes = THEIRS) -> None:
    """`expect`: "replaced" (the link gives way to wansync's own file) or "refused" (one line)."""
    theirs = plant(path, how, content)
    before = sha(theirs)
    if expect == "replaced":
        write()
        assert not path.is_symlink() and path.is_file() and os.lstat(path).st_nlink == 1
    else:
        one_line_refusal(write, path)
    assert sha(theirs) == before, f"{path}: written through the {how}"
    assert theirs.stat().st_nlink == (2 if how == "hardlink" and expect == "refused" else 1)


# ---------------------------------------------------------------- rundir.files itself


@pytest.mark.parametrize("how, expect", [("symlink", "replaced"), ("hardlink", "refused")])
def test_a_whole_file_replaces_a_symbolic_link_and_refuses_a_hard_link(tmp_path, how, expect):
    path = tmp_path / "run" / "summary.json"
    check_writer(how, expect, path, lambda: files.write_text(path, "{}"))
    if expect == "refused":
        assert "hard link" in one_line_refusal(lambda: files.write_bytes(path, b"x"), path)


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_a_line_is_never_appended_through_a_link(tmp_path, how):
    path = tmp_path / "run" / "metrics.jsonl"
    check_writer(how, "refused", path, lambda: files.append(path).close())


def test_another_users_file_is_refused_in_one_line(tmp_path, monkeypatch):
    path = tmp_path / "report.md"
    path.write_text("theirs\n")
    monkeypatch.setattr(os, "geteuid", lambda: os.lstat(path).st_uid + 1)
    for write in (lambda: files.write_text(path, "x"), lambda: files.append(path).close()):
        assert "belongs to another user" in one_line_refusal(write, path)
    monkeypatch.undo()
    assert path.read_text() == "theirs\n"


def test_a_fifo_or_a_directory_in_place_is_refused_without_waiting_on_it(tmp_path):
    fifo, folder = tmp_path / "rank0.log", tmp_path / "profile.json"
    os.mkfifo(fifo)
    folder.mkdir()
    for path in (fifo, folder):
        assert "not a regular file" in one_line_refusal(lambda: files.write_text(path, "x"), path)
        assert "not a regular file" in one_line_refusal(lambda: files.append(path).close(), path)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and folder.is_dir()


def test_a_line_is_appended_after_the_files_own(tmp_path):
    path = tmp_path / "heals.jsonl"
    path.write_text("one\n")
    with files.append(path) as f:
        f.write("two\n")
    with files.fresh(tmp_path / "metrics.jsonl") as f:
        f.write("new\n")
    assert path.read_text() == "one\ntwo\n" and (tmp_path / "metrics.jsonl").read_text() == "new\n"


def test_a_full_disk_or_a_missing_directory_is_one_line_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "rank0.pt"
    path.write_bytes(b"the checkpoint before")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, hard))
    try:
        with pytest.raises(StorageError) as e:
            files.write_bytes(path, bytes(1 << 20), durable=True, what="checkpoint")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(e.value) == f"cannot write checkpoint {path}: File too large"
    assert path.read_bytes() == b"the checkpoint before" and os.listdir(tmp_path) == ["rank0.pt"]
    with pytest.raises(StorageError, match="No such file or directory$"):
        files.write_text(tmp_path / "gone" / "config.toml", "x")


def test_a_writer_that_fails_midway_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "state.pt"
    path.write_bytes(b"old")
    with pytest.raises(Exception) as e:
        files.save_torch(path, {"a": lambda: None})  # torch.save cannot pickle a lambda, half-way through
    assert not isinstance(e.value, StorageError)  # not the disk's fault: raised as it came
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["state.pt"]


def test_a_directory_wansync_writes_into_is_never_a_link(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "logs").symlink_to(elsewhere)
    assert "symbolic link" in one_line_refusal(
        lambda: files.directory(tmp_path / "run" / "logs"), tmp_path / "run" / "logs"
    )
    assert files.directory(tmp_path / "run" / "checkpoints" / "step00000002").is_dir()


# ---------------------------------------------------------------- each writer of wansync's


def _run_dir(tmp: Path) -> Path:
    run = tmp / "run"
    (run / "logs").mkdir(parents=True, exist_ok=True)
    return run


def _config_toml(run: Path) -> tuple[Path, Callable[[], Any]]:
    from wansync.runner.run import write_config

    return run / "config.toml", lambda: write_config(run, "[run]\nstrategy = 'ddp'\n")


def _config_toml_kept(run: Path) -> tuple[Path, Callable[[], Any]]:
    from wansync.runner.run import keep_config

    return run / "config.toml", lambda: keep_config(run, "[run]\nstrategy = 'ddp'\n")


def _topology_copy(run: Path) -> tuple[Path, Callable[[], Any]]:
    from wansync.runner.run import keep_topology

    source = run.parent / "links.toml"
    source.write_text("[defaults]\nbandwidth = '100mbit'\n")
    return run / "topology.toml", lambda: keep_topology(run, SimpleNamespace(wan=str(source)))  # type: ignore[arg-type]


def _metrics_new(run: Path) -> tuple[Path, Callable[[], Any]]:
    from wansync.telemetry.metrics import MetricsWriter

    def write() -> None:
        w = MetricsWriter(run / "metrics.jsonl")
        w.write({"type": "step", "step": 1})
        w.close()

    return run / "metrics.jsonl", write


def _metrics_resumed(run: Path) -> tuple[Path, Callable[[], Any]]:
    from wansync.telemetry.metrics import MetricsWriter

    return run / "metrics.jsonl", lambda: MetricsWriter(run / "metrics.jsonl", append=True).close()


def _metrics_truncated(run: Path) -> tuple[Path, Callable[[], Any]]:
    from wansync.trainer.loop import truncate_metrics

    return run / "metrics.jsonl", lambda: truncate_metrics(run / "metrics.jsonl", 0)


def _summary(run: Path) -> tuple[Path, Callable[[], Any]]:
    from wansync.rundir.layout import write_summary

    return run / "summary.json", lambda: write_summary(run, {"strategy": "ddp"})


def _summary_added_to(run: Path) -> tuple[Path, Callable[[], Any]]:
    from wansync.rundir.layout import add_to_summary

    return run / "summary.json", lambda: add_to_summary(run, {"target": {"step": 2}})


def _pid(run: Path) -> tuple[Path, Callable[[], Any]]:
    from wansync.runner.workerproc import record_pid

    return run / "logs" / "rank1.pid", lambda: record_pid(run / "logs", 1, SimpleNamespace(pid=4242))  # type: ignore[arg-type]


def _quorum_log(name: str) -> Callable[[Path], tuple[Path, Callable[[], Any]]]:
    def make(run: Path) -> tuple[Path, Callable[[], Any]]:
        from wansync.ft.member import Member

        member = SimpleNamespace(log_dir=run / "logs", quorum=SimpleNamespace(local_rank=0))
        return run / "logs" / name, lambda: Member._append(member, name, {"step": 2})  # type: ignore[arg-type]

    return make


def _experiment(run: Path) -> tuple[Path, Callable[[], Any]]:
    from wansync.runner.experiments import write_experiment

    return run / "experiment.json", lambda: write_experiment(run, [])


def _written_record(run: Path) -> tuple[Path, Callable[[], Any]]:
    from wansync.rundir.owned import WRITTEN_FILE, record_written

    (run / "report.md").write_text("# wansync report\n")
    return run / WRITTEN_FILE, lambda: record_written(run, [run / "report.md"])


def _plot(run: Path) -> tuple[Path, Callable[[], Any]]:
    import matplotlib.pyplot as plt

    from wansync.analysis.plots import _finish

    def write() -> None:
        fig, ax = plt.subplots(figsize=(1, 1))
        _finish(fig, ax, run / "pareto.png")

    return run / "pareto.png", write


def _page_figure(run: Path) -> tuple[Path, Callable[[], Any]]:
    from wansync.analysis.interval_plot import interval_figure

    return run / "figures" / "cpdp.png", lambda: interval_figure(
        run / "figures" / "cpdp.png", "t", ["a"], [("h", [None])]
    )


def _checkpoint(name: str) -> Callable[[Path], tuple[Path, Callable[[], Any]]]:
    def make(run: Path) -> tuple[Path, Callable[[], Any]]:
        import torch

        from wansync.rundir.checkpoint import save_rank

        state = {"step": 2, "world_size": 1, "model": {"w": torch.zeros(2)}}
        return run / "checkpoints" / "step00000002" / name, lambda: save_rank(run, 2, 0, state)

    return make


def _hf_state(run: Path) -> tuple[Path, Callable[[], Any]]:
    hf = pytest.importorskip("wansync.integrations.hf")
    import torch
    import transformers

    trainer = object.__new__(hf.WansyncTrainer)
    model = torch.nn.Linear(2, 2)
    trainer.__dict__.update(
        _get_output_dir=lambda trial: str(run),
        state=SimpleNamespace(global_step=3),
        sync=SimpleNamespace(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), state_dict=lambda: {"t": 3}
        ),
    )

    def write() -> None:
        saved = transformers.Trainer._save_checkpoint, hf.dist.get_rank, hf.dist.barrier
        (
            transformers.Trainer._save_checkpoint,
            hf.dist.get_rank,
            hf.dist.barrier,
        ) = (  # the Trainer's own files: not ours
            lambda self, model, trial: None,
            lambda: 0,
            lambda: None,
        )
        try:
            trainer._save_checkpoint(model, None)
        finally:
            transformers.Trainer._save_checkpoint, hf.dist.get_rank, hf.dist.barrier = saved

    return run / "checkpoint-3" / hf.STATE_FILE.format(0), write


def _rank_err(run: Path) -> tuple[Path, Callable[[], Any]]:
    from wansync.runner.worker import record_failure

    def write() -> None:  # a refusal is swallowed there: False, and the worker prints its line itself
        if not record_failure(run / "logs", 0, "rank 0 failed", "a traceback\n"):
            raise ConfigError(f"record_failure refused to write {run / 'logs' / 'rank0.err'}")

    return run / "logs" / "rank0.err", write


WHOLE_FILES = {  # replace a symbolic link, refuse a hard link
    "config.toml": _config_toml,
    "config.toml on another node": _config_toml_kept,
    "topology.toml": _topology_copy,
    "metrics.jsonl of a new run": _metrics_new,
    "metrics.jsonl cut back on resume": _metrics_truncated,
    "summary.json": _summary,
    "summary.json added to": _summary_added_to,
    "logs/rank1.pid": _pid,
    "logs/rank0.err": _rank_err,
    "experiment.json": _experiment,
    ".wansync-written.json": _written_record,
    "a report's plot": _plot,
    "the results page's figure": _page_figure,
    "checkpoint rank0.pt": _checkpoint("rank0.pt"),
    "checkpoint rank0.json": _checkpoint("rank0.json"),
    "the HF Trainer's wansync_rank0.pt": _hf_state,
}
APPENDED = {  # refuse any link
    "metrics.jsonl of a resumed run": _metrics_resumed,
    "logs/quorum_rank0.jsonl": _quorum_log("quorum_rank0.jsonl"),
    "logs/heals.jsonl": _quorum_log("heals.jsonl"),
}


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
@pytest.mark.parametrize("name", list(WHOLE_FILES))
def test_a_whole_file_writer_replaces_a_symbolic_link_and_refuses_a_hard_link(tmp_path, name, how):
    path, write = WHOLE_FILES[name](_run_dir(tmp_path))
    check_writer(how, "replaced" if how == "symlink" else "refused", path, write)


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
@pytest.mark.parametrize("name", list(APPENDED))
def test_an_appending_writer_refuses_any_link(tmp_path, name, how):
    path, write = APPENDED[name](_run_dir(tmp_path))
    check_writer(how, "refused", path, write)


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_a_ranks_traceback_is_never_appended_through_a_link_to_its_log(tmp_path, how):
    from wansync.runner.worker import record_failure

    run = _run_dir(tmp_path)
    theirs = plant(run / "logs" / "rank0.log", how)
    before = sha(theirs)
    assert record_failure(run / "logs", 0, "rank 0 failed", "a traceback\n")  # the one line is what matters
    assert sha(theirs) == before and (run / "logs" / "rank0.err").read_text() == "rank 0 failed\n"


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_torchfts_lines_never_go_through_a_link_to_the_ranks_log(tmp_path, how, monkeypatch):
    from wansync.ft.member import library_logs_to

    monkeypatch.setenv("WANSYNC_LAUNCHED", "1")
    path = _run_dir(tmp_path) / "logs" / "rank0.log"
    saved = os.dup(2)  # were it not refused, the test's own stderr would go to the log
    try:
        check_writer(how, "refused", path, lambda: library_logs_to(path))
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
@pytest.mark.parametrize("name", [".lock", "DONE"])
def test_a_file_kept_in_place_refuses_any_link(tmp_path, how, name):
    from wansync.rundir.checkpoint import prune
    from wansync.rundir.lock import RunLock

    run = _run_dir(tmp_path)
    if name == ".lock":
        check_writer(how, "refused", run / ".lock", lambda: RunLock(run).__enter__())
    else:
        step = run / "checkpoints" / "step00000002"
        check_writer(how, "refused", step / "DONE", lambda: prune(run, 2))


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_the_results_page_is_never_written_through_a_link(tmp_path, how):
    from wansync.results.page import write_page

    page = tmp_path / "docs" / "results.md"
    check_writer(how, "refused", page, lambda: write_page(page, "<!-- generated -->\n"), content=b"# my results\n")


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
@pytest.mark.parametrize("name", ["report.md", "summary.csv", "runs.csv"])
def test_a_report_with_force_replaces_a_symbolic_link_and_refuses_a_hard_link(tmp_path, how, name):
    from test_report import fake_run
    from wansync.analysis.report import report

    root = tmp_path / "exp"
    fake_run(root / "ddp" / "seed0", "ddp", 0, [3.0, 2.5, 2.0])
    path = root / name
    check_writer(
        how, "replaced" if how == "symlink" else "refused", path, lambda: report(root, plots=False, force=True)
    )
    if how == "hardlink" and name != "report.md":
        assert not (root / "report.md").exists()  # refused before any file is written


def test_the_tokenizer_cache_replaces_a_dangling_link_and_never_creates_its_target(tmp_path):
    pytest.importorskip("tokenizers")
    from wansync.workloads.lm.tokenizer import build_tokenizer, text_digest

    text = "the quick brown fox jumps over the lazy dog. " * 40
    cache = tmp_path / "cache"
    cache.mkdir()
    path = cache / f"bpe-300-{text_digest(text)}.json"
    path.symlink_to(tmp_path / "theirs.json")  # a link to where a file of someone else's would go
    build_tokenizer("bpe", text, bpe_vocab=300, cache_dir=str(cache))
    assert not path.is_symlink() and json.loads(path.read_text()) and not (tmp_path / "theirs.json").exists()


def test_a_copied_run_replaces_a_link_in_its_place_and_leaves_what_it_pointed_to(tmp_path):
    from wansync.results.runs import _copy_run

    src = _run_dir(tmp_path)
    (src / "summary.json").write_text("{}")
    (src / ".lock").write_text("")
    (src / "logs" / "rank0.log").write_text("log\n")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "summary.json").write_bytes(THEIRS)
    dst = tmp_path / "copy"
    dst.symlink_to(theirs)
    _copy_run(src, dst)
    assert not dst.is_symlink() and sorted(p.name for p in dst.rglob("*")) == ["logs", "rank0.log", "summary.json"]
    assert (theirs / "summary.json").read_bytes() == THEIRS


# ---------------------------------------------------------------- the two reported cases, end to end


def test_train_resume_replaces_links_at_its_files_and_refuses_a_hard_link_before_any_work(tmp_path):
    from cli_harness import TINY, wansync

    run = tmp_path / "run"
    args = ["--quiet", *TINY]
    r = wansync("train", "--strategy", "ddp", "--workers", "2", "--steps", "2", "--out", str(run), *args, timeout=180)
    assert r.returncode == 0, r.stderr
    names = ("profile.json", "logs/profile_rank0.json", "logs/rank1.pid")
    theirs = {name: plant(run / name, "symlink") for name in names}
    before = {name: sha(t) for name, t in theirs.items()}
    r = wansync("train", "--resume", str(run), "--steps", "4", *args, timeout=180)
    assert r.returncode == 0, r.stderr
    for name in names:
        assert not (run / name).is_symlink() and (run / name).is_file(), name
        assert sha(theirs[name]) == before[name], f"{name}: written through the link"
    assert json.loads((run / "profile.json").read_text())["wall_clock_s"] > 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 4
    linked = plant(run / "profile.json", "hardlink")
    r = wansync("train", "--resume", str(run), "--steps", "6", *args, timeout=180)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "refusing to write" in r.stderr and "hard link" in r.stderr and str(run / "profile.json") in r.stderr
    assert sha(linked) == before["profile.json"]
    assert not (run / "checkpoints" / "step00000006").exists()  # refused before any work


def test_report_force_refuses_a_hard_linked_summary_csv_in_one_line(tmp_path):
    from cli_harness import wansync
    from test_report import fake_run

    root = tmp_path / "exp"
    fake_run(root / "ddp" / "seed0", "ddp", 0, [3.0, 2.5, 2.0])
    theirs = plant(root / "summary.csv", "hardlink", b"setting,mine\na,1\n")
    r = wansync("report", str(root), "--no-plots", "--force", timeout=120)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "summary.csv" in r.stderr and "hard link" in r.stderr and "Traceback" not in r.stderr
    assert theirs.read_bytes() == b"setting,mine\na,1\n" and not (root / "report.md").exists()
