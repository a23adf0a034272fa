"""SparseLoCo and DeMo (strategies/sparseloco.py, strategies/demo.py) on real gloo groups (spec §10, §11):
their identities with DiLoCo and with sign descent, the error feedback's conservation, the published
rules written out directly (tests/sparse_reference.py), resume, and replicas that stay identical."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import wansync as ws
import sparse_reference as ref
from periodic_harness import run_scenarios
from strategy_harness import flat_params, rank_batch, tiny_model
from wansync.errors import ConfigError
from wansync.runner.localgroup import run_ranks

pytestmark = pytest.mark.timeout(240)

H = 3
ALPHA = 0.8
IDENTITY = {"density": 1.0, "bits": 32, "error_decay": 0.0, "outer_lr": ALPHA}


def _scenarios() -> dict[str, dict]:
    s = {
        "diloco_sgd": dict(
            name="diloco",
            options={"sync_every": H, "outer_lr": ALPHA, "outer_momentum": 0.0},
            steps=7,
            optimizer="adamw",
            lr=0.01,
        ),
        "sparseloco": dict(name="sparseloco", options={"sync_every": H}, steps=7, optimizer="adamw", lr=0.01),
        "sparseloco_resume": dict(
            name="sparseloco",
            options={"sync_every": H, "chunk": 4, "density": 0.25},
            steps=8,
            optimizer="adamw",
            lr=0.01,
            resume_at=4,
        ),
        "sparseloco_full": dict(
            name="sparseloco",
            options={"sync_every": H, "chunk": 4, "density": 0.25},
            steps=8,
            optimizer="adamw",
            lr=0.01,
        ),
        "demo_resume": dict(
            name="demo", options={"chunk": 4, "density": 0.25}, steps=6, optimizer="sgd", lr=0.01, resume_at=3
        ),
        "demo_full": dict(name="demo", options={"chunk": 4, "density": 0.25}, steps=6, optimizer="sgd", lr=0.01),
    }
    for rule in ("chosen", "all"):
        s[f"sparseloco_identity_{rule}"] = dict(
            name="sparseloco",
            options={"sync_every": H, **IDENTITY, "aggregate": rule},
            steps=7,
            optimizer="adamw",
            lr=0.01,
        )
    return s


@pytest.fixture(scope="module")
def two():
    return run_ranks(run_scenarios, 2, _scenarios(), timeout=200)


@pytest.mark.parametrize("rule", ["chosen", "all"])
def test_sparseloco_at_density_one_unquantized_without_feedback_is_diloco_with_outer_sgd(two, rule):
    for rank in range(2):
        for step, (a, b) in enumerate(
            zip(two[rank][f"sparseloco_identity_{rule}"]["params"], two[rank]["diloco_sgd"]["params"])
        ):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"rank {rank} step {step + 1}: {m}")


def test_every_worker_holds_the_same_model_after_each_outer_step(two):
    for key in ("sparseloco", "sparseloco_full"):
        for step in (H, 2 * H):
            assert torch.equal(two[0][key]["params"][step - 1], two[1][key]["params"][step - 1]), (key, step)
        assert not torch.equal(two[0][key]["params"][H], two[1][key]["params"][H])  # they drift between


def test_demo_workers_stay_identical_at_every_step(two):
    for a, b in zip(two[0]["demo_full"]["params"], two[1]["demo_full"]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("key", ["sparseloco", "demo"])
def test_a_resumed_run_continues_bit_for_bit(two, key):
    for rank in range(2):
        full, resumed = two[rank][f"{key}_full"], two[rank][f"{key}_resume"]
        for a, b in zip(full["params"], resumed["params"]):
            assert torch.equal(a, b)
        assert torch.equal(full["final"], resumed["final"])
    assert ("error" if key == "sparseloco" else "momentum") in two[0][f"{key}_resume"]["saved_keys"]


def test_the_ledger_books_a_sparse_payload_by_kind(two):
    comm = two[0]["sparseloco"]["comm"][-1]["pseudo_grads"]
    assert comm["calls"] == 2 and set(comm["parts"]) == {"indices", "values", "tables"}
    assert sum(comm["parts"].values()) == comm["bytes"]
    assert comm["sent"] == comm["bytes"]  # an all-gather at M = 2: one payload to the peer
    assert two[0]["demo_full"]["comm"][-1]["momentum"]["calls"] == 6


# ---- the error feedback's conservation, and the published rules written out --------------------------
def conservation(rank: int, world: int, density: float, bits: int) -> dict:
    """β = 1, Σ/M: what the anchor moved (over α) plus the mean error buffer left is the mean of all the
    pseudo-gradients the workers formed."""
    torch.manual_seed(0)
    model = tiny_model()
    sync = ws.strategy(
        "sparseloco",
        model,
        torch.optim.AdamW(model.parameters(), lr=0.01),
        sync_every=2,
        error_decay=1.0,
        aggregate="all",
        density=density,
        bits=bits,
        chunk=4,
        outer_lr=ALPHA,
    )
    start = sync.anchor.value.clone()
    formed = torch.zeros_like(start)
    real = sync.anchor.pseudo_gradient

    def recorded(*args):
        delta = real(*args)
        formed.add_(delta)
        return delta

    sync.anchor.pseudo_gradient = recorded
    for step in range(10):
        x, y = rank_batch(rank, step)
        nn.functional.mse_loss(sync.model(x), y).backward()
        sync.step()
        sync.zero_grad()
    moved = (start - sync.anchor.value) / ALPHA
    left, formed = sync.error.clone(), formed.clone()
    dist.all_reduce(left)
    dist.all_reduce(formed)
    return {"moved": moved, "left": left / world, "formed": formed / world}


@pytest.mark.parametrize("density,bits", [(0.25, 32), (0.1, 2), (1.0, 32)])
def test_what_was_sent_plus_what_is_left_is_every_pseudo_gradient(density, bits):
    for out in run_ranks(conservation, 2, density, bits, timeout=120):
        torch.testing.assert_close(out["moved"] + out["left"], out["formed"], rtol=0, atol=2e-6)
        if density == 1.0:
            assert not out["left"].any()


def reference_rule(rank: int, world: int, options: dict) -> dict:
    """3 outer rounds of `sparseloco` beside the published update written out (`sparse_reference`),
    from the same start on the same batches."""
    beta, alpha, chunk, k, bits, use_dct = (
        options["error_decay"],
        options["outer_lr"],
        options["chunk"],
        options["topk"],
        options["bits"],
        options["dct"],
    )
    torch.manual_seed(0)
    ours, theirs = tiny_model(), tiny_model()
    sync = ws.strategy("sparseloco", ours, torch.optim.AdamW(ours.parameters(), lr=0.02), sync_every=H, **options)
    opt = torch.optim.AdamW(theirs.parameters(), lr=0.02)
    anchor = [p.detach().clone() for p in theirs.parameters()]
    errors = [torch.zeros_like(p) for p in theirs.parameters()]
    diffs = []
    for step in range(3 * H):
        x, y = rank_batch(rank, step)
        nn.functional.mse_loss(sync.model(x), y).backward()
        sync.step()
        sync.zero_grad()
        nn.functional.mse_loss(theirs(x), y).backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % H == 0:  # the outer round, as published
            with torch.no_grad():
                for e, a, p in zip(errors, anchor, theirs.parameters()):
                    e.mul_(beta).add_(a - p)  # e ← β·e + Δ
                sent = ref.sparse_round(errors, errors, k, chunk, bits, use_dct)
                for a, s, p in zip(anchor, sent, theirs.parameters()):
                    a.sub_(alpha * s)  # θ̃ ← θ̃ − α·Δ̄
                    p.copy_(a)  # θ_r ← θ̃
            diffs.append(float((flat_params(ours) - flat_params(theirs)).abs().max()))
    return {"diffs": diffs, "error": float((sync.error - torch.cat([e.reshape(-1) for e in errors])).abs().max())}


@pytest.mark.parametrize(
    "options",
    [
        {"error_decay": 0.999, "outer_lr": 1.0, "chunk": 4, "topk": 3, "bits": 2, "dct": False},
        {"error_decay": 0.9, "outer_lr": 0.7, "chunk": 8, "topk": 5, "bits": 32, "dct": True},
        {"error_decay": 0.999, "outer_lr": 1.0, "chunk": 64, "topk": 32, "bits": 4, "dct": False},
    ],
    ids=["2bit", "dct", "defaults"],
)
def test_sparseloco_is_the_published_rule_written_out(options):
    tolerance = 1e-6 if options["dct"] else 0.0  # the DCT: the same matrices, multiplied in another order
    for out in run_ranks(reference_rule, 2, options, timeout=120):
        assert len(out["diffs"]) == 3 and max(out["diffs"]) <= tolerance, out
        assert out["error"] <= tolerance, out


def sign_descent(rank: int, world: int) -> dict:
    """`demo` with every DCT coefficient kept, beside sign descent on the mean gradient."""
    torch.manual_seed(0)
    model = tiny_model()
    lr = 0.01
    sync = ws.strategy("demo", model, torch.optim.SGD(model.parameters(), lr=lr), density=1.0)
    worst, residual, checked = 0.0, 0.0, 0
    for step in range(5):
        x, y = rank_batch(rank, step)
        nn.functional.mse_loss(sync.model(x), y).backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        dist.all_reduce(g)
        g /= world
        before = flat_params(model)
        sync.step()
        sync.zero_grad()
        clear = g.abs() > 1e-6 * g.abs().max()  # where the DCT round trip cannot flip a sign
        expected = before - lr * torch.sign(g)
        worst = max(worst, float((flat_params(model) - expected)[clear].abs().max()))
        residual = max(residual, float(sync.momentum.abs().max()))
        checked += int(clear.sum())
    return {"worst": worst, "residual": residual, "checked": checked}


def test_demo_keeping_every_coefficient_is_sign_descent_on_the_mean_gradient():
    for out in run_ranks(sign_descent, 2, timeout=120):
        assert out["residual"] == 0.0 and out["worst"] < 1e-7 and out["checked"] > 0, out


def carriers(rank: int, world: int) -> list[str]:
    model = tiny_model()
    errors = []
    for opt in (
        torch.optim.AdamW(model.parameters(), lr=0.01),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    ):
        try:
            ws.strategy("demo", model, opt)
        except ConfigError as e:
            errors.append(str(e))
    return errors


def test_demo_refuses_an_optimizer_whose_update_it_would_drop():
    errors = run_ranks(carriers, 1, timeout=60)[0]
    assert len(errors) == 2 and "not AdamW" in errors[0] and "SGD with momentum" in errors[1]


def sharded_mean(rank: int, world: int, ranks_per_worker: int) -> dict:
    """One sparse mean of each worker's own buffer (the same values whatever its ranks), DDP inside."""
    from wansync.comm.chunks import ChunkLayout
    from wansync.comm.exchange import Exchange
    from wansync.comm.replicas import replica_groups
    from wansync.comm.sparse import SparseCodec
    from wansync.planner.sizes import of_name

    replicas = replica_groups(ranks_per_worker)
    exchange = Exchange(replicas=replicas)
    codec = SparseCodec(ChunkLayout.of_shapes(of_name("micro").shapes))  # the defaults: 2-bit, k = 32 of 4096
    g = torch.Generator().manual_seed(replicas.worker)
    buf = torch.randn(codec.layout.numel, generator=g)
    residual = torch.randn(codec.layout.numel, generator=g) * 0.1
    exchange.mean(buf, "pseudo_grads", codec, inplace=True, residual=residual)
    bounds = codec.layout.bounds(ranks_per_worker)
    mine = slice(bounds[replicas.local_rank], bounds[replicas.local_rank + 1])
    return {
        "mean": buf,
        "residual": residual[mine],
        "mine": (mine.start, mine.stop),  # results come back sealed: plain data, no slice objects
        "worker": replicas.worker,
        "comm": exchange.ledger.snapshot(),
    }


