"""Reliability: bit-exact resume for every strategy, dead and hung peers, non-finite values,
loopback-only sockets. Every strategy in the registry joins the resume test automatically;
EXTRA holds the few options a strategy needs to make boundaries happen within a few steps.

The resume matrix runs the training loop in-process (`trainer_harness`): one process group
trains every strategy whole and stopped two steps past its checkpoint, a fresh group resumes
them all. One end-to-end case does the same through the command line with a real SIGKILL of one
rank of a worker of two ranks.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from cli_harness import TINY, no_process_left, start, wansync, worker_pids
from trainer_harness import lay_out, run_legs
from wansync.rundir import checkpoint
from wansync.runner.localgroup import run_ranks
from wansync.strategies import STRATEGIES, option_names

pytestmark = pytest.mark.timeout(240)

N = 4  # checkpoint after N of 2N steps
STOP_AT = N + 2  # in-process stop: step N+1 is on disk, so resume must drop it
EXTRA = {
    "streaming": {"fragments": 2, "overlap": 1, "sync_every": 4},  # an exchange is in flight at N
    # N fixed: the automatic N depends on measured step times, which differ between two runs
    "cocodc": {"fragments": 2, "overlap": 1, "sync_every": 4, "syncs_per_period": 3},
    "post_local_sgd": {"switch_step": 3},
}
TINY_KEYS = {flag[2:].replace("-", "_"): value for flag, value in zip(TINY[::2], TINY[1::2])}
# every strategy that resumes: async_diloco's learners never meet mid-run, so it checkpoints at its end only
RESUMABLE = sorted(n for n, c in STRATEGIES.items() if c.lock_step)
NAN_SKIP = ["local_sgd", "ddp"] + (["diloco"] if "diloco" in STRATEGIES else [])
NAN_FAULT = "rank=1,step=3,action=nan"


def strategy_options(name: str) -> dict:
    if name in EXTRA:
        return dict(EXTRA[name])
    return {"sync_every": 3} if "sync_every" in option_names(name) else {}


def strategy_args(name: str) -> list[str]:
    flags = [[f"--{k.replace('_', '-')}", str(v)] for k, v in strategy_options(name).items()]
    return ["--strategy", name, *(x for pair in flags for x in pair)]


def final_state(run: Path, rank: int, step: int) -> dict:
    return torch.load(run / "checkpoints" / f"step{step:08d}" / f"rank{rank}.pt", weights_only=True)


def metrics_after(run: Path, step: int) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] > step:
            out.append({k: v for k, v in rec.items() if k not in ("time", "items_per_s") and "_s" not in k})
    return out


def steps_recorded(run: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "step"]


def assert_resumed_run_equals_whole_run(name: str, whole: Path, broken: Path, ranks: int = 2) -> None:
    assert steps_recorded(broken) == list(range(1, 2 * N + 1))  # resumed at N, nothing twice
    for rank in range(ranks):
        a, b = final_state(whole, rank, 2 * N), final_state(broken, rank, 2 * N)
        for key in a["model"]:
            assert torch.equal(a["model"][key], b["model"][key]), f"{name} rank {rank}: {key} differs"
    assert metrics_after(whole, N) == metrics_after(broken, N)
    s_whole = json.loads((whole / "summary.json").read_text())
    s_broken = json.loads((broken / "summary.json").read_text())
    for key in ("final_val_loss", "best_val_loss", "bytes_sent", "sync_events"):
        assert s_whole[key] == s_broken[key], key


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Per strategy: a whole run, a run stopped at STOP_AT then resumed; and the non-finite-skip runs."""
    root = tmp_path_factory.mktemp("reliability")
    dirs: dict = {}
    for name in RESUMABLE:
        common = {
            "strategy": name,
            **strategy_options(name),
            "workers": 2,
            "steps": 2 * N,
            "checkpoint_every": N,
            "eval_every": 2,
            "quiet": True,
            **TINY_KEYS,
        }
        dirs[name] = {leg: Path(lay_out({**common, "out": str(root / name / leg)})) for leg in ("whole", "broken")}
    for name in NAN_SKIP:
        dirs["nan_" + name] = Path(
            lay_out(
                {
                    "strategy": name,
                    **strategy_options(name),
                    "workers": 2,
                    "steps": 8,
                    "on_nonfinite": "skip",
                    "quiet": True,
                    **TINY_KEYS,
                    "out": str(root / "nan" / name),
                }
            )
        )
    first = [{"run_dir": str(d["whole"])} for d in (dirs[n] for n in RESUMABLE)]
    first += [{"run_dir": str(dirs[n]["broken"]), "stop_at": STOP_AT} for n in RESUMABLE]
    first += [{"run_dir": str(dirs["nan_" + n]), "fault": NAN_FAULT} for n in NAN_SKIP]
    stopped = run_ranks(run_legs, 2, first, timeout=600)
    on_disk = {
        n: {
            "newest": checkpoint.latest_step_dir(dirs[n]["broken"]).name,
            "summary": (dirs[n]["broken"] / "summary.json").exists(),
            "last_step": json.loads((dirs[n]["broken"] / "metrics.jsonl").read_text().splitlines()[-1])["step"],
            "stopped": [r[len(RESUMABLE) + i] for r in stopped],
        }
        for i, n in enumerate(RESUMABLE)
    }
    run_ranks(run_legs, 2, [{"run_dir": str(dirs[n]["broken"]), "resume": True} for n in RESUMABLE], timeout=600)
    return {"dirs": dirs, "stopped": on_disk}


