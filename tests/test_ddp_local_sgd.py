"""DDP and LocalSGD on real 2-rank gloo groups: the foundation's identities.

Every training runs in one process group (`several`), except a repeat of one of them in a
second group: same seed, same bits, across processes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from wansync.runner.localgroup import run_ranks
from strategy_harness import run_strategy

pytestmark = pytest.mark.timeout(120)

RUNS: dict[str, tuple[Any, ...]] = {  # run_strategy's arguments after (rank, world)
    "ddp": ("ddp", {}, 6),
    "local_sgd_h1": ("local_sgd", {"sync_every": 1}, 6),
    "local_sgd_h5": ("local_sgd", {"sync_every": 5}, 15),
    "local_sgd_h3": ("local_sgd", {"sync_every": 3}, 9),
    "local_sgd_h3_seed1": ("local_sgd", {"sync_every": 3}, 9, "sgd", 0.05, 1),
}


def several(rank: int, world: int, runs: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """Each run of `runs` (name -> run_strategy arguments), one after the other, in this group."""
    return {key: run_strategy(rank, world, *args) for key, args in runs.items()}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(several, 2, RUNS)


def test_ddp_keeps_parameters_identical_on_all_ranks(runs):
    a, b = (r["ddp"] for r in runs)
    for pa, pb in zip(a["params"], b["params"]):
        assert torch.equal(pa, pb)
    assert not torch.equal(a["params"][0], a["params"][-1])  # it did train


def test_local_sgd_every_step_with_plain_sgd_equals_ddp(runs):
    for rank in range(2):
        for p_ddp, p_l in zip(runs[rank]["ddp"]["params"], runs[rank]["local_sgd_h1"]["params"]):
            torch.testing.assert_close(p_l, p_ddp, rtol=0, atol=1e-6)


def test_local_sgd_identical_right_after_each_boundary_and_different_between(runs):
    a, b = (r["local_sgd_h5"] for r in runs)
    for step in range(15):
        t = step + 1
        same = torch.equal(a["params"][step], b["params"][step])
        assert same == (t % 5 == 0), f"step {t}: identical={same}"
    syncs = [e for e in a["events"] if e["type"] == "sync"]
    assert [e["step"] for e in syncs] == [5, 10, 15]
    assert all(e["drift"] > 0 for e in syncs)  # each boundary's drift
    assert a["comm"]["params"]["calls"] == 3


def test_same_seed_same_final_parameters(runs):
    first = runs[0]["local_sgd_h3"]
    second = run_ranks(several, 2, {"again": RUNS["local_sgd_h3"]})[0]["again"]  # another group
    assert torch.equal(first["params"][-1], second["params"][-1])
    other = runs[0]["local_sgd_h3_seed1"]
    assert not torch.equal(first["params"][-1], other["params"][-1])
