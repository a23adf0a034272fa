"""DDP and LocalSGD on real 2-rank gloo groups: the foundation's identities."""
from __future__ import annotations

import pytest
import torch

from wansync.localgroup import run_ranks
from strategy_harness import run_strategy

pytestmark = pytest.mark.timeout(120)


def test_ddp_keeps_parameters_identical_on_all_ranks():
    a, b = run_ranks(run_strategy, 2, "ddp", {}, 6)
    for pa, pb in zip(a["params"], b["params"]):
        assert torch.equal(pa, pb)
    assert not torch.equal(a["params"][0], a["params"][-1])      # it did train


def test_local_sgd_every_step_with_plain_sgd_equals_ddp():
    ddp = run_ranks(run_strategy, 2, "ddp", {}, 6)
    lsgd = run_ranks(run_strategy, 2, "local_sgd", {"sync_every": 1}, 6)
    for rank in range(2):
        for p_ddp, p_l in zip(ddp[rank]["params"], lsgd[rank]["params"]):
            torch.testing.assert_close(p_l, p_ddp, rtol=0, atol=1e-6)


def test_local_sgd_identical_right_after_each_boundary_and_different_between():
    a, b = run_ranks(run_strategy, 2, "local_sgd", {"sync_every": 5}, 15)
    for step in range(15):
        t = step + 1
        same = torch.equal(a["params"][step], b["params"][step])
        assert same == (t % 5 == 0), f"step {t}: identical={same}"
    syncs = [e for e in a["events"] if e["type"] == "sync"]
    assert [e["step"] for e in syncs] == [5, 10, 15]
    assert all(e["drift"] > 0 for e in syncs)
    assert a["comm"]["params"]["calls"] == 3


def test_same_seed_same_final_parameters():
    first = run_ranks(run_strategy, 2, "local_sgd", {"sync_every": 3}, 9)
    second = run_ranks(run_strategy, 2, "local_sgd", {"sync_every": 3}, 9)
    assert torch.equal(first[0]["params"][-1], second[0]["params"][-1])
    other = run_ranks(run_strategy, 2, "local_sgd", {"sync_every": 3}, 9, "sgd", 0.05, 1)
    assert not torch.equal(first[0]["params"][-1], other[0]["params"][-1])
