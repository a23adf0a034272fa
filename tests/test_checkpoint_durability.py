"""Nothing lost: a checkpoint is durable before any rank goes on, resume takes the newest complete
one and checks it, and a full disk leaves one clear line and no temporary file behind."""

from __future__ import annotations

import resource
import shutil
from pathlib import Path

import pytest
import torch

from cli_harness import TINY, no_process_left, wansync
from wansync.rundir import checkpoint
from wansync.errors import DataError

pytestmark = pytest.mark.timeout(180)


def test_a_peer_dying_while_rank0_is_still_finishing_the_save_loses_no_checkpoint(tmp_path):
    # rank 0 sleeps 5 s right after the barrier that ends the save of step 4; meanwhile rank 1
    # goes on (step 5 is a local step: it needs no peer) and dies, and the launcher ends rank 0
    run = tmp_path / "run"
    r = wansync(
        "train",
        "--strategy",
        "local_sgd",
        "--sync-every",
        "4",
        "--workers",
        "2",
        "--steps",
        "8",
        "--checkpoint-every",
        "4",
        "--quiet",
        "--out",
        str(run),
        *TINY,
        env={"WANSYNC_FAULT": "rank=0,step=4,action=delay,seconds=5;rank=1,step=5,action=kill"},
    )
    assert r.returncode != 0 and "rank 1 was killed by SIGKILL" in r.stderr, r.stderr
    assert no_process_left(run)
    r = wansync("train", "--resume", str(run), "--steps", "6")
    assert r.returncode == 0, r.stderr
    assert sorted(d.name for d in (run / "checkpoints").iterdir()) == ["step00000004", "step00000006"]


def _save(run: Path, step: int, world: int = 2) -> None:
    for rank in range(world):
        checkpoint.save_rank(run, step, rank, {"step": step, "world_size": world, "w": torch.full((3,), step)})


def test_resume_takes_the_newest_complete_checkpoint(tmp_path):
    (tmp_path / "config.toml").write_text("")
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    (tmp_path / "checkpoints" / "step00000004" / "rank1.json").unlink()  # rank 1 died while saving
    assert checkpoint.checkpoint_step(tmp_path) == 2
    assert int(checkpoint.load_rank(tmp_path, 1, 2)["w"][0]) == 2


def test_a_damaged_checkpoint_fails_its_checksum(tmp_path):
    (tmp_path / "config.toml").write_text("")
    _save(tmp_path, 2)
    path = tmp_path / "checkpoints" / "step00000002" / "rank0.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # one flipped bit
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="rank0.pt is corrupted or truncated"):
        checkpoint.load_rank(tmp_path, 0, 2)


def test_pruning_keeps_two_complete_checkpoints_and_drops_leftovers(tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path, step)
    (tmp_path / "checkpoints" / "step00000006" / "rank0.pt.tmp999").write_bytes(b"half")  # a writer that died
    _save(tmp_path, 8, world=1)  # a later step of an abandoned run
    checkpoint.prune(tmp_path, 6)
    root = tmp_path / "checkpoints"
    assert sorted(d.name for d in root.iterdir()) == ["step00000004", "step00000006"]
    assert not list(root.glob("*/*.tmp*"))


def _small_files_only():
    limit = 1 << 20  # 1 MiB: the log fits, the 22 MB checkpoint does not
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_full_disk_fails_in_one_line_and_leaves_no_temporary_file(tmp_path):
    run = tmp_path / "run"
    r = wansync(
        "train",
        "--strategy",
        "ddp",
        "--workers",
        "1",
        "--steps",
        "2",
        "--quiet",
        "--out",
        str(run),
        *TINY,
        timeout=150,
        setup=_small_files_only,
    )
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "rank 0: cannot write checkpoint" in r.stderr, r.stderr
    assert "File too large" in r.stderr, r.stderr
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]


def test_a_view_of_a_larger_buffer_is_written_as_its_own_elements_and_reads_back_the_same(tmp_path):
    """torch.save writes a view's whole storage: a model living in one row of a two-row block (as a
    local_sgd model does, beside the buffer its next average lands in) would be written twice.
    Views that fill their storage (a model in its flat buffer, a side band beside it) stay as they
    are: no copy."""
    block = torch.randn(2, 100_003)
    flat = torch.randn(50_003)
    state = {
        "step": 3,
        "world_size": 1,
        "model": {"w": block[0, :60_000].view(600, 100), "b": block[0, 60_000:100_000]},
        "filled": {"a": flat[:30_000], "b": flat[30_000:50_000]},
    }
    compacted = checkpoint.compact(state)
    assert compacted["filled"]["a"] is state["filled"]["a"] and compacted["filled"]["b"] is state["filled"]["b"]
    assert compacted["model"]["w"].untyped_storage().nbytes() == 60_000 * 4
    path = checkpoint.save_rank(tmp_path, 3, 0, state)
    assert path.stat().st_size < (100_000 + 50_003) * 4 + 10_000  # not the 2 x 100_003 of the block
    loaded = torch.load(path, weights_only=True)
    assert all(torch.equal(loaded["model"][k], state["model"][k]) for k in ("w", "b"))
    assert all(torch.equal(loaded["filled"][k], state["filled"][k]) for k in ("a", "b"))


