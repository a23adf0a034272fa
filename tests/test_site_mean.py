"""The hierarchical all-reduce between workers (`comm.site_mean`) on real gloo groups under the
emulator: the exchange runs it where the cost model says it is faster, it gives the mean (every rank
the same bits), books which algorithm ran, and the emulator charges its three phases on the links
each crosses."""

from __future__ import annotations

import socket

import pytest

from wansync.runner.localgroup import run_ranks

pytestmark = pytest.mark.timeout(180)

NUMEL = 200_003


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _means(rank: int, world: int, port: int, wan: str, ranks_per_worker: int) -> dict:
    """One rank: the exchange's fp32 mean of a buffer of its own (sync and async), under `wan`."""
    from dataclasses import replace
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from wansync import net
    from wansync.comm.exchange import Exchange
    from wansync.comm.replicas import replica_groups

    dist.destroy_process_group()
    topology = replace(net.parse_wan(wan), ranks_per_worker=ranks_per_worker)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    dist.init_process_group(
        net.install(),
        store=store,
        rank=rank,
        world_size=world,
        pg_options=net.Emulator(topology, seed=0),
        timeout=timedelta(seconds=60),
    )
    replicas = replica_groups(ranks_per_worker)
    exchange = Exchange(replicas=replicas)
    worker = rank // ranks_per_worker
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(worker))
    emulator = net.emulator_of()
    before = emulator.record_count()
    blocking = exchange.mean(x, "params").wait()
    flowing = exchange.mean(x, "pseudo_grads", async_op=True)
    later = flowing.wait()
    records = [r.as_dict() for r in emulator.records_since(before)]
    everyone = [torch.empty_like(blocking) for _ in range(world)]
    plain = dist.new_group(backend="gloo")
    dist.all_gather(everyone, blocking, group=plain)
    workers = world // ranks_per_worker
    expected = sum(torch.randn(NUMEL, generator=torch.Generator().manual_seed(w)) for w in range(workers)) / workers
    return {
        "same_bits": all(torch.equal(everyone[0], e) for e in everyone),
        "error": float((blocking - expected).abs().max()),
        "async_equal": torch.equal(blocking, later),
        "algorithm": exchange.ledger.snapshot()["params"].get("algorithm"),
        "records": records,
        "chosen": exchange.sites.algorithm(4 * NUMEL),
    }


def test_uneven_sites_average_by_sites_and_every_rank_holds_the_same_bits():
    """uneven-3-region: workers 0, 1 in us-east, 2 in eu-west, 3 in ap-southeast; the model picks
    the hierarchical all-reduce for 0.8 MB, and the exchange runs it: the sum inside us-east, the three
    sites' first members' ring, the broadcast inside us-east."""
    from wansync.net import parse_wan
    from wansync.net.cost import allreduce_algorithm

    assert allreduce_algorithm(4 * NUMEL, 4, parse_wan("uneven-3-region")) == "hierarchical"
    out = run_ranks(_means, 4, _free_port(), "uneven-3-region", 1, timeout=120)
    for r in out:
        assert r["same_bits"] and r["async_equal"] and r["error"] < 1e-5
        assert r["algorithm"] == "hierarchical" and r["chosen"] == "hierarchical"
    # rank 0 (us-east's first member) takes part in all three phases; rank 2 (alone in eu-west) only in the
    # sites' ring; rank 1 in its site's sum and broadcast
    ops = {
        rank: [(rec["op"], rec["group"]) for rec in r["records"] if rec["nbytes"] >= 4 * NUMEL]
        for rank, r in enumerate(out)
    }
    assert [op for op, _ in ops[0][:3]] == ["allreduce", "allreduce", "broadcast"]
    assert [op for op, _ in ops[1][:2]] == ["allreduce", "broadcast"]
    assert [op for op, _ in ops[2][:1]] == ["allreduce"] and len(ops[2]) == 2  # one per mean


def test_one_worker_per_site_stays_flat():
    out = run_ranks(_means, 3, _free_port(), "rtt=20ms,bw=1gbit,sites=3", 1, timeout=120)
    for r in out:
        assert r["same_bits"] and r["error"] < 1e-5 and r["algorithm"] == "flat"


def test_workers_of_two_ranks_average_their_shards_by_sites():
    """3 workers of 2 ranks on 2 sites (workers 0, 1 in site 0): local rank r of each worker averages
    shard r by sites, the two copies at once on the links they share, then the worker reassembles."""
    from dataclasses import replace

    from wansync.net import parse_wan
    from wansync.net.cost import allreduce_algorithm

    topo = replace(parse_wan("cross-region"), ranks_per_worker=2)
    assert allreduce_algorithm(2 * NUMEL, 6, topo, [0, 2, 4], parallel=2) == "hierarchical"
    out = run_ranks(_means, 6, _free_port(), "cross-region", 2, timeout=150)
    for r in out:
        assert r["same_bits"] and r["error"] < 1e-5 and r["algorithm"] == "hierarchical"