def test_a_sparse_mean_sharded_over_a_workers_ranks_is_the_whole_workers_mean():
    one, two = run_ranks(sharded_mean, 2, 1, timeout=120), run_ranks(sharded_mean, 4, 2, timeout=120)
    for r in two:
        whole = one[r["worker"]]
        assert torch.equal(r["mean"], whole["mean"])  # every rank: the whole mean
        assert torch.equal(r["residual"], whole["residual"][slice(*r["mine"])])  # its own shard's residual
    for worker in range(2):
        parts = [r["comm"]["pseudo_grads"]["parts"] for r in two if r["worker"] == worker]
        assert {k: sum(p[k] for p in parts) for k in parts[0]} == one[worker]["comm"]["pseudo_grads"]["parts"]


def heal(rank: int, world: int) -> dict:
    """A peer's heal state carries θ̃ but not its error buffer; the healed worker's starts at zero."""
    torch.manual_seed(0)
    source, healed = tiny_model(), tiny_model()
    a = ws.strategy("sparseloco", source, torch.optim.AdamW(source.parameters(), lr=0.01), sync_every=1)
    for step in range(2):
        x, y = rank_batch(rank, step)
        nn.functional.mse_loss(a.model(x), y).backward()
        a.step()
        a.zero_grad()
    b = ws.strategy("sparseloco", healed, torch.optim.AdamW(healed.parameters(), lr=0.01), sync_every=1)
    b.error.fill_(1.0)
    state = a.heal_state()
    b.load_heal_state(state)
    return {
        "keys": sorted(state),
        "source_error": float(a.error.abs().sum()),
        "healed_error": float(b.error.abs().sum()),
        "anchor": torch.equal(a.anchor.value, b.anchor.value),
    }


