"""Workers of several ranks under the emulator, on a real 4-rank gloo group over 127.0.0.1.

Two workers of two ranks on ``cross-region`` (a_inter = 50 ms, b_inter = 1.25e8 B/s of line, of which
a ring's TCP payload is 1448/1580: B1G): worker 0 is
ranks 0, 1 on site 0, worker 1 is ranks 2, 3 on site 1. The sharded exchange between workers is two
groups, {0, 2} and {1, 3}, made with ``net.shared_uplink(2)``, each all-reducing half of a
B = 8 MB model at once; they share each site's uplink, so each takes what one rank all-reducing the
whole model would: 2·50 ms + 2·(1/2)·2·4e6/B1G s = 169.8 ms.
"""

from __future__ import annotations

import socket
import time

import pytest

from wansync.runner.localgroup import run_ranks

pytestmark = pytest.mark.timeout(180)

WORLD = 4
MS = 1e-3
MODEL_BYTES = 8_000_000
HALF = MODEL_BYTES // 2
B1G, B10G = 1.25e8 * 1448 / 1580, 1.25e9 * 1448 / 1580  # a ring's payload bytes/s on a 1 and a 10 Gbit/s line
SHARED = 100 * MS + 2 * 0.5 * 2 * HALF / B1G  # 169.8 ms: {0, 2} and {1, 3} at once
ALONE = 100 * MS + 2 * 0.5 * HALF / B1G  # 134.9 ms: a group made without options

# every rank at once (DDP's all-reduce): a flat ring 0->1->2->3->0 crossing the sites at 1->2 and 3->0,
# on every one of its 6 steps, as gloo runs it: the cost model's (`net.cost`), never less than the
# 6 quarters of B over a crossing hop plus its latency
ALL_RANKS_FLOOR = 6 * MODEL_BYTES / 4 / B1G + 50 * MS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replicas_rank(rank: int, world: int, port: int) -> dict:
    """A rank of `run_ranks` (forked, torch imported): its plain gloo group gives way to the emulated one."""
    import torch.distributed as dist

    dist.destroy_process_group()
    return _replicas(rank, port)


@pytest.fixture(scope="module")
def replicas():
    return run_ranks(_replicas_rank, WORLD, _free_port(), timeout=120)


def test_whole_workers_sit_on_one_site(replicas):
    for out in replicas:
        assert out["sites"] == [0, 0, 1, 1]


def test_parallel_cross_worker_groups_take_the_shared_uplink_formula(replicas):
    for rank, out in enumerate(replicas):
        shard = out["shared"]
        assert shard["parallel"] == 2
        assert shard["record"]["op"] == "allreduce" and shard["record"]["nbytes"] == HALF
        assert shard["record"]["modelled_s"] == pytest.approx(SHARED, rel=1e-12)
        assert shard["elapsed"] >= shard["record"]["modelled_s"]  # the emulator only adds time
        peer = (rank + 2) % WORLD
        assert shard["value_ok"], f"rank {rank}: not the sum of ranks {rank} and {peer}"


def test_a_group_made_without_options_runs_alone_on_the_uplink(replicas):
    for out in replicas:
        assert out["alone"]["parallel"] == 1
        assert out["alone"]["modelled_s"] == pytest.approx(ALONE, rel=1e-12)


def test_all_ranks_all_reducing_are_one_flat_ring_that_crosses_the_sites_on_every_step(replicas):
    from dataclasses import replace

    from wansync import net

    expected = net.collective_duration(
        "allreduce", MODEL_BYTES, WORLD, replace(net.parse_wan("cross-region"), ranks_per_worker=2)
    )
    for out in replicas:
        assert out["world"]["modelled_s"] == pytest.approx(expected, rel=1e-12)
        assert out["world"]["modelled_s"] > ALL_RANKS_FLOOR


def test_shared_uplink_options_are_for_emulated_groups_only(replicas):
    for out in replicas:
        assert out["options"] == {"carries_the_emulator": True, "copies": 2, "plain_group": None}


def test_shared_uplink_without_an_emulated_default_group_is_no_options():
    from wansync import net

    assert net.shared_uplink(2) is None  # no process group at all here: a plain new_group() follows


# -- worker side ----------------------------------------------------------------------------------


def _replicas(rank: int, port: int) -> dict:
    from dataclasses import replace
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from wansync import net

    topology = replace(net.parse_wan("cross-region"), ranks_per_worker=2)
    emulator = net.Emulator(topology, seed=0)
    dist.init_process_group(
        net.install(),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
        pg_options=emulator,
    )
    plain = dist.new_group(backend="gloo")
    options = net.shared_uplink(2)
    out: dict = {
        "sites": [topology.site_of(r, WORLD) for r in range(WORLD)],
        "options": {
            "carries_the_emulator": options.emulator is emulator,
            "copies": options.copies,
            "plain_group": net.shared_uplink(2, group=plain),
        },
    }
    cross = [dist.new_group(ranks, pg_options=net.shared_uplink(2)) for ranks in ([0, 2], [1, 3])]
    alone = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])]
    mine, mine_alone = cross[rank % 2], alone[rank % 2]

    def fresh():
        dist.barrier(group=plain)
        emulator.reset_records()

    fresh()
    shard = torch.full((HALF // 4,), float(rank))
    t0 = time.perf_counter()
    dist.all_reduce(shard, group=mine)
    elapsed = time.perf_counter() - t0
    (rec,) = emulator.records()
    out["shared"] = {
        "parallel": mine.parallel,
        "record": rec.as_dict(),
        "elapsed": elapsed,
        "value_ok": bool(torch.all(shard == float(rank + (rank + 2) % WORLD))),
    }

    fresh()
    dist.all_reduce(torch.ones(HALF // 4), group=mine_alone)
    (rec,) = emulator.records()
    out["alone"] = {"parallel": mine_alone.parallel, "modelled_s": rec.modelled_s}

    fresh()
    dist.all_reduce(torch.ones(MODEL_BYTES // 4))
    (rec,) = emulator.records()
    out["world"] = {"modelled_s": rec.modelled_s}
    dist.barrier(group=plain)
    return out
