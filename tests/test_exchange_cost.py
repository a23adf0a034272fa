"""One cost for one exchange between workers: `net.cost.exchange_seconds`. CoCoDC's T_s (through
`Exchange.modelled_seconds`), the trainer's link line and the planner all call it, and for the same
setting (the same link inside a worker) they give the same seconds."""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import Any

import pytest
import torch

from wansync.net import PRESETS, cost, parse_wan

from strategy_harness import deep_model as model

pytestmark = pytest.mark.timeout(300)


COCODC = {"sync_every": 8, "fragments": 2, "overlap": 1}


def callers() -> list[Any]:
    """The loaded modules that call `net.cost.exchange_seconds` (the exchange's cost, the trainer, the
    planner: all imported first)."""
    import wansync.comm.mean_cost  # noqa: F401
    import wansync.planner.simulate  # noqa: F401
    import wansync.trainer.loop  # noqa: F401

    return [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("wansync.") and getattr(m, "exchange_seconds", None) is cost.exchange_seconds
    ]


def recorder(calls: list[float]) -> Any:
    """`net.cost.exchange_seconds`, appending each result to `calls`."""
    real = cost.exchange_seconds

    def recorded(*args: Any, **kw: Any) -> float:
        calls.append(real(*args, **kw))
        return calls[-1]

    return recorded


@pytest.fixture
def one_cost(monkeypatch) -> list[float]:
    """The results of every call to the one exchange cost during the test, in order."""
    calls: list[float] = []
    modules = callers()
    assert {m.__name__ for m in modules} >= {
        "wansync.comm.mean_cost",
        "wansync.planner.simulate",
        "wansync.trainer.loop",
    }
    recorded = recorder(calls)
    for module in modules:
        monkeypatch.setattr(module, "exchange_seconds", recorded)
    return calls


def _cocodc_t_s(rank: int, world: int, wan: str, codec: str) -> dict[str, Any]:
    import torch.distributed as dist

    import wansync as ws
    from wansync import net

    calls: list[float] = []
    recorded = recorder(calls)
    for module in callers():
        setattr(module, "exchange_seconds", recorded)  # this process ends with the test
    group = dist.new_group([0, 1], backend=net.install(), pg_options=net.Emulator(net.parse_wan(wan)))
    m = model()
    sync = ws.strategy("cocodc", m, torch.optim.SGD(m.parameters(), lr=0.1), group=group, codec=codec, **COCODC)
    return {"t_s": sync.t_s, "source": sync.t_s_source, "calls": calls}


def trainer_seconds(wan: str, workers: int, ranks_per_worker: int, options: dict[str, Any]) -> float:
    """The seconds the trainer's link line prints, to its 3 significant digits."""
    from wansync.config import build_config
    from wansync.strategies import resolve_options
    from wansync.trainer.loop import link_cost

    cfg = build_config(None, {"strategy": "cocodc", "wan": wan, "ranks_per_worker": ranks_per_worker, **options})
    line = link_cost(cfg, model(), resolve_options("cocodc", options), workers * ranks_per_worker)
    return float(re.search(r"takes ~([0-9.e+-]+) ms", line).group(1)) / 1e3


def planner_seconds(wan: str, workers: int, ranks_per_worker: int, options: dict[str, Any]) -> float:
    """The planner's T_s: the modelled transfer of a mean-sized fragment, as `FragmentPlan.decide_n`."""
    from wansync.planner.schedule import fragment_transfer
    from wansync.planner.simulate import transfer_seconds
    from wansync.planner.sizes import of_module

    numels = of_module("test", model()).fragments(options["fragments"])
    mean = round(sum(numels) / options["fragments"])
    from wansync.strategies import make_options

    xs = fragment_transfer(0, 0, mean, make_options("cocodc", **options), workers)
    return sum(transfer_seconds(parse_wan(wan), workers, ranks_per_worker)(x) for x in xs)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_cocodcs_t_s_the_trainers_link_line_and_the_planner_are_one_function_and_agree(codec, one_cost):
    from wansync.runner.localgroup import run_ranks

    cocodc = run_ranks(_cocodc_t_s, 2, "two-site", codec)[0]
    assert cocodc["source"] == "model" and cocodc["calls"] == [cocodc["t_s"]]
    options = {**COCODC, "codec": codec}
    planned = planner_seconds("two-site", 2, 1, options)
    printed = trainer_seconds("two-site", 2, 1, options)
    assert one_cost == [planned, pytest.approx(printed, rel=5e-3)]  # both asked the one function
    assert planned == cocodc["t_s"]
    assert f"{printed * 1e3:.3g}" == f"{cocodc['t_s'] * 1e3:.3g}"


