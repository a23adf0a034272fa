"""A lossy codec's mean over many workers: the all-gather of every payload, or the reduce-scatter of
encoded chunks then the all-gather of the re-encoded mean chunks (`Exchange.lossy_collective`).

On real gloo groups of 2, 4 and 8 ranks: every rank ends with the same bits; what a rank puts on
the wire stays about 2(M−1)/M of a payload on the reduce-scatter path (it grows as (M−1) on the
all-gather path) and below fp32's ring all-reduce at every M; the mean is close to the exact one;
a worker dropped under "skip" and the side band ride along as on the other paths.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from wansync.comm.codecs import get_codec
from wansync.comm.exchange import Exchange
from wansync.runner.localgroup import run_ranks

NUMEL = 20_000


def means(rank: int, world: int, codecs: list[str]) -> dict[str, Any]:
    """Per codec and path: this rank's mean of the workers' buffers, its ledger, and the exact mean."""
    gen = torch.Generator().manual_seed(rank)
    mine = torch.randn(NUMEL, generator=gen) * (1 + rank)
    every = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(r)) * (1 + r) for r in range(world)]
    out: dict[str, Any] = {"exact": torch.stack(every).mean(0)}
    for name in codecs:
        for path in ("allgather", "reduce_scatter"):
            ex = Exchange()
            mean = ex.mean(mine.clone(), "pseudo_grads", name, collective=path).wait()
            out[(name, path)] = {"mean": mean, "comm": ex.ledger.snapshot()["pseudo_grads"]}
    ex = Exchange()
    ex.mean(mine.clone(), "pseudo_grads")
    out["fp32"] = ex.ledger.snapshot()["pseudo_grads"]
    return out


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict[str, Any]]]:
    return {m: run_ranks(means, m, ["int8", "fp4"], timeout=180) for m in (2, 4, 8)}


@pytest.mark.parametrize("m", [2, 4, 8])
@pytest.mark.parametrize("codec", ["int8", "fp4"])
@pytest.mark.parametrize("path", ["allgather", "reduce_scatter"])
def test_every_rank_ends_with_the_same_bits(runs, m, codec, path):
    first = runs[m][0][(codec, path)]["mean"]
    assert all(torch.equal(r[(codec, path)]["mean"], first) for r in runs[m])


@pytest.mark.parametrize("codec", ["int8", "fp4"])
def test_the_reduce_scatter_sends_about_two_payloads_whatever_the_workers(runs, codec):
    payload = get_codec(codec).wire_bytes(NUMEL)
    for m in (2, 4, 8):
        rs = runs[m][0][(codec, "reduce_scatter")]["comm"]
        ag = runs[m][0][(codec, "allgather")]["comm"]
        fp32 = runs[m][0]["fp32"]
        assert rs["bytes"] == ag["bytes"] == payload  # the payload: one encoded buffer
        assert ag["sent"] == (m - 1) * payload  # grows with M
        assert rs["sent"] <= 2 * (m - 1) / m * payload * 1.01 + 64 * m  # does not (chunk scales: ~1 %)
        assert rs["sent"] < fp32["sent"]  # below fp32's ring all-reduce


@pytest.mark.parametrize("codec, bound", [("int8", 0.03), ("fp4", 0.3)])
def test_both_paths_come_close_to_the_exact_mean(runs, codec, bound):
    for m in (2, 4, 8):
        exact = runs[m][0]["exact"]
        for path in ("allgather", "reduce_scatter"):
            rel = float((runs[m][0][(codec, path)]["mean"] - exact).norm() / exact.norm())
            assert rel < bound, f"{codec} {path} M={m}: {rel:.3g}"


def test_auto_on_a_modelled_link_takes_the_path_the_link_model_times_shorter():
    from wansync.comm.mean_cost import lossy_path, mean_seconds
    from wansync.net.wan import PRESETS

    link = PRESETS["cross-region"]
    assert lossy_path("int8", "auto", 2, 10**8, link) == "allgather"  # 2 workers: the same bytes
    assert lossy_path("int8", "auto", 4, 10**5, link) == "allgather"  # latency-bound: one collective
    assert lossy_path("int8", "auto", 4, 10**8, link) == "reduce_scatter"  # bandwidth-bound: fewer bytes
    assert lossy_path("int8", "auto", 4, 10**5) == "reduce_scatter"  # no link model: fewer bytes
    assert lossy_path("int8", "allgather", 4, 10**8, link) == "allgather"  # a path asked for is kept
    for m in (3, 4, 8, 16):
        for n in (10**3, 10**5, 10**6, 10**7, 10**8):
            for r, shards in ((1, False), (2, False), (2, True)):
                chosen = lossy_path("fp4", "auto", m, n, link, r, shards)
                times = {p: mean_seconds(n, "fp4", link, m, r, shards, p) for p in ("allgather", "reduce_scatter")}
                assert times[chosen] == min(times.values())


def test_auto_takes_the_all_gather_for_two_workers_and_the_reduce_scatter_beyond():
    int8 = get_codec("int8")
    ex = Exchange()
    ex.world_size = 2
    assert ex.lossy_collective(int8) == "allgather"
    ex.world_size = 3
    assert ex.lossy_collective(int8) == "reduce_scatter"
    assert ex.lossy_collective(int8, "allgather") == "allgather"
    assert ex.lossy_collective(get_codec("fp32")) == "auto"


def skip_and_side_band(rank: int, world: int) -> dict[str, Any]:
    ex = Exchange(nonfinite="skip")
    buf = torch.full((1001,), float(rank + 1))
    buf[-1] = 10.0 * rank  # a side-band scalar
    if rank == 1:
        buf[3] = float("nan")  # this worker is left out
    mean = ex.mean(buf, "pseudo_grads", "int8", extra=1, collective="reduce_scatter").wait()
    return {"mean": mean, "dropped": ex.ledger.dropped}


def test_a_skipped_worker_and_the_side_band_ride_on_the_reduce_scatter():
    out = run_ranks(skip_and_side_band, 4, timeout=120)
    valid = [0, 2, 3]
    expected_values = sum(r + 1 for r in valid) / 3
    for o in out:
        assert torch.allclose(o["mean"][:-1], torch.full((1000,), expected_values), rtol=1e-2)
        assert float(o["mean"][-1]) == pytest.approx(sum(10.0 * r for r in valid) / 3)
        assert torch.equal(o["mean"], out[0]["mean"])
    assert [o["dropped"] for o in out] == [0, 1, 0, 0]


@pytest.mark.parametrize("codec", ["int8", "fp4", "bf16"])
def test_error_feedback_sends_over_time_what_the_worker_had_to_send(codec):
    """One worker (what it sends is the mean): Σ_t sent_t + residual_T = Σ_t x_t, where without
    feedback the quantization error accumulates."""
    torch.manual_seed(0)
    xs = [torch.randn(5000) * 1e-3 for _ in range(20)]
    residual = torch.zeros(5000)
    sent_sum, plain_sum = torch.zeros(5000), torch.zeros(5000)
    ex = Exchange()
    for x in xs:
        sent_sum += ex.mean(x.clone(), "pseudo_grads", codec, residual=residual).wait()
        plain_sum += ex.mean(x.clone(), "pseudo_grads", codec).wait()
    true = torch.stack(xs).sum(0)
    with_feedback = float((sent_sum + residual - true).norm() / true.norm())
    without = float((plain_sum - true).norm() / true.norm())
    assert with_feedback < 1e-5 and without > 100 * with_feedback


def feedback_on_the_reduce_scatter(rank: int, world: int) -> dict[str, Any]:
    """The residual is what the codec dropped of this worker's chunks as the all-to-all sent them."""
    codec = get_codec("int8")
    x = torch.randn(3001, generator=torch.Generator().manual_seed(rank))
    residual = torch.randn(3001, generator=torch.Generator().manual_seed(10 + rank)) * 1e-2
    sending = x + residual
    ex = Exchange()
    ex.mean(x.clone(), "pseudo_grads", codec, collective="reduce_scatter", residual=residual).wait()
    q = -(-3001 // world)
    padded = torch.zeros(q * world)
    padded[:3001] = sending
    own = torch.cat([codec.decode(codec.encode(padded[j * q : (j + 1) * q])) for j in range(world)])[:3001]
    return {"residual": residual, "expected": sending - own}


def test_error_feedback_on_the_reduce_scatter_keeps_what_its_chunks_dropped():
    for o in run_ranks(feedback_on_the_reduce_scatter, 4, timeout=120):
        assert torch.equal(o["residual"], o["expected"])


def test_diloco_trains_compressed_and_the_planner_books_what_the_ledger_does(tmp_path):
    """`diloco --codec int8` under an emulated lan: a quarter of fp32's bytes on the ledger, and
    `wansync plan`'s payload and wire bytes per step agree with the ledger's within 2 %; `auto` took
    the same path in both (the link model times the all-gather shorter for the micro LM's 0.2M
    values over 4 workers, so each rank sent 3 payloads)."""
    import json
    from cli_harness import TINY, wansync
    from wansync.net.wan import PRESETS
    from wansync.planner import of_name, predict, setting
    from wansync.strategies import resolve_options

    ledgers = {}
    for codec in ("fp32", "int8"):
        r = wansync(
            "train",
            "--strategy",
            "diloco",
            "--sync-every",
            "4",
            "--codec",
            codec,
            "--workers",
            "4",
            "--steps",
            "12",
            "--wan",
            "lan",
            *TINY,
            "--out",
            str(tmp_path / codec),
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        logs = r.stderr + "".join(f.read_text() for f in (tmp_path / codec / "logs").glob("*"))
        assert "Warning" not in logs and "deprecated" not in logs  # torch's all_gather deprecation: not shown
        ledgers[codec] = json.loads((tmp_path / codec / "summary.json").read_text())["comm"]
    sent = ledgers["int8"]["params"]
    assert sent["bytes"] < 0.26 * ledgers["fp32"]["params"]["bytes"]
    side_band = ledgers["int8"]["telemetry"]["bytes"]  # the drift's 4 bytes, in every payload
    assert sent["sent"] == 3 * (sent["bytes"] + side_band)  # the all-gather: (M − 1) payloads
    options = resolve_options("diloco", {"sync_every": 4, "codec": "int8"})
    p = predict(setting("diloco", options, of_name("micro"), 4, PRESETS["lan"], 0.1))
    booked = {
        k: sum(v[k] for purpose, v in ledgers["int8"].items() if purpose in ("params", "telemetry"))
        for k in ("bytes", "sent")
    }
    assert p.bytes_per_step == pytest.approx(booked["bytes"] / 12, rel=0.02)
    assert p.sent_per_step == pytest.approx(booked["sent"] / 12, rel=0.02)


def advanced_or_not(rank: int, world: int) -> dict[str, Any]:
    x = torch.randn(4000, generator=torch.Generator().manual_seed(rank))
    ex = Exchange()
    early = ex.mean(x.clone(), "pseudo_grads", "int8", async_op=True, collective="reduce_scatter")
    early.advance()  # the all-gather starts now, in the background
    late = ex.mean(x.clone(), "pseudo_grads", "int8", async_op=True, collective="reduce_scatter")
    return {"early": early.wait(), "late": late.wait()}


def test_starting_the_second_phase_early_changes_no_bit():
    out = run_ranks(advanced_or_not, 4, timeout=120)
    assert all(torch.equal(o["early"], o["late"]) and torch.equal(o["early"], out[0]["early"]) for o in out)
