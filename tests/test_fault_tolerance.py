"""--fault-tolerant: a worker killed mid-run is left out, restarted, healed from a live peer, and the
run ends with every worker holding the same parameters (torchft on gloo, 127.0.0.1)."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from cli_harness import TINY, no_process_left, wansync
from wansync.comm.ft import INSTALL, require_torchft
from wansync.config import build_config
from wansync.errors import ConfigError

pytest.importorskip("torchft")

KILL_AT = 22          # after the boundary of step 20, before that of 25


def sync_participants(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["participants"]) for r in records if r["type"] == "sync"]


@pytest.fixture(scope="module")
def killed_and_restarted(tmp_path_factory):
    out = tmp_path_factory.mktemp("ft") / "run"
    r = wansync("train", "--strategy", "diloco", "--sync-every", "5", "--workers", "3", "--steps", "100",
                "--eval-every", "1000", "--fault-tolerant", "--max-restarts", "1", "--quiet", "--out", str(out),
                *TINY, env={"WANSYNC_FAULT": f"rank=1,step={KILL_AT},action=kill"}, timeout=240)
    return r, out


def test_a_killed_worker_does_not_end_the_run(killed_and_restarted):
    r, out = killed_and_restarted
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["worker_failures"] == 1 and summary["rejoins"] == 1 and summary["heals"] == 1
    assert no_process_left(out)


def test_the_exchange_after_the_failure_has_two_participants_then_three_after_healing(killed_and_restarted):
    _, out = killed_and_restarted
    seen = sync_participants(out)
    assert all(p == 3 for s, p in seen if s < KILL_AT)
    after = [p for s, p in seen if s > KILL_AT]
    assert after[0] == 2
    assert 3 in after and after[-1] == 3


def test_every_worker_ends_with_the_same_parameters(killed_and_restarted):
    _, out = killed_and_restarted
    final = sorted((out / "checkpoints").glob("step*"))[-1]
    models = [torch.load(final / f"rank{r}.pt", weights_only=False)["model"] for r in range(3)]
    for other in models[1:]:
        assert all(torch.equal(models[0][k], other[k]) for k in models[0])


def test_strategies_that_all_reduce_every_step_are_refused_in_one_line():
    for strategy in ("ddp", "cpdp", "post_local_sgd"):
        with pytest.raises(ConfigError, match="all-reduces gradients every step"):
            build_config(overrides={"strategy": strategy, "fault_tolerant": True})


def test_a_lossy_codec_and_workers_of_several_ranks_are_refused():
    with pytest.raises(ConfigError, match="fp32 only"):
        build_config(overrides={"strategy": "streaming", "fault_tolerant": True, "codec": "int8"})
    with pytest.raises(ConfigError, match="one rank"):
        build_config(overrides={"strategy": "diloco", "fault_tolerant": True, "ranks_per_worker": 2})


def test_without_torchft_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ConfigError, match=r"pip install wansync\[ft\]"):
        require_torchft()
    assert "wansync[ft]" in INSTALL


def test_the_cli_refuses_an_unsupported_strategy_in_one_line(tmp_path):
    r = wansync("train", "--strategy", "ddp", "--fault-tolerant", "--workers", "2", "--steps", "2",
                "--out", str(tmp_path / "run"), *TINY, timeout=60)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "all-reduces gradients every step" in r.stderr