def test_a_healed_worker_takes_its_peers_anchor_and_starts_with_a_zero_error_buffer():
    out = run_ranks(heal, 1, timeout=60)[0]
    assert "error" not in out["keys"] and "anchor" in out["keys"]
    assert out["source_error"] > 0 and out["healed_error"] == 0 and out["anchor"]


def bytes_per_round(rank: int, world: int) -> dict:
    """What a rank puts on the wire for one exchange of the micro LM's pseudo-gradients: SparseLoCo's
    sparse all-gather at its published density and 2 bits, DiLoCo's fp32 ring all-reduce."""
    from wansync.comm.exchange import Exchange
    from wansync.planner.sizes import of_name
    from wansync.strategies import make_options, strategy_class

    shapes = of_name("micro").shapes
    codec = strategy_class("sparseloco").wire_codec(make_options("sparseloco"), shapes)
    out = {}
    for name, c in (("sparse", codec), ("fp32", "fp32")):
        exchange = Exchange()
        buf = torch.randn(codec.layout.numel, generator=torch.Generator().manual_seed(rank))
        exchange.mean(buf, "pseudo_grads", c, inplace=True, residual=torch.zeros_like(buf) if c != "fp32" else None)
        out[name] = exchange.ledger.snapshot()["pseudo_grads"]["sent"]
    return out


