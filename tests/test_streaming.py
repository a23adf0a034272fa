"""Streaming DiLoCo (arXiv:2501.18512) on real gloo groups: the DiLoCo identity, overlap, offsets, codecs,
several fragments in flight, finish() and bad input. The rank functions here are shared with
test_cocodc.py."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import wansync as ws
from wansync.comm.codecs import get_codec
from wansync.errors import ConfigError
from wansync.runner.localgroup import run_ranks
from wansync.strategies import STRATEGIES, make_options
from wansync.strategies.base import sync_tensors
from wansync.strategies.fragments import offsets
from wansync.strategies.outer import Anchor
from cli_harness import TINY, wansync
from strategy_harness import flat_params, rank_batch

pytestmark = pytest.mark.timeout(180)


def deep_model(seed: int = 0, hidden: int = 4) -> nn.Module:
    """Linear 6→16, `hidden` × Linear 16→16, Linear 16→3 (tanh between): `hidden` blocks plus two ends."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(6, 16), nn.Tanh()]
    for _ in range(hidden):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    layers.append(nn.Linear(16, 3))
    return nn.Sequential(*layers)


def train(
    rank: int,
    name: str,
    options: dict[str, Any],
    steps: int,
    *,
    seed: int = 0,
    lr: float = 0.05,
    finish: bool = True,
    record_exchanges: bool = False,
    checkpoint_at: int | None = None,
    tamper: Any = None,
    on_nonfinite: str | None = None,
) -> dict[str, Any]:
    """Train deep_model with `name` for `steps` steps on rank-dependent data; per-step parameters,
    events, ledger, final parameters (after finish()), optionally each exchange's launch/wait steps."""
    model = deep_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sync = ws.strategy(name, model, opt, on_nonfinite=on_nonfinite, **options)
    if tamper is not None:
        tamper(rank, sync)
    events: list[dict[str, Any]] = []
    sync.on_event(events.append)
    inner_steps = [0]
    opt.register_step_post_hook(lambda *_: inner_steps.__setitem__(0, inner_steps[0] + 1))
    exchanges: list[dict[str, int]] = []
    if record_exchanges:
        real = sync.exchange.mean

        class Recorded:
            def __init__(self, handle, rec):
                self.h, self.rec = handle, rec

            def __getattr__(self, name):
                return getattr(self.h, name)

            def wait(self):
                if "wait_step" not in self.rec:
                    self.rec.update(wait_step=sync.t, wait_inner=inner_steps[0])
                return self.h.wait()

        def recording(buf, purpose, codec="fp32", async_op=False, inplace=False, **kw):
            rec = {"launch_step": sync.t, "launch_inner": inner_steps[0], "async": async_op}
            exchanges.append(rec)
            return Recorded(real(buf, purpose, codec, async_op, inplace, **kw), rec)

        sync.exchange.mean = recording
    return _loop(rank, sync, model, opt, steps, seed, finish, checkpoint_at, events, exchanges)


def _loop(rank, sync, model, opt, steps, seed, finish, checkpoint_at, events, exchanges) -> dict[str, Any]:
    saved = None
    snapshots = []
    for step in range(steps):
        x, y = rank_batch(rank, step, seed)
        nn.functional.mse_loss(sync.model(x), y).backward()
        sync.step()
        sync.zero_grad()
        snapshots.append(flat_params(model))
        if checkpoint_at is not None and sync.t == checkpoint_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sync": sync.state_dict()}, buf)
            saved = buf.getvalue()
    if finish:
        sync.finish()
    return {
        "params": snapshots,
        "final": flat_params(model),
        "events": events,
        "comm": sync.comm.snapshot(),
        "exchanges": exchanges,
        "saved": saved,
        "dropped": sync.comm.dropped,
        "numels": [f.numel for f in getattr(sync, "fragments", [])],
    }