def test_a_local_sgd_checkpoint_holds_the_model_once(tmp_path):
    """The trainer's checkpoint of a local_sgd run with drift telemetry (the model in one row of its
    two-row block) is no larger than a ddp run's of the same model."""
    sizes = {}
    for name in ("local_sgd", "ddp"):
        run = tmp_path / name
        every = ["--sync-every", "2"] if name == "local_sgd" else []
        r = wansync(
            "train",
            "--strategy",
            name,
            *every,
            "--workers",
            "2",
            "--steps",
            "4",
            "--checkpoint-every",
            "4",
            "--quiet",
            "--out",
            str(run),
            *TINY,
        )
        assert r.returncode == 0, r.stderr
        sizes[name] = (checkpoint.latest_step_dir(run) / "rank0.pt").stat().st_size
    assert sizes["local_sgd"] < 1.1 * sizes["ddp"], sizes


def _flip(path: Path) -> None:
    """One bit in the middle, the size unchanged (what a bad sector or a torn copy leaves)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path):
    (tmp_path / "config.toml").write_text("")
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    _flip(tmp_path / "checkpoints" / "step00000004" / "rank1.pt")
    d, passed = checkpoint.resume_dir(tmp_path, 1)
    assert d.name == "step00000002" and len(passed) == 1 and "rank1.pt is corrupted or truncated" in passed[0]
    assert checkpoint.resume_dir(tmp_path, 0) == (tmp_path / "checkpoints" / "step00000004", [])  # rank 0 alone


def test_the_ranks_settle_on_a_checkpoint_intact_on_every_one_of_them(tmp_path):
    """Rank 1's newest is damaged: both ranks resume from the older one (an all-reduce MIN, here by hand)."""
    (tmp_path / "config.toml").write_text("")
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    _flip(tmp_path / "checkpoints" / "step00000004" / "rank1.pt")
    proposals: list[list[int]] = [[], []]

    def lowest_of(rank: int):
        def lowest(value: int) -> int:  # both ranks' proposals in lock step: rank 1's is computed first
            proposals[rank].append(value)
            if rank == 1:
                return value
            other = proposals[1][len(proposals[0]) - 1]
            return min(value, other)

        return lowest

    d1, _ = checkpoint.resume_dir(tmp_path, 1, lowest_of(1))
    d0, _ = checkpoint.resume_dir(tmp_path, 0, lowest_of(0))
    assert d0 == d1 and d0.name == "step00000002"


def test_with_no_intact_checkpoint_left_resume_refuses_in_one_line(tmp_path):
    (tmp_path / "config.toml").write_text("")
    _save(tmp_path, 2)
    _flip(tmp_path / "checkpoints" / "step00000002" / "rank0.pt")
    with pytest.raises(DataError, match="rank0.pt is corrupted or truncated") as e:
        checkpoint.resume_dir(tmp_path, 0)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    """A worker of two ranks with FSDP inside, checkpointed at steps 2 and 4: each test damages a copy."""
    run = tmp_path_factory.mktemp("sharded") / "run"
    r = wansync(
        "train",
        "--strategy",
        "diloco",
        "--sync-every",
        "2",
        "--workers",
        "1",
        "--ranks-per-worker",
        "2",
        "--inside",
        "fsdp",
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--quiet",
        "--out",
        str(run),
        *TINY,
        timeout=150,
    )
    assert r.returncode == 0, r.stderr
    return run


@pytest.mark.parametrize("damaged", ["distcp", "metadata"])
def test_a_sharded_checkpoint_damaged_in_place_is_never_loaded(sharded_run, tmp_path, damaged):
    """A worker of two ranks with FSDP inside: a same-size corruption of one of its DCP files is caught by
    the digest its rank recorded; the run resumes from the checkpoint before, saying so in one line."""
    run = tmp_path / "run"
    shutil.copytree(sharded_run, run, symlinks=True)  # the same run for both: trained once
    shards = run / "checkpoints" / "step00000004" / "worker0"
    target = shards / ".metadata" if damaged == "metadata" else sorted(shards.glob("__1_*.distcp"))[0]
    _flip(target)
    r = wansync("train", "--resume", str(run), "--steps", "6", "--quiet", timeout=150)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "corrupted or truncated" in line]
    assert len(lines) == 1 and target.name in lines[0] and "resuming from step00000002" in lines[0], r.stderr
    assert "Warning" not in r.stderr, r.stderr  # torch's "existing checkpoint ... overwriting", once a rank
    assert no_process_left(run)


def test_a_full_disk_under_a_sharded_save_is_named_not_torchs_exception(tmp_path, monkeypatch):
    """DCP wraps each rank's failure in a CheckpointException (a BaseException, not an OSError): the
    one line names the file system's error, found among the ranks' failures (chaos benchmark)."""
    import errno

    import torch.distributed.checkpoint as dcp
    from wansync.errors import StorageError

    def full(*args, **kwargs):
        raise dcp.api.CheckpointException(
            "save",
            {
                0: (ValueError("rank 0 saw its peer fail"), None),
                1: (OSError(errno.ENOSPC, "No space left on device"), None),
            },
        )

    monkeypatch.setattr(dcp, "save", full)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(StorageError) as e:
        checkpoint.save_sharded(tmp_path, 4, 0, model, torch.optim.SGD(model.parameters(), lr=0.1), None)
    assert str(e.value).endswith("No space left on device (rank 1 of the worker; 2 of its ranks failed)")
    assert "cannot write checkpoint" in str(e.value)
