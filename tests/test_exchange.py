"""Exchange on a real 2-rank gloo group: the codec mean gives the same bits on every rank, equal to
decode-then-mean; the non-finite guard leaves out an invalid worker (skip) or stops it before
anything is sent (abort); bytes and waits are booked once per exchange."""

from __future__ import annotations

import math

import multiprocessing as mp
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from wansync.comm.codecs import CODECS, Encoded
from wansync.comm.exchange import Exchange, distance_of
from wansync.errors import ConfigError, NonFiniteError

WORLD = 2
SIZES = [0, 1, 3001, 4096]
JOIN_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_input(rank: int, numel: int) -> torch.Tensor:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(100 * rank + numel))
    if numel > 2000:
        x[2000] = 50.0 * (rank + 1)  # an outlier in one chunk, different per rank
    return x


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=30),
    )
    try:
        results = {}
        exchange = Exchange()
        for numel in SIZES:
            x = _rank_input(rank, numel)
            before = x.clone()
            all_x = [torch.empty_like(x) for _ in range(WORLD)]
            dist.all_gather(all_x, x)
            for name, codec in CODECS.items():
                for async_op in (False, True):
                    handle = exchange.mean(x, "pseudo_grads", name, async_op=async_op)
                    x.add_(1.0)  # the caller may reuse its buffer right away
                    x.copy_(before)
                    mean = handle.wait()
                    assert handle.wait() is mean
                    # reference computed locally from every rank's raw input
                    ref = torch.zeros(numel)
                    for xr in all_x:
                        ref += codec.decode(codec.encode(xr))
                    ref /= WORLD
                    results[(numel, name, async_op)] = {
                        "mean": mean,
                        "ref": ref,
                        "exact": (all_x[0] + all_x[1]) / 2,
                        "wire_bytes": handle.wire_bytes,
                        "payload_bytes": handle.payload_bytes,
                    }
            assert torch.equal(x, before)
        results["guard"] = _guard_cases(rank)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


GUARD_N = 3001
GUARD_CODECS = ("fp32", "int8")


