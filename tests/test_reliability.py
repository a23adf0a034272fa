"""Reliability: bit-exact resume for every strategy, dead and hung peers, non-finite values,
loopback-only sockets. Every strategy in the registry joins the resume test automatically;
EXTRA holds the few flags a strategy needs to make boundaries happen within a few steps."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cli_harness import TINY, no_process_left, wansync
from wansync.strategies import STRATEGIES, option_names

pytestmark = pytest.mark.timeout(240)

N = 4                                                   # checkpoint after N of 2N steps
EXTRA = {"streaming": ["--fragments", "2", "--overlap", "1", "--sync-every", "4"],
         "cocodc": ["--fragments", "2", "--overlap", "1", "--sync-every", "4"],
         "post_local_sgd": ["--switch-step", "3"]}


def strategy_args(name: str) -> list[str]:
    if name in EXTRA:
        return ["--strategy", name, *EXTRA[name]]
    return ["--strategy", name, *(["--sync-every", "3"] if "sync_every" in option_names(name) else [])]


def final_state(run: Path, rank: int, step: int) -> dict:
    return torch.load(run / "checkpoints" / f"step{step:08d}" / f"rank{rank}.pt", weights_only=True)


def metrics_after(run: Path, step: int) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] > step:
            out.append({k: v for k, v in rec.items() if k not in ("time", "items_per_s") and "_s" not in k})
    return out


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_resume_is_bit_exact(tmp_path, name):
    common = [*strategy_args(name), "--workers", "2", "--steps", str(2 * N), "--checkpoint-every", str(N),
              "--eval-every", "2", *TINY]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    r = wansync("train", *common, "--out", str(whole))
    assert r.returncode == 0, r.stderr
    r = wansync("train", *common, "--out", str(broken), env={"WANSYNC_FAULT": f"rank=1,step={N + 1},action=kill"})
    assert r.returncode != 0 and "killed by SIGKILL" in r.stderr
    r = wansync("train", "--resume", str(broken))
    assert r.returncode == 0, r.stderr
    for rank in range(2):
        a, b = final_state(whole, rank, 2 * N), final_state(broken, rank, 2 * N)
        for key in a["model"]:
            assert torch.equal(a["model"][key], b["model"][key]), f"{name} rank {rank}: {key} differs"
    assert metrics_after(whole, N) == metrics_after(broken, N)
    s_whole = json.loads((whole / "summary.json").read_text())
    s_broken = json.loads((broken / "summary.json").read_text())
    for key in ("final_val_loss", "best_val_loss", "bytes_sent", "sync_events"):
        assert s_whole[key] == s_broken[key], key


def test_a_hung_peer_ends_the_run_within_the_timeout(tmp_path):
    out = tmp_path / "run"
    t0 = time.monotonic()
    r = wansync("train", "--strategy", "ddp", "--workers", "2", "--steps", "40", "--peer-timeout", "5",
                "--out", str(out), *TINY, env={"WANSYNC_FAULT": "rank=1,step=3,action=stop"}, timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "rank 0 lost contact with a peer during step" in r.stderr and "rank 1 is stopped" in r.stderr, r.stderr
    assert "Timed out" in r.stderr and ".cc:" not in r.stderr
    assert elapsed < 60
    assert no_process_left(out)


def test_nan_gradient_abort_stops_with_a_clear_message(tmp_path):
    r = wansync("train", "--strategy", "local_sgd", "--sync-every", "2", "--workers", "2", "--steps", "10",
                "--out", str(tmp_path / "run"), *TINY, env={"WANSYNC_FAULT": "rank=1,step=3,action=nan"})
    assert r.returncode != 0
    assert "rank 1: non-finite gradient on rank 1 at step 3" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["local_sgd", "ddp"] + (["diloco"] if "diloco" in STRATEGIES else []))
def test_nan_gradient_skip_continues_and_state_stays_finite(tmp_path, name):
    out = tmp_path / "run"
    r = wansync("train", *strategy_args(name), "--workers", "2", "--steps", "8", "--on-nonfinite", "skip",
                "--out", str(out), *TINY, env={"WANSYNC_FAULT": "rank=1,step=3,action=nan"})
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] >= 1 and torch.isfinite(torch.tensor(summary["final_val_loss"]))
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
            if cols[3] == "0A" and cols[9] in inodes:        # 0A = LISTEN
                found.append(cols[1].split(":")[0])
    return found


def test_local_runs_listen_only_on_loopback(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "wansync", "train", "--strategy", "ddp", "--workers", "2",
                             "--steps", "60", "--out", str(out), *TINY], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        addresses: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
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
        proc.wait()
        for p in os.listdir("/proc"):
            if p.isdigit() and _has_run_dir(int(p), out):
                os.kill(int(p), 9)


def _child_of(pid: int, parent: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[-1].split()[1]) == parent


def _has_run_dir(pid: int, run: Path) -> bool:
    try:
        return f"WANSYNC_RUN_DIR={run}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