def test_for_a_worker_of_two_ranks_the_planner_the_emulator_and_cocodcs_t_s_read_one_inside_link(one_cost):
    """The link inside a worker is one field of the topology (`Topology.inside_worker`): the site's by
    default, as an emulated run has it, or `worker=nvlink`. CoCoDC's T_s (the exchange's `mean_seconds`),
    the trainer's link line and the planner read it there, and the emulator's backend charges a worker's
    own groups on it: they agree for either link, by construction."""
    from wansync.comm.mean_cost import mean_seconds
    from wansync.planner.sizes import of_module

    options = {**COCODC, "codec": "fp32"}
    numel = round(of_module("test", model()).sync_numel / options["fragments"])
    seen = {}
    for wan in ("cross-region", "cross-region,worker=nvlink"):
        topology = dataclasses.replace(parse_wan(wan), ranks_per_worker=2)
        one_cost.clear()
        emulated = mean_seconds(numel, "fp32", topology, 4, 2)
        printed = trainer_seconds(wan, 4, 2, options)
        planned = planner_seconds(wan, 4, 2, options)
        assert one_cost == [emulated, pytest.approx(printed, rel=5e-3), planned]
        assert planned == emulated and f"{printed * 1e3:.3g}" == f"{emulated * 1e3:.3g}"
        # the backend's cost of the all-gather inside worker 1 (global ranks 2, 3 of 8) is the planner's
        inside = cost.collective_duration("allgather", 4 * numel, 8, topology, ranks=[2, 3])
        assert inside == cost.in_worker_seconds("allgather", 4 * numel, 2, topology)
        seen[wan] = emulated, inside
    site, nvlink = seen["cross-region"], seen["cross-region,worker=nvlink"]
    assert site[1] == cost.collective_duration("allgather", 4 * numel, 2, PRESETS["lan"])  # the site's 10 Gbit/s
    assert nvlink[1] < site[1] / 10 and nvlink[0] < site[0]


def test_the_exchange_cost_of_replica_groups_is_a_shard_across_then_the_whole_inside():
    """R = 2 workers on cross-region, 10 MB: the two groups share the uplink (one rank sending the whole
    buffer's bandwidth term), then the worker's ranks all-gather the 10 MB on the inside link."""
    link = PRESETS["cross-region"]
    assert link.inside_worker == PRESETS["lan"].intra_link  # by default, the site's link
    across = cost.collective_duration("allreduce", 1e7, 2, link)  # 100 ms + 87.3 ms
    gather = cost.collective_duration("allgather", 1e7, 2, PRESETS["lan"])  # 0.1 ms + 4.4 ms
    assert cost.exchange_seconds("allreduce", 1e7, link, 2, 2) == pytest.approx(across + gather)
    assert across == pytest.approx(0.1 + 1e7 / (1.25e8 * 1448 / 1580))  # a ring's TCP payload, 1 Gbit/s line
    hierarchical = cost.exchange_seconds("allreduce", 1e7, link, 2, 2, reduce_inside=True)
    assert hierarchical == pytest.approx(across + 2 * gather)  # DDP: reduce-scatter first
    flat = cost.collective_duration("allreduce", 1e7, 4, dataclasses.replace(link, ranks_per_worker=2))
    assert flat > hierarchical  # gloo's flat ring over all four ranks crosses the WAN on every step
    decoded = cost.exchange_seconds("allgather", 1e6, link, 2, 2, assembled_bytes=1e7)
    assert decoded == pytest.approx(cost.collective_duration("allgather", 1e6, 2, link) + gather)
    assert cost.exchange_seconds("allreduce", 1e7, link, 2) == across  # one rank per worker