def _guard_cases(rank: int) -> dict:
    """The non-finite guard on both ranks; rank 1's input has a NaN where a case says so."""
    import torch.distributed as dist

    clean = _rank_input(rank, GUARD_N)
    bad = clean.clone()
    if rank == 1:
        bad[5] = float("nan")
    out: dict = {"clean0": _rank_input(0, GUARD_N)}
    for codec in GUARD_CODECS:
        skip = Exchange(nonfinite="skip")
        waits: list = []
        skip.ledger.on_wait.append(lambda purpose, s: waits.append((purpose, s)))
        handle = skip.mean(bad, "pseudo_grads", codec, async_op=True)
        mean = handle.wait()
        out[("skip", codec)] = {"mean": mean, "ledger": skip.ledger.snapshot(), "dropped": skip.ledger.dropped,
                                "wire_bytes": handle.wire_bytes, "waits": waits, "waited_s": handle.waited_s}
        out[("all_valid", codec)] = {
            "skip": Exchange(nonfinite="skip").mean(clean, "pseudo_grads", codec).wait(),
            "abort": Exchange(nonfinite="abort").mean(clean, "pseudo_grads", codec).wait(),
            "none": Exchange().mean(clean, "pseudo_grads", codec).wait()}
    buf = bad.clone()
    result = Exchange(nonfinite="skip").mean(buf, "params", inplace=True).wait()
    out["inplace"] = {"same_tensor": result is buf, "buf": buf}
    wide = Exchange()
    out["float64"] = {"mean": wide.mean(clean.double(), "params").wait(), "ledger": wide.ledger.snapshot()}
    sync_ex = Exchange()
    sync_ex.mean(clean, "params")
    out["sync_waits"] = sync_ex.ledger.snapshot()["params"]
    abort = Exchange(nonfinite="abort")
    if rank == 1:
        try:
            abort.mean(bad, "params")
            out["abort"] = None
        except NonFiniteError as e:
            out["abort"] = str(e)
        out["abort_ledger"] = abort.ledger.snapshot()
    own, into = clean.clone(), torch.empty_like(clean)
    handle = Exchange().mean(own, "params", out=into)
    out["out"] = {"same_tensor": handle.wait() is into, "mean": into, "left": own,
                  "distance": handle.distance, "norm": handle.norm, "values_sq": handle.values_sq}
    pair = torch.empty(2, GUARD_N + 2)       # a strategy's spare and home, one block (the home second)
    pair[1, :GUARD_N], pair[1, GUARD_N:] = clean, torch.tensor([rank + 1.0, 10.0 * rank])
    handle = Exchange().mean(pair[1], "params", out=pair[0], extra=2)
    out["paired"] = {"mean": handle.wait().clone(), "distance": handle.distance, "values_sq": handle.values_sq}
    pair[1, :GUARD_N], pair[1, GUARD_N:] = bad, 0.0
    handle = Exchange(nonfinite="skip").mean(pair[1], "params", out=pair[0], extra=2)
    out["paired_skip"] = {"distance": handle.distance, "norm": handle.norm}
    own, into = bad.clone(), torch.empty_like(bad)
    handle = Exchange(nonfinite="skip").mean(own, "params", out=into)
    out["out_skip"] = {"mean": handle.wait(), "distance": handle.distance, "norm": handle.norm}
    try:
        Exchange().mean(bad.clone(), "params", out=torch.empty_like(bad)).wait()
        out["out_nan"] = None
    except NonFiniteError as e:
        out["out_nan"] = str(e)
    after = torch.tensor([rank + 1.0])
    dist.all_reduce(after)                  # pairs with the other rank's: nothing stray was sent
    out["after_abort"] = float(after[0])
    for case, policy, x in (("all_invalid", "skip", torch.full((4,), float("nan"))),
                            ("unguarded_nan", None, bad)):
        try:
            Exchange(nonfinite=policy).mean(x, "pseudo_grads").wait()
            out[case] = None
        except NonFiniteError as e:
            out[case] = str(e)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("exchange")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(out))) for r in range(WORLD)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(JOIN_TIMEOUT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    codes = [p.exitcode for p in procs]
    assert codes == [0] * WORLD, f"worker exit codes {codes}"
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


CASES = [(n, name, a) for n in SIZES for name in sorted(CODECS) for a in (False, True)]


@pytest.mark.parametrize("numel,name,async_op", CASES)
def test_every_rank_gets_the_same_bits(results: list[dict], numel: int, name: str, async_op: bool) -> None:
    a, b = (r[(numel, name, async_op)]["mean"] for r in results)
    assert a.dtype == torch.float32 and a.shape == (numel,)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("numel,name,async_op", CASES)
def test_mean_equals_decode_then_mean(results: list[dict], numel: int, name: str, async_op: bool) -> None:
    r = results[0][(numel, name, async_op)]
    assert torch.equal(r["mean"], r["ref"])


@pytest.mark.parametrize("numel", SIZES)
def test_fp32_mean_is_exact(results: list[dict], numel: int) -> None:
    for async_op in (False, True):
        r = results[0][(numel, "fp32", async_op)]
        assert torch.equal(r["mean"], r["exact"])


@pytest.mark.parametrize("numel,name,async_op", CASES)
def test_byte_accounting(results: list[dict], numel: int, name: str, async_op: bool) -> None:
    r = results[0][(numel, name, async_op)]
    assert r["payload_bytes"] == 4 * numel
    assert r["wire_bytes"] == CODECS[name].wire_bytes(numel)


def test_lossy_mean_is_close_to_the_exact_mean(results: list[dict]) -> None:
    keep = torch.cat([torch.arange(0, 1024), torch.arange(2048, 4096)])  # skip the outliers' chunk
    # randn chunks: absmax ≲ 4, so bf16 ≤ 4·2^-8, int8 ≤ (4/127)/2, fp4 ≤ one scale (4/6) per rank
    for name, tol in (("bf16", 0.016), ("int8", 0.016), ("fp4", 0.67)):
        r = results[0][(4096, name, True)]
        assert (r["mean"] - r["exact"])[keep].abs().max() < tol


def test_single_process_mean_is_the_quantized_input() -> None:
    x = torch.randn(3001)
    exchange = Exchange()
    assert exchange.world_size == 1
    for name, codec in CODECS.items():
        handle = exchange.mean(x, "pseudo_grads", name, async_op=True)
        assert torch.equal(handle.wait(), codec.decode(codec.encode(x)))


@pytest.mark.parametrize("policy", [None, "skip"])
def test_extra_scalars_ride_along_exactly_and_cost_no_call(policy) -> None:
    x, side = torch.randn(3001), torch.tensor([0.123456789, -7.5])
    for name, codec in CODECS.items():
        exchange = Exchange(nonfinite=policy)
        buf = torch.cat([x, side])
        handle = exchange.mean(buf, "params", name, extra=2)
        mean = handle.wait()
        assert torch.equal(mean[:-2], codec.decode(codec.encode(x))) and torch.equal(mean[-2:], side)
        assert handle.payload_bytes == 3001 * 4 and handle.wire_bytes == codec.wire_bytes(3001)
        ledger = exchange.ledger.snapshot()
        assert ledger["params"]["calls"] == 1 and ledger["params"]["bytes"] == codec.wire_bytes(3001)
        assert ledger["telemetry"] == {"calls": 0, "bytes": 8, "waited_s": 0.0}


def test_extra_scalars_are_not_model_state_for_the_guard() -> None:
    buf = torch.cat([torch.randn(10), torch.tensor([float("inf")])])
    assert torch.isinf(Exchange(nonfinite="abort").mean(buf, "params", extra=1).wait()[-1])


def test_lossy_codecs_reject_non_float32_input() -> None:
    with pytest.raises(TypeError, match="float32"):
        Exchange().mean(torch.zeros(4, dtype=torch.float64), "pseudo_grads", "fp4")


def test_payload_round_trips_through_encoded() -> None:
    # the collective ships only Encoded.data; numel and codec name are known on both sides
    x = torch.randn(1500)
    for name, codec in CODECS.items():
        data = codec.encode(x).data.clone()
        assert torch.equal(codec.decode(Encoded(name, 1500, data)), codec.decode(codec.encode(x)))


# ---- the non-finite guard ---------------------------------------------------------------------------
@pytest.mark.parametrize("codec", GUARD_CODECS)
def test_skip_leaves_out_a_non_finite_worker_and_books_the_bytes_once(results: list[dict], codec: str) -> None:
    a, b = (r["guard"][("skip", codec)] for r in results)
    valid = results[0]["guard"]["clean0"]
    c = CODECS[codec]
    assert torch.equal(a["mean"], c.decode(c.encode(valid)))         # the mean of the one valid worker
    assert torch.equal(a["mean"], b["mean"])
    assert (a["dropped"], b["dropped"]) == (0, 1)
    for r in (a, b):
        assert r["wire_bytes"] == c.wire_bytes(GUARD_N)
        assert r["ledger"]["pseudo_grads"]["calls"] == 1
        assert r["ledger"]["pseudo_grads"]["bytes"] == r["wire_bytes"]
        assert r["ledger"]["nonfinite_guard"] == {"calls": 1, "bytes": 4 if codec == "fp32" else 1,
                                                  "waited_s": 0.0}


@pytest.mark.parametrize("codec", GUARD_CODECS)
def test_with_every_worker_valid_the_guard_changes_no_bit(results: list[dict], codec: str) -> None:
    for r in results:
        same = r["guard"][("all_valid", codec)]
        assert torch.equal(same["skip"], same["none"]) and torch.equal(same["abort"], same["none"])


def test_a_wait_is_booked_once_under_its_purpose(results: list[dict]) -> None:
    for r in results:
        skip = r["guard"][("skip", "fp32")]
        assert [p for p, _ in skip["waits"]] == ["pseudo_grads"]
        assert skip["waits"][0][1] == skip["waited_s"] == skip["ledger"]["pseudo_grads"]["waited_s"] >= 0
        assert r["guard"]["sync_waits"]["calls"] == 1 and r["guard"]["sync_waits"]["waited_s"] > 0


def test_inplace_writes_the_mean_into_the_buffer(results: list[dict]) -> None:
    assert all(r["guard"]["inplace"]["same_tensor"] for r in results)
    valid = results[0]["guard"]["clean0"]
    assert torch.equal(results[1]["guard"]["inplace"]["buf"], valid)


def test_fp32_averages_any_float_dtype_and_books_its_size(results: list[dict]) -> None:
    mean = results[0]["guard"]["float64"]["mean"]
    exact = (_rank_input(0, GUARD_N).double() + _rank_input(1, GUARD_N).double()) / 2
    assert mean.dtype == torch.float64 and torch.equal(mean, exact)
    assert results[0]["guard"]["float64"]["ledger"]["params"]["bytes"] == 8 * GUARD_N


def test_abort_raises_before_anything_is_sent(results: list[dict]) -> None:
    bad = results[1]["guard"]
    assert bad["abort"] == "non-finite values in this worker's params before the exchange (--on-nonfinite abort)"
    assert bad["abort_ledger"] == {}
    assert [r["guard"]["after_abort"] for r in results] == [3.0, 3.0]


def test_no_valid_worker_or_a_non_finite_mean_raises_on_every_rank(results: list[dict]) -> None:
    for r in results:
        assert r["guard"]["all_invalid"] == "every worker's pseudo_grads was non-finite: nothing left to average"
        assert r["guard"]["unguarded_nan"].startswith("the mean of the workers' pseudo_grads is non-finite")


def test_an_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="on_nonfinite must be abort or skip, got 'ignore'"):
        Exchange(nonfinite="ignore")