def test_sparseloco_sends_under_a_fiftieth_of_fp32_diloco_per_rank_per_round_at_two_workers():
    for out in run_ranks(bytes_per_round, 2, timeout=60):
        assert out["sparse"] * 50 <= out["fp32"], out


def skipped_contribution(rank: int, world: int) -> dict:
    """`comm.sparse_mean` under --on-nonfinite skip: a worker whose buffer holds a NaN sends zeros
    flagged out; the mean is the others' alone, side band included (one extra scalar per rank)."""
    from wansync.comm.chunks import ChunkLayout
    from wansync.comm.exchange import Exchange
    from wansync.comm.sparse import SparseCodec

    codec = SparseCodec(ChunkLayout.of_shapes([(64, 64), (64,)]), bits=32, aggregate="all")
    n = codec.layout.numel
    buf = torch.cat([torch.randn(n, generator=torch.Generator().manual_seed(rank)), torch.tensor([float(rank + 1)])])
    mine = buf.clone()
    if rank == 1:
        buf[5] = float("nan")
    exchange = Exchange(nonfinite="skip")
    exchange.mean(buf, "pseudo_grads", codec, inplace=True, extra=1)
    alone = torch.empty(n)
    payload = torch.empty(codec.wire_bytes(), dtype=torch.uint8)
    codec.encode_into(mine[:n], payload)
    codec.aggregate_into([payload], alone, 1)
    return {
        "mean": buf,
        "alone": alone,
        "dropped": exchange.ledger.dropped,
        "guard": exchange.ledger.snapshot().get("nonfinite_guard", {}).get("bytes", 0),
    }


def test_sparse_mean_leaves_out_a_skipped_contribution_side_band_and_all():
    zero, one = run_ranks(skipped_contribution, 2, timeout=60)
    assert torch.equal(zero["mean"], one["mean"])  # every rank the same bits
    assert torch.equal(zero["mean"][:-1], zero["alone"])  # rank 0's payload alone
    assert float(zero["mean"][-1]) == 1.0  # its side band, not (1 + 2) / 2
    assert (zero["dropped"], one["dropped"]) == (0, 1) and zero["guard"] == 1