@pytest.mark.timeout(600)  # the first one waits for `runs`
@pytest.mark.parametrize("name", RESUMABLE)
def test_resume_is_bit_exact(runs, name):
    stopped = runs["stopped"][name]
    assert stopped["stopped"] == [{"stopped": f"injected failure at step {STOP_AT}"}] * 2
    assert stopped["newest"] == f"step{N:08d}" and not stopped["summary"]
    assert stopped["last_step"] > N  # records the resume must drop and redo
    assert_resumed_run_equals_whole_run(name, runs["dirs"][name]["whole"], runs["dirs"][name]["broken"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [n for n in ("streaming", "cocodc") if n in STRATEGIES])
def test_overlapped_strategies_checkpoint_with_an_exchange_in_flight(runs, name):
    for rank in range(2):
        assert final_state(runs["dirs"][name]["broken"], rank, N)["strategy"]["in_flight"]


def test_cli_resume_after_a_rank_is_killed_is_bit_exact_with_workers_of_two_ranks(tmp_path):
    """Through the command line with a real SIGKILL of one rank of a worker of two ranks (DDP inside
    a worker, the strategy between workers): the resumed run equals the whole run on every rank."""
    name = "cocodc" if "cocodc" in STRATEGIES else "diloco"
    common = [
        *strategy_args(name),
        "--workers",
        "2",
        "--ranks-per-worker",
        "2",
        "--steps",
        str(2 * N),
        "--checkpoint-every",
        str(N),
        "--eval-every",
        "2",
        *TINY,
    ]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    r = wansync("train", *common, "--out", str(whole))
    assert r.returncode == 0, r.stderr
    r = wansync("train", *common, "--out", str(broken), env={"WANSYNC_FAULT": f"rank=3,step={N + 1},action=kill"})
    assert r.returncode != 0 and "rank 3 was killed by SIGKILL" in r.stderr, r.stderr
    r = wansync("train", "--resume", str(broken))
    assert r.returncode == 0, r.stderr
    assert_resumed_run_equals_whole_run(name, whole, broken, ranks=4)


def test_a_hung_peer_ends_the_run_within_the_timeout(tmp_path):
    out = tmp_path / "run"
    t0 = time.monotonic()
    r = wansync(
        "train",
        "--strategy",
        "ddp",
        "--workers",
        "2",
        "--steps",
        "40",
        "--peer-timeout",
        "5",
        "--out",
        str(out),
        *TINY,
        env={"WANSYNC_FAULT": "rank=1,step=3,action=stop"},
        timeout=120,
    )
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "rank 0 lost contact with a peer during step" in r.stderr and "rank 1 is stopped" in r.stderr, r.stderr
    assert "Timed out" in r.stderr and ".cc:" not in r.stderr
    assert elapsed < 60
    assert no_process_left(out)


def test_nan_gradient_abort_stops_with_a_clear_message(tmp_path):
    r = wansync(
        "train",
        "--strategy",
        "local_sgd",
        "--sync-every",
        "2",
        "--workers",
        "2",
        "--steps",
        "10",
        "--out",
        str(tmp_path / "run"),
        *TINY,
        env={"WANSYNC_FAULT": "rank=1,step=3,action=nan"},
    )
    assert r.returncode != 0
    assert "rank 1: non-finite gradient on rank 1 at step 3" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("order", ["the crash exited first", "the peer exited first"])
def test_the_launcher_reports_a_crash_not_the_lost_contact_it_caused(tmp_path, order):
    from wansync.runner.launch import error_file, first_cause

    error_file(tmp_path, 0).parent.mkdir()
    error_file(tmp_path, 0).write_text(
        "rank 0 lost contact with a peer during step 4 (synchronization): " "RuntimeError: Connection closed by peer\n"
    )
    error_file(tmp_path, 1).write_text("rank 1: non-finite gradient on rank 1 at step 3\n")
    codes = [1, 1] if order == "the crash exited first" else [1, None]
    assert first_cause(tmp_path, codes) == "rank 1: non-finite gradient on rank 1 at step 3"
    assert first_cause(tmp_path, [1, None, None]).startswith("rank 1: ")  # rank 2 wrote nothing yet


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NAN_SKIP)
def test_nan_gradient_skip_continues_and_state_stays_finite(runs, name):
    out = runs["dirs"]["nan_" + name]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] >= 1 and math.isfinite(summary["final_val_loss"])
    state = final_state(out, 0, 8)
    tensors = [v for v in state["model"].values()]
    tensors += [v for v in _tensors(state["strategy"])]
    assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _listening_addresses(pids: list[int]) -> list[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                found.append(cols[1].split(":")[0])
    return found


def test_local_runs_listen_only_on_loopback(tmp_path):
    out = tmp_path / "run"
    proc = start("train", "--strategy", "ddp", "--workers", "2", "--steps", "60", "--out", str(out), *TINY)
    try:
        addresses: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.running():
            if (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size > 0:
                pids = [proc.pid] + [int(p) for p in os.listdir("/proc") if p.isdigit() and _child_of(int(p), proc.pid)]
                addresses = _listening_addresses(pids)
                break
            time.sleep(0.2)
        assert addresses, "no listening socket found while the run was going"
        loopback = {"0100007F", "00000000000000000000000001000000"}
        assert all(a in loopback for a in addresses), addresses
    finally:
        proc.kill()
        for pid in worker_pids(out).values():
            os.kill(pid, 9)


def _child_of(pid: int, parent: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[-1].split()[1]) == parent