def test_out_of_place_mean_measures_this_workers_distance(results: list[dict]) -> None:
    exact = (_rank_input(0, GUARD_N) + _rank_input(1, GUARD_N)) / 2
    for rank, r in enumerate(results):
        o = r["guard"]["out"]
        assert o["same_tensor"] and torch.equal(o["mean"], exact)
        mine = _rank_input(rank, GUARD_N)
        assert torch.equal(o["left"], mine - exact)
        ref = float(torch.linalg.vector_norm((mine - exact).double()))
        assert o["distance"] == pytest.approx(ref, rel=1e-6) and o["norm"] is None
        assert o["values_sq"] == pytest.approx(float(mine.double().square().sum()), rel=1e-6)


def test_a_mean_into_the_row_beside_the_values_measures_the_same_distance(results: list[dict]) -> None:
    """Values and mean as the two rows of one block (local_sgd's home and spare) take the fused
    pass; the side band rides along without entering the distance."""
    exact = (_rank_input(0, GUARD_N) + _rank_input(1, GUARD_N)) / 2
    for rank, r in enumerate(results):
        o = r["guard"]["paired"]
        assert torch.equal(o["mean"][:GUARD_N], exact) and o["mean"][GUARD_N:].tolist() == [1.5, 5.0]
        mine = _rank_input(rank, GUARD_N)
        ref = float(torch.linalg.vector_norm((mine - exact).double()))
        assert o["distance"] == pytest.approx(ref, rel=1e-6)
        assert o["values_sq"] == pytest.approx(float(mine.double().square().sum()), rel=1e-6)
        skip = r["guard"]["paired_skip"]               # rank 1 sent NaN: its distance is NaN, the mean checked
        if rank == 0:
            assert skip["distance"] == 0.0 and skip["norm"] is None
        else:
            valid = float(r["guard"]["clean0"].norm())
            assert math.isnan(skip["distance"]) and skip["norm"] == pytest.approx(valid, rel=1e-5)


