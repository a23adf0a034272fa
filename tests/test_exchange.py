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
from wansync.comm.exchange import Exchange
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
        out[("skip", codec)] = {
            "mean": mean,
            "ledger": skip.ledger.snapshot(),
            "dropped": skip.ledger.dropped,
            "wire_bytes": handle.wire_bytes,
            "waits": waits,
            "waited_s": handle.waited_s,
        }
        out[("all_valid", codec)] = {
            "skip": Exchange(nonfinite="skip").mean(clean, "pseudo_grads", codec).wait(),
            "abort": Exchange(nonfinite="abort").mean(clean, "pseudo_grads", codec).wait(),
            "none": Exchange().mean(clean, "pseudo_grads", codec).wait(),
        }
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
    side = torch.cat([clean, torch.tensor([rank + 1.0])])  # the values and one side-band scalar
    handle = Exchange().mean(side, "params", inplace=True, extra=1, mean_sq=True)
    out["mean_sq"] = {"mean": side.clone(), "mean_sq": handle.mean_sq, "norm": handle.norm}
    side = torch.cat([bad, torch.zeros(1)])
    handle = Exchange(nonfinite="skip").mean(side, "params", inplace=True, extra=1, mean_sq=True)
    out["mean_sq_skip"] = {"mean": side.clone(), "mean_sq": handle.mean_sq}
    try:
        Exchange().mean(bad.clone(), "params", inplace=True, mean_sq=True).wait()
        out["mean_sq_nan"] = None
    except NonFiniteError as e:
        out["mean_sq_nan"] = str(e)
    after = torch.tensor([rank + 1.0])
    dist.all_reduce(after)  # pairs with the other rank's: nothing stray was sent
    out["after_abort"] = float(after[0])
    for case, policy, x in (("all_invalid", "skip", torch.full((4,), float("nan"))), ("unguarded_nan", None, bad)):
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
        assert {k: ledger["telemetry"][k] for k in ("calls", "bytes", "waited_s")} == {
            "calls": 0,
            "bytes": 8,
            "waited_s": 0.0,
        }


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
    assert torch.equal(a["mean"], c.decode(c.encode(valid)))  # the mean of the one valid worker
    assert torch.equal(a["mean"], b["mean"])
    assert (a["dropped"], b["dropped"]) == (0, 1)
    for r in (a, b):
        assert r["wire_bytes"] == c.wire_bytes(GUARD_N)
        assert r["ledger"]["pseudo_grads"]["calls"] == 1
        assert r["ledger"]["pseudo_grads"]["bytes"] == r["wire_bytes"]
        guard = r["ledger"]["nonfinite_guard"]
        assert {k: guard[k] for k in ("calls", "bytes", "waited_s")} == {
            "calls": 1,
            "waited_s": 0.0,
            "bytes": 4 if codec == "fp32" else 1,
        }


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


def test_mean_sq_is_the_means_float64_square_norm_and_its_non_finite_check(results: list[dict]) -> None:
    exact = (_rank_input(0, GUARD_N) + _rank_input(1, GUARD_N)) / 2
    valid = results[0]["guard"]["clean0"]
    for r in results:
        o = r["guard"]["mean_sq"]
        assert torch.equal(o["mean"][:GUARD_N], exact) and o["mean"][GUARD_N:].tolist() == [1.5]
        assert o["mean_sq"] == pytest.approx(float(exact.double().square().sum()), rel=1e-12) and o["norm"] is None
        skip = r["guard"]["mean_sq_skip"]  # rank 1 sent NaN and was left out, side band too
        assert torch.equal(skip["mean"][:GUARD_N], valid) and skip["mean"][GUARD_N:].tolist() == [0.0]
        assert skip["mean_sq"] == pytest.approx(float(valid.double().square().sum()), rel=1e-12)
        assert r["guard"]["mean_sq_nan"].startswith("the mean of the workers' params is non-finite")


def _transformer_like(n: int, seed: int) -> torch.Tensor:
    """Weights of ~0.02 with, every 100k values, a norm weight of 256 ones: a few rows carry most
    of the squared norm, as in a transformer."""
    torch.manual_seed(seed)
    x = torch.randn(n) * 0.02
    for a in range(0, n - 256, 100_000):
        x[a : a + 256] = 1.0 + 1e-3 * torch.randn(256)
    return x


@pytest.mark.parametrize("n", [1000, 70_000, 1_000_000])
def test_exact_sq_norm_is_within_1e_9_of_float64_where_a_float32_dot_is_not(n: int) -> None:
    from wansync.comm.norms import exact_sq_norm

    errors, dot_errors = [], []
    for seed in range(5):
        x = _transformer_like(n, seed)
        ref = float(x.double().square().sum())
        errors.append(abs(exact_sq_norm(x) - ref) / ref)
        dot_errors.append(abs(float(torch.dot(x, x)) - ref) / ref)
    assert max(errors) < 1e-9
    if n == 1_000_000:
        assert max(dot_errors) > 1e-8  # what the drift's identity cannot afford


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_exact_sq_norm_of_other_float_types_is_their_float64_norm(dtype: torch.dtype) -> None:
    from wansync.comm.norms import exact_sq_norm

    x = _transformer_like(70_000, 0).to(dtype)
    assert exact_sq_norm(x) == pytest.approx(float(x.double().square().sum()), rel=1e-12)


def test_exact_sq_norm_of_non_finite_values() -> None:
    from wansync.comm.norms import exact_sq_norm

    for n in (10, 100_000):
        x = torch.ones(n)
        x[n // 2] = float("nan")
        assert math.isnan(exact_sq_norm(x))
        x[n // 2] = 1e30  # finite, its square beyond float32's range
        assert exact_sq_norm(x) == pytest.approx(1e60, rel=1e-6)
        x[n // 2] = float("inf")
        assert exact_sq_norm(x) == math.inf
