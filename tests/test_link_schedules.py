"""Links that change during a run (`net.schedule`): the emulator reads them at a transfer's start, every
rank alike, a run carries on through a 10x drop, its per-step timeline shows it, and the report plots
the exposed share over time."""

from __future__ import annotations

import json
import statistics
import time

import pytest

from cli_harness import TINY, wansync
from wansync.runner.localgroup import run_ranks

pytestmark = pytest.mark.timeout(240)

DROP = """
name = "drop"
[sites.a]
workers = 1
[sites.b]
workers = 1
[[links]]
sites = ["a", "b"]
rtt = "2ms"
bw = "1gbit"
[[schedules]]
links = "all"
steps = [{{ at = "{at}s", scale = 0.1 }}]
"""


def _before_and_after(rank: int, world: int, path: str) -> dict:
    """Two ranks under the file's emulated link: one all-reduce of 1 MB before the drop, one after."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from wansync import net

    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", int(path.split(":")[1]), world, rank == 0, timedelta(seconds=60))
    dist.init_process_group(
        net.install(),
        store=store,
        rank=rank,
        world_size=world,
        pg_options=net.Emulator(net.parse_wan(path.split(":")[0]), seed=0),
        timeout=timedelta(seconds=60),
    )
    t = torch.ones(250_000)
    emulator = net.emulator_of()
    dist.all_reduce(t)
    before = emulator.records()[-1].modelled_s
    while emulator.run_time(time.perf_counter()) < 1.2:
        time.sleep(0.05)
    dist.all_reduce(t)
    return {"before": before, "after": emulator.records()[-1].modelled_s}


def test_the_emulator_reads_the_link_at_each_transfers_start_alike_on_every_rank(tmp_path):
    import socket

    path = tmp_path / "drop.toml"
    path.write_text(DROP.format(at=1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = run_ranks(_before_and_after, 2, f"{path}:{port}", timeout=60)
    assert out[0] == out[1]  # every rank models the same durations
    latency = 2e-3
    assert out[0]["after"] - latency == pytest.approx(10 * (out[0]["before"] - latency), rel=1e-6)


def test_a_run_goes_on_through_a_10x_drop_and_its_timeline_shows_it(tmp_path):
    path = tmp_path / "drop.toml"
    path.write_text(DROP.format(at=2.0))  # late enough that a loaded start-up still trains before it
    out = tmp_path / "run"
    r = wansync(
        "train",
        "--strategy",
        "ddp",
        "--workers",
        "2",
        "--steps",
        "120",
        "--wan",
        str(path),
        "--eval-every",
        "1000",
        "--quiet",
        "--checkpoint-every",
        "0",
        "--out",
        str(out),
        *TINY,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    steps = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if json.loads(line).get("type") == "step"
    ]
    assert len(steps) == 120
    # the link's clock started before the run's: on it, step time t is at t + offset (a loaded machine: late)
    offset = json.loads((out / "summary.json").read_text())["wan"]["schedule_s_at_start"]
    early = [s["exposed_s"] for s in steps if s["time"] + offset < 1.9]
    late = [s["exposed_s"] for s in steps if s["time"] + offset > 2.5]
    assert early and late, [s["time"] for s in steps]
    # gradients over a tenth of the bandwidth: the model's all-reduce goes from 9.3 to 75 ms, but before the drop
    # the real one on loopback is slower than the model (21-42 ms a step, median 24, in a clean clone's suite
    # with another test beside it: the emulator only adds time), so the ratio measured there was 3.1, not 8
    assert statistics.median(late) > 2.5 * statistics.median(early)
    rep = wansync("report", str(tmp_path), timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert (tmp_path / "exposed_over_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "exposed_over_time.png" in (tmp_path / "report.md").read_text()