@pytest.mark.parametrize("order", ["values first", "mean first"])
def test_paired_rows_take_one_fused_pass_that_agrees_with_subtracting(order: str) -> None:
    torch.manual_seed(0)
    pair = torch.randn(2, 5000, dtype=torch.float64).float()
    values, mean = (pair[0], pair[1]) if order == "values first" else (pair[1], pair[0])
    ref = float(torch.linalg.vector_norm(values.double() - mean.double()))
    kept = values.clone()
    assert distance_of(values, mean) == pytest.approx(ref, rel=1e-6)
    assert torch.equal(values, kept)                       # fused: nothing written
    apart = values.clone()                                 # not beside the mean: subtract, then a dot
    assert distance_of(apart, mean) == pytest.approx(ref, rel=1e-6) and torch.equal(apart, kept - mean)


def test_a_pair_too_long_for_the_fused_pass_subtracts(monkeypatch: pytest.MonkeyPatch) -> None:
    import wansync.comm.exchange as ex
    monkeypatch.setattr(ex, "PAIRED_DISTANCE_MAX", 100)
    pair = torch.randn(2, 101)
    kept = pair[0].clone()
    assert distance_of(pair[0], pair[1]) == pytest.approx(float((kept - pair[1]).norm()), rel=1e-6)
    assert torch.equal(pair[0], kept - pair[1])


def test_a_non_finite_pair_has_a_non_finite_distance() -> None:
    for bad in (float("nan"), float("inf")):
        pair = torch.ones(2, 8)
        pair[1, 3] = bad
        assert not math.isfinite(distance_of(pair[0], pair[1]))


def test_out_of_place_mean_checks_the_mean_when_the_distance_is_not_finite(results: list[dict]) -> None:
    valid = results[0]["guard"]["clean0"]
    for rank, r in enumerate(results):
        skip = r["guard"]["out_skip"]                  # rank 1 sent NaN and was left out
        assert torch.equal(skip["mean"], valid)
        if rank == 0:
            assert skip["distance"] == 0.0 and skip["norm"] is None
        else:                                          # its own distance is NaN: the mean was checked instead
            assert math.isnan(skip["distance"]) and skip["norm"] == pytest.approx(float(valid.norm()), rel=1e-5)
        assert r["guard"]["out_nan"].startswith("the mean of the workers' params is non-finite")


def test_out_must_be_shaped_like_the_buffer() -> None:
    with pytest.raises(ValueError, match="out must be shaped like buf"):
        Exchange().mean(torch.zeros(4), "params", out=torch.zeros(5))
