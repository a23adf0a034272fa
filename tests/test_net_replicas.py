"""Workers of several ranks under the emulator, on a real 4-rank gloo group over 127.0.0.1.

Two workers of two ranks on ``cross-region`` (a_inter = 50 ms, b_inter = 1.25e8 B/s of line, of which
a ring's TCP payload is 1448/1580: B1G): worker 0 is
ranks 0, 1 on site 0, worker 1 is ranks 2, 3 on site 1. The sharded exchange between workers is two
groups, {0, 2} and {1, 3}, made with ``net.shared_uplink(2)``, each all-reducing half of a
B = 8 MB model at once; they share each site's uplink, so each takes what one rank all-reducing the
whole model would: 2·50 ms + 2·(1/2)·2·4e6/B1G s = 169.8 ms.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

WORLD = 4
MS = 1e-3
MODEL_BYTES = 8_000_000
HALF = MODEL_BYTES // 2
B1G, B10G = 1.25e8 * 1448 / 1580, 1.25e9 * 1448 / 1580     # a ring's payload bytes/s on a 1 and a 10 Gbit/s line
SHARED = 100 * MS + 2 * 0.5 * 2 * HALF / B1G  # 169.8 ms: {0, 2} and {1, 3} at once
ALONE = 100 * MS + 2 * 0.5 * HALF / B1G  # 134.9 ms: a group made without options
RS_IN_SITE = 0.1 * MS + 0.5 * MODEL_BYTES / B10G  # 3.6 ms
ALL_RANKS = RS_IN_SITE + 100 * MS + MODEL_BYTES / B1G + RS_IN_SITE  # 177.0 ms: the site moves B once


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, tmp: Path, timeout: float = 120.0) -> list[dict]:
    """Run ``scenario`` on WORLD processes; return each rank's JSON. Never leaves a process behind."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = []
    for rank in range(WORLD):
        with open(tmp / f"{scenario}.{rank}.log", "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, __file__, scenario, str(rank), str(port), str(tmp)],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            ))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    if any(p.returncode != 0 for p in procs):
        logs = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n" + (tmp / f"{scenario}.{r}.log").read_text()[-3000:]
                         for r, p in enumerate(procs))
        raise AssertionError(f"scenario {scenario!r} failed:\n{logs}")
    return [json.loads((tmp / f"{scenario}.{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    return run_ranks("replicas", tmp_path_factory.mktemp("replicas"))


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


def test_all_ranks_all_reducing_move_the_model_over_each_uplink_once(replicas):
    for out in replicas:
        assert out["world"]["modelled_s"] == pytest.approx(ALL_RANKS, rel=1e-12)


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
        net.install(), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=30), pg_options=emulator,
    )
    plain = dist.new_group(backend="gloo")
    options = net.shared_uplink(2)
    out: dict = {
        "sites": [topology.site_of(r, WORLD) for r in range(WORLD)],
        "options": {"carries_the_emulator": options.emulator is emulator, "copies": options.copies,
                    "plain_group": net.shared_uplink(2, group=plain)},
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
    out["shared"] = {"parallel": mine.parallel, "record": rec.as_dict(), "elapsed": elapsed,
                     "value_ok": bool(torch.all(shard == float(rank + (rank + 2) % WORLD)))}

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


if __name__ == "__main__":
    scenario, rank, port, outdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    result = {"replicas": _replicas}[scenario](rank, port)
    Path(outdir, f"{scenario}.{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # skip interpreter teardown of gloo threads; the JSON is the result