def resume(
    rank: int, name: str, options: dict[str, Any], saved: bytes, start: int, steps: int, seed: int = 0
) -> dict[str, Any]:
    """Rebuild from scratch (another init), load a checkpoint taken after `start` steps, continue."""
    model = deep_model(seed + 100)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = ws.strategy(name, model, opt, **options)
    state = torch.load(io.BytesIO(saved), weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sync.load_state_dict(state["sync"])
    snapshots = []
    for step in range(start, steps):
        x, y = rank_batch(rank, step, seed)
        nn.functional.mse_loss(sync.model(x), y).backward()
        sync.step()
        sync.zero_grad()
        snapshots.append(flat_params(model))
    sync.finish()
    return {"params": snapshots, "final": flat_params(model)}


def direct_diloco(rank: int, world: int, H: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """DiLoCo's rule written out with outer.Anchor: Δ̄ = mean(θ̃ − θ_m); θ̃ ← Nesterov(θ̃, Δ̄); θ_m ← θ̃."""
    model = deep_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    anchor = Anchor(sync_tensors(model), lr=0.7, momentum=0.9, nesterov=True)
    snapshots = []
    for step in range(steps):
        x, y = rank_batch(rank, step, seed)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % H == 0:
            delta = anchor.pseudo_gradient()
            dist.all_reduce(delta)
            anchor.outer_step(delta.div_(world))
            anchor.load_into_model()
        snapshots.append(flat_params(model))
    return snapshots


def one(rank: int, world: int, name: str, options: dict[str, Any], steps: int, kw: dict[str, Any]) -> Any:
    return train(rank, name, options, steps, **kw)


def several(rank: int, world: int, runs: list[tuple[str, dict[str, Any], int, dict[str, Any]]]) -> list[Any]:
    """Several trainings (name, options, steps, extra kwargs) in one group, one after the other."""
    out: list[Any] = []
    for name, options, steps, kw in runs:
        if name == "direct_diloco":
            out.append(direct_diloco(rank, world, options["sync_every"], steps))
        elif kw.get("resume"):  # continue from the previous run's checkpoint
            out.append(resume(rank, name, options, out[-1]["saved"], kw["start"], steps))
        else:
            out.append(train(rank, name, options, steps, **kw))
    return out


# ---- identities ----------------------------------------------------------------------------------
H_IDENTITY, STEPS_IDENTITY = 4, 14
IDENTITY = [
    ("streaming", dict(sync_every=H_IDENTITY, fragments=1, overlap=0, alpha=0.0), STEPS_IDENTITY, {}),
    ("direct_diloco", dict(sync_every=H_IDENTITY), STEPS_IDENTITY, {}),
]
if "diloco" in STRATEGIES:
    IDENTITY.append(("diloco", dict(sync_every=H_IDENTITY, outer_lr=0.7, outer_momentum=0.9), STEPS_IDENTITY, {}))


def test_one_fragment_no_overlap_alpha_zero_is_diloco(runs):
    has_diloco = "diloco" in STRATEGIES
    for rank, res in enumerate(runs["identity"]):
        streaming, direct = res[0], res[1]
        for t, (a, b) in enumerate(zip(streaming["params"], direct), start=1):
            assert torch.equal(a, b), f"rank {rank} step {t}"  # same bits
        assert [e["step"] for e in streaming["events"] if e["kind"] == "fragment"] == [4, 8, 12]
        assert [e["kind"] for e in streaming["events"]][-1] == "final"  # 14 % 4 != 0
        if has_diloco:
            for a, b in zip(streaming["params"], res[2]["params"]):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
            torch.testing.assert_close(streaming["final"], res[2]["final"], rtol=0, atol=1e-6)
    assert has_diloco, "the registry's diloco is not registered yet (direct comparison passed)"


# ---- overlap, offsets, several in flight, finish, checkpoints, codecs (one group for all, the identity too)
CODECS = ("fp32", "bf16", "int8", "fp4")


def nan_on_rank1(rank: int, sync: Any) -> None:
    """Rank 1's first pseudo-gradient of fragment 0 turns NaN (run it with on_nonfinite="skip")."""
    if rank == 1:
        anchor, calls = sync.anchors[0], [0]
        real = anchor.pseudo_gradient

        def pseudo_gradient(local=None):
            calls[0] += 1
            x = real(local)
            if calls[0] == 1:
                x[0] = float("nan")
            return x

        anchor.pseudo_gradient = pseudo_gradient


CKPT = dict(sync_every=6, fragments=2, overlap=2, alpha=0.5, codec="int8")


@pytest.fixture(scope="module")
def runs():
    plan = [
        (
            "streaming",
            dict(sync_every=8, fragments=2, overlap=3, alpha=0.5),
            20,
            dict(finish=False, record_exchanges=True),
        ),
        ("streaming", dict(sync_every=8, fragments=4, overlap=5), 19, {}),
        ("streaming", CKPT, 14, dict(checkpoint_at=7)),  # fragment 1 in flight: started 6, merges 8
        ("streaming", CKPT, 14, dict(resume=True, start=7)),
    ]
    plan += [("streaming", dict(sync_every=4, fragments=2, overlap=1, codec=c), 9, {"finish": False}) for c in CODECS]
    plan.append(
        (
            "streaming",
            dict(sync_every=4, fragments=2, overlap=1, alpha=0.0),
            3,
            dict(tamper=nan_on_rank1, on_nonfinite="skip"),
        )
    )
    both = run_ranks(several, 2, IDENTITY + plan)
    identity, results = [r[: len(IDENTITY)] for r in both], [r[len(IDENTITY) :] for r in both]
    return {
        "identity": identity,
        "nonfinite": [r[-1] for r in results],
        "overlap": [r[0] for r in results],
        "in_flight": [r[1] for r in results],
        "checkpointed": [r[2] for r in results],
        "resumed": [r[3] for r in results],
        "codecs": results[0][4:-1],
    }


def test_overlap_runs_tau_inner_steps_before_the_wait_and_offsets_are_staggered(runs):
    H, P, tau = 8, 2, 3
    a, b = runs["overlap"]
    ex = a["exchanges"]
    assert ex and all(e["async"] for e in ex)
    assert [e["launch_step"] for e in ex if "wait_step" not in e] == [20]  # still in flight at the end
    for e in (e for e in ex if "wait_step" in e):
        assert e["wait_step"] - e["launch_step"] == tau
        assert e["wait_inner"] - e["launch_inner"] == tau  # τ real optimizer steps before the wait
    o = offsets(H, P)  # [4, 0]
    fr = [e for e in a["events"] if e["type"] == "sync"]
    assert [(e["fragment"], e["started"], e["step"]) for e in fr] == [(0, 4, 7), (1, 8, 11), (0, 12, 15), (1, 16, 19)]
    assert all((e["started"] - o[e["fragment"]]) % H == 0 for e in fr)
    assert [e["fragment"] for e in fr] == [e["fragment"] for e in b["events"] if e["type"] == "sync"]
    assert not torch.equal(a["params"][-1], b["params"][-1])  # α = 0.5 keeps replicas apart


def test_several_fragments_in_flight_and_finish_makes_ranks_identical(runs):
    a, b = runs["in_flight"]  # H 8, P 4, τ 5 ≥ H/P: up to 3 in flight
    merges = [(e["fragment"], e["started"], e["step"], e["overlap"]) for e in a["events"] if e["kind"] == "fragment"]
    assert merges == [
        (0, 2, 7, 5),
        (1, 4, 9, 5),
        (2, 6, 11, 5),
        (3, 8, 13, 5),
        (0, 10, 15, 5),
        (1, 12, 17, 5),
        (2, 14, 19, 5),
        (3, 16, 19, 3),
        (0, 18, 19, 1),
    ]  # in flight at the end: merged early by finish()
    finals = [e for e in a["events"] if e["kind"] == "final"]
    assert sorted(e["fragment"] for e in finals) == [0, 1, 2, 3]
    assert torch.equal(a["final"], b["final"])
    assert not torch.equal(a["params"][-1], b["params"][-1])


def test_checkpoint_with_an_exchange_in_flight_resumes_bit_exactly(runs):
    for full, again in zip(runs["checkpointed"], runs["resumed"]):
        state = torch.load(io.BytesIO(full["saved"]), weights_only=False)["sync"]
        assert [(x["fragment"], x["start"], x["merge_at"]) for x in state["in_flight"]] == [(1, 6, 8)]
        assert len(again["params"]) == 7
        for a, b in zip(full["params"][7:], again["params"]):
            assert torch.equal(a, b)
        assert torch.equal(full["final"], again["final"])


def test_codec_bytes_are_the_payload_times_the_codec_ratio_plus_scales(runs):
    res = runs["codecs"]
    numels = res[0]["numels"]
    per_period = {
        "fp32": [4 * n for n in numels],
        "bf16": [2 * n for n in numels],
        "int8": [n + 4 * math.ceil(n / 1024) for n in numels],
        "fp4": [math.ceil(n / 2) + 4 * math.ceil(n / 1024) for n in numels],
    }
    for r, codec in zip(res, CODECS):
        syncs = [e for e in r["events"] if e["type"] == "sync"]
        assert [e["fragment"] for e in syncs] == [0, 1, 0, 1] and {e["codec"] for e in syncs} == {codec}
        assert [e["bytes"] for e in syncs] == per_period[codec] * 2
        assert all(e["bytes"] == get_codec(codec).wire_bytes(numels[e["fragment"]]) for e in syncs)
        assert all(e["payload_bytes"] == 4 * numels[e["fragment"]] for e in syncs)
        assert r["comm"]["pseudo_grads"]["bytes"] == 2 * sum(per_period[codec])
        assert r["comm"]["pseudo_grads"]["calls"] == 4
    assert res[3]["comm"]["pseudo_grads"]["bytes"] < res[0]["comm"]["pseudo_grads"]["bytes"] / 7


def test_a_non_finite_pseudo_gradient_is_left_out_under_skip(runs):
    a, b = runs["nonfinite"]
    assert (a["dropped"], b["dropped"]) == (0, 1)
    assert a["comm"]["nonfinite_guard"]["calls"] == 2  # the sync at 2, the final one of fragment 1
    n0 = a["numels"][0]
    at_merge = [r["params"][2] for r in (a, b)]  # step 3: fragment 0 merged, α = 0
    assert torch.isfinite(at_merge[1]).all()
    first = [i for i in range(len(at_merge[0])) if i < 6 * 16 + 16]  # the first Linear is in fragment 0
    assert torch.equal(at_merge[0][first], at_merge[1][first]) and n0 > len(first)
    assert torch.equal(a["final"], b["final"])


def fragments_in_flat_buffers(rank: int, world: int, name: str) -> list[bool]:
    model = deep_model(3)
    params, before = list(model.parameters()), [p.detach().clone() for p in model.parameters()]
    sync = ws.strategy(name, model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=8, fragments=2, overlap=1)
    packed = [a.flat.packed() for a in sync.anchors]
    return [
        all(a is b for a, b in zip(model.parameters(), params, strict=True)),
        all(torch.equal(p, v) for p, v in zip(model.parameters(), before)),
        all(f is not None and torch.equal(f, a.value) for f, a in zip(packed, sync.anchors)),
    ]


@pytest.mark.parametrize("name", ["streaming", "cocodc"])
def test_each_fragments_tensors_move_into_one_flat_buffer_keeping_values_and_identity(name):
    """So that a fragment's Δ, its merge and θ̃ into the model are one op each: the parameters the
    optimizer holds are the same objects, with the same values, now views of one buffer per fragment."""
    same_objects, same_values, packed = run_ranks(fragments_in_flat_buffers, 1, name)[0]
    assert same_objects and same_values and packed


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["streaming", "cocodc"])
@pytest.mark.parametrize(
    "options, message",
    [
        (dict(sync_every=10, overlap=10), "overlap (tau) must be in [0, sync_every) = [0, 10), got 10"),
        (dict(sync_every=10, overlap=-1), "overlap (tau) must be in [0, sync_every) = [0, 10), got -1"),
        (dict(codec="fp8"), "unknown codec 'fp8'; valid codecs: bf16, fp32, fp4, int8"),
        (dict(fragments=0), "fragments must be >= 1, got 0"),
        (dict(alpha=1.5), "alpha must be in [0, 1], got 1.5"),
        (dict(partition="zigzag"), "partition must be strided or sequential, got 'zigzag'"),
        (
            dict(sync_every=10, fragments=4, syncs_per_period=3),
            "syncs_per_period must be 0 (automatic) or between fragments (4) and sync_every (10), got 3",
        ),
    ],
)
def test_bad_options_are_one_line_config_errors(name, options, message):
    with pytest.raises(ConfigError) as e:
        make_options(name, **options)
    assert str(e.value) == message


def test_cli_more_fragments_than_blocks_exits_nonzero_with_one_line(tmp_path):
    r = wansync(
        "train",
        "--strategy",
        "streaming",
        "--fragments",
        "99",
        "--sync-every",
        "100",
        "--workers",
        "2",
        "--steps",
        "4",
        "--out",
        str(tmp_path / "run"),
        *TINY,
        timeout=150,
    )
    assert r.returncode != 0
    assert "fragments must be between 1 and the model's 4 blocks (stages), got 99" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
