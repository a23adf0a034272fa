"""The environment cannot silently override the command line: a torchrun environment is adopted
only when complete and consistent, with one line saying so; anything else is refused in one line."""
from __future__ import annotations

import socket

import pytest

from cli_harness import TINY, wansync

pytestmark = pytest.mark.timeout(150)

TRAIN = ["train", "--strategy", "ddp", "--steps", "2", "--quiet", *TINY]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def torchrun(rank: str = "0", world: str = "1", addr: str = "127.0.0.1", port: str | None = None) -> dict[str, str]:
    return {"RANK": rank, "WORLD_SIZE": world, "MASTER_ADDR": addr, "MASTER_PORT": port or free_port()}


CASES = [
    ("a stale environment against --workers 2", torchrun(), ["--workers", "2"],
     "says WORLD_SIZE=1 (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set) but this run has --workers 2"),
    ("a partial environment", {"RANK": "0", "WORLD_SIZE": "2"}, [],
     "incomplete torchrun environment: RANK, WORLD_SIZE set but MASTER_ADDR, MASTER_PORT not"),
    ("RANK not a number", torchrun(rank="abc"), [], "RANK must be an integer in [0, 0], got 'abc'"),
    ("RANK beyond WORLD_SIZE", torchrun(rank="3", world="2"), [], "RANK must be an integer in [0, 1], got '3'"),
    ("WORLD_SIZE zero", torchrun(world="0"), [], "WORLD_SIZE must be an integer >= 1, got '0'"),
    ("MASTER_PORT out of range", torchrun(port="99999"), [], "MASTER_PORT must be an integer in [1, 65535]"),
    ("a world that workers of R ranks cannot fill", torchrun(world="3"), ["--ranks-per-worker", "2"],
     "WORLD_SIZE=3, which workers of --ranks-per-worker 2 cannot fill"),
    ("--workers x --ranks-per-worker against WORLD_SIZE", torchrun(world="2"), ["--workers", "2", "--ranks-per-worker", "2"],
     "says WORLD_SIZE=2 (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set) but this run has --workers 2 x "
     "--ranks-per-worker 2"),
]


@pytest.mark.parametrize("label, env, flags, expect", CASES, ids=[c[0] for c in CASES])
def test_an_environment_that_does_not_fit_is_refused_in_one_line(tmp_path, label, env, flags, expect):
    r = wansync(*TRAIN, *flags, "--out", str(tmp_path / "run"), env=env, timeout=120)
    assert r.returncode == 1, f"{label}: {r.stdout} {r.stderr}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wansync: error: ") and expect in lines[0], r.stderr
    assert not (tmp_path / "run").exists()


def test_a_complete_environment_is_adopted_and_says_so(tmp_path):
    env = torchrun()
    run = tmp_path / "run"
    r = wansync(*TRAIN, "--out", str(run), env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"wansync: under torchrun: rank 0 of 1, rendezvous 127.0.0.1:{env['MASTER_PORT']}" in r.stdout.splitlines()
    assert "workers = 1" in (run / "config.toml").read_text()
