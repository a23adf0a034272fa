"""CoCoDC (spec §7): delay compensation (§7a), adaptive transmission (§7b), the matched-frequency
ablation identity, agreement between ranks, and resuming."""

from __future__ import annotations

import io
import os
from typing import Any

import pytest
import torch

from wansync.errors import ConfigError, PeerError
from wansync.runner.localgroup import run_ranks
from wansync.strategies import make_options
from wansync.strategies.compensation import alpha_merge, damped_compensate, delay_compensate
from wansync.strategies.fragments import slot_index
from wansync.strategies.transmission import syncs_per_period
from test_streaming import resume, train

pytestmark = pytest.mark.timeout(180)


# ---- §7a: delay compensation ------------------------------------------------------------------
def constant_velocity(n: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    theta0, c, anchor = (torch.randn(n, generator=g) for _ in range(3))
    return theta0, c, anchor


@pytest.mark.parametrize("tau, t_p", [(5, 100), (1, 7), (3, 0)])
def test_constant_velocity_gives_anchor_plus_tau_c_when_lambda_is_zero(tau, t_p):
    theta0, c, anchor = constant_velocity()
    theta = lambda t: theta0 + c * t  # noqa: E731
    new, rel = delay_compensate(theta(t_p), theta(t_p + tau), anchor, tau, 100, lam=0.0)
    torch.testing.assert_close(new, anchor + tau * c, rtol=1e-5, atol=1e-5)
    assert rel == 0.0


def test_the_printed_sign_of_eq_4_fails_the_constant_velocity_check():
    theta0, c, anchor = constant_velocity()
    tau, t_p = 5, 100
    theta_p, theta_l = theta0 + c * t_p, theta0 + c * (t_p + tau)
    printed, _ = delay_compensate(theta_p, theta_l, anchor, tau, 100, lam=0.0, printed_sign=True)
    assert not torch.allclose(printed, anchor + tau * c, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(printed, anchor - tau * c, rtol=1e-5, atol=1e-5)  # it walks backwards


def test_lambda_term_is_g_squared_times_drift_and_its_relative_size_is_reported():
    theta0, c, anchor = constant_velocity()
    tau, H, lam = 4, 20, 0.5
    theta_p, theta_l = theta0, theta0 + c * tau
    new, rel = delay_compensate(theta_p, theta_l, anchor, tau, H, lam)
    g = (theta_l - theta_p) / tau
    term = lam * g * g * (theta_p - anchor) / H
    torch.testing.assert_close(new, anchor + tau * (g + term))
    assert rel == pytest.approx(float(term.norm() / g.norm()), rel=1e-5)
    same, _ = delay_compensate(theta_p, theta_p, anchor, 0, H, lam)  # τ = 0: the anchor
    assert torch.equal(same, anchor)


def test_alpha_merge():
    local, anchor = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])
    assert torch.equal(alpha_merge(local, anchor, 0.0), anchor)
    assert torch.equal(alpha_merge(local, anchor, 1.0), local)
    torch.testing.assert_close(alpha_merge(local, anchor, 0.25), torch.tensor([2.5, 5.0]))


# ---- §7b: the transmission count --------------------------------------------------------------
def test_syncs_per_period_formula_of_the_paper():  # per_fragment=0: no c·P cap
    assert syncs_per_period(0.4, 100, 4, t_c=1.0, t_s=5.0, per_fragment=0) == 8  # the paper's N = 8
    assert syncs_per_period(0.4, 100, 4, t_c=1.0, t_s=50.0, per_fragment=0) == 4  # never below P
    assert syncs_per_period(0.4, 100, 4, t_c=1.0, t_s=1e-4, per_fragment=0) == 100  # one start per step
    assert syncs_per_period(0.4, 100, 4, t_c=1.0, t_s=0.0, per_fragment=0) == 100


def test_syncs_per_period_is_capped_at_c_fragments_and_keeps_the_papers_n():
    assert syncs_per_period(0.4, 100, 4, t_c=1.0, t_s=5.0, per_fragment=2) == 8  # the paper's N = 8
    assert syncs_per_period(0.4, 100, 4, t_c=1.0, t_s=1e-4, per_fragment=2) == 8  # a fast link: 2P
    assert syncs_per_period(0.4, 100, 4, t_c=1.0, t_s=0.0, per_fragment=2) == 8
    assert syncs_per_period(0.4, 100, 4, t_c=1.0, t_s=50.0, per_fragment=2) == 4  # never below P
    assert syncs_per_period(0.4, 20, 2, t_c=0.88, t_s=0.017, per_fragment=2) == 4  # the run: not 20
    assert syncs_per_period(0.4, 6, 4, t_c=1.0, t_s=1e-4, per_fragment=2) == 6  # and never above H


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(gamma=0.0), "gamma must be > 0, got 0.0"),
        (dict(gamma=-1.0), "gamma must be > 0, got -1.0"),
        (dict(lam=float("nan")), "lam must be >= 0, got nan"),
        (dict(schedule="random"), "schedule must be one of adaptive, adaptive_fair, round_robin, got 'random'"),
        (dict(max_syncs_per_fragment=-1), "max_syncs_per_fragment must be >= 0, got -1"),
        (dict(outer_scaling="sqrt"), "outer_scaling must be none or interval, got 'sqrt'"),
        (dict(compensation="none"), "compensation must be one of taylor, alpha, damped, got 'none'"),
    ],
)
def test_bad_cocodc_options(options, message):
    with pytest.raises(ConfigError) as e:
        make_options("cocodc", **options)
    assert str(e.value) == message


# ---- multi-process ----------------------------------------------------------------------------
H, P, STEPS = 8, 2, 20
ADAPTIVE = dict(sync_every=H, fragments=P, overlap=1, lam=0.5, syncs_per_period=4)


def disagree(rank: int, sync: Any) -> None:
    if rank == 1:
        sync.timetable.schedule.choose = lambda t, in_flight=frozenset(): (1, "rate")


def cocodc_plan(rank: int, world: int, debug: bool) -> dict[str, Any]:
    os.environ["WANSYNC_DEBUG"] = "1" if debug else "0"
    out: dict[str, Any] = {}
    base = dict(sync_every=H, fragments=P, overlap=1, syncs_per_period=4)
    out["ablation"] = train(rank, "cocodc", dict(base, compensation="alpha", schedule="round_robin"), STEPS)
    out["streaming"] = train(rank, "streaming", base, STEPS)
    out["adaptive"] = train(rank, "cocodc", ADAPTIVE, STEPS, checkpoint_at=12)
    out["resumed"] = resume(rank, "cocodc", ADAPTIVE, out["adaptive"]["saved"], 12, STEPS)
    out["measured"] = train(rank, "cocodc", dict(sync_every=H, fragments=P, overlap=1), STEPS)
    try:
        train(rank, "cocodc", ADAPTIVE, 6, tamper=disagree)
        out["mismatch"] = None
    except PeerError as e:
        out["mismatch"] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(cocodc_plan, 2, True)


def test_round_robin_alpha_cocodc_equals_streaming_with_the_same_syncs_per_period(ranks):
    for r in ranks:
        a, s = r["ablation"], r["streaming"]
        for t, (x, y) in enumerate(zip(a["params"], s["params"]), start=1):
            assert torch.equal(x, y), f"step {t}"
        assert torch.equal(a["final"], s["final"])
        keys = ("fragment", "started", "step", "bytes", "syncs_per_period")
        assert [{k: e[k] for k in keys} for e in a["events"]] == [{k: e[k] for k in keys} for e in s["events"]]
        assert len([e for e in a["events"] if e.get("kind") == "fragment"]) == 10  # 4 per 8 steps, 20 steps
    assert not torch.equal(ranks[0]["ablation"]["params"][-1], ranks[1]["ablation"]["params"][-1])


def test_all_ranks_choose_the_same_fragments_with_different_data(ranks):
    a, b = (r["adaptive"] for r in ranks)
    picks = [
        [(e["fragment"], e["started"], e["reason"]) for e in r["events"] if e.get("kind") == "fragment"] for r in (a, b)
    ]
    assert picks[0] == picks[1] and len(picks[0]) >= 7
    assert {reason for _, _, reason in picks[0]} <= {"rate", "stale"}
    assert sorted({p for p, _, _ in picks[0][:2]}) == [0, 1]  # first slots: every fragment once
    assert a["comm"]["debug"]["calls"] == 10  # one check per slot (debug mode)
    assert not torch.equal(a["params"][-1], b["params"][-1])  # the data really differ
    assert torch.equal(a["final"], b["final"])
    rels = [e["lam_term_rel"] for e in a["events"] if e.get("kind") == "fragment"]
    assert all(r >= 0 for r in rels) and any(r > 0 for r in rels)
    assert all(e["merge"] == "damped" for e in a["events"] if e.get("kind") == "fragment")


def test_a_rank_that_chooses_another_fragment_is_caught_in_debug_mode(ranks):
    for r in ranks:
        assert r["mismatch"] == "ranks chose different fragments at step 2: [0, 1] (rank order)"


def test_resume_with_an_exchange_in_flight_is_bit_exact(ranks):
    for r in ranks:
        full, again = r["adaptive"], r["resumed"]
        state = torch.load(io.BytesIO(full["saved"]), weights_only=False)["sync"]
        assert [(x["fragment"], x["start"], x["merge_at"]) for x in state["in_flight"]][0][1:] == (12, 13)
        assert state["in_flight"][0]["theta_start"] is not None and len(again["params"]) == STEPS - 12
        for x, y in zip(full["params"][12:], again["params"]):
            assert torch.equal(x, y)
        assert torch.equal(full["final"], again["final"])


def test_n_from_gamma_is_agreed_once_and_then_followed(ranks):
    scheds = [[e for e in r["measured"]["events"] if e["type"] == "schedule"] for r in ranks]
    assert [len(s) for s in scheds] == [1, 1]
    (a,), (b,) = scheds
    assert a["step"] == H and a["syncs_per_period"] == b["syncs_per_period"]
    assert (a["t_c"], a["t_s"]) == (b["t_c"], b["t_s"]) and a["t_s_source"] == "measured"
    n = a["syncs_per_period"]
    assert P <= n <= H
    starts = sorted({e["started"] for e in ranks[0]["measured"]["events"] if e.get("kind") == "fragment"})
    assert [t for t in starts if t <= H] == [4, 8]  # N = P in the first period
    expected = [t for t in range(H + 1, STEPS + 1) if slot_index(t, H, n) is not None]
    later = [t for t in starts if t > H]
    assert set(later) <= set(expected) and len(later) >= len(expected) - 2  # the last may still be in flight


def test_the_damped_merge_keeps_the_local_steps_and_damps_only_the_outer_step():
    theta_p, anchor, tau = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0]), 4
    theta_l = theta_p + torch.tensor([0.4, -0.8])  # τ local steps of velocity (0.1, -0.2)
    undamped, _ = damped_compensate(theta_p, theta_l, anchor, tau, 100, 0.0, alpha=0.0)
    assert torch.equal(undamped, delay_compensate(theta_p, theta_l, anchor, tau, 100, 0.0)[0])
    damped, _ = damped_compensate(theta_p, theta_l, anchor, tau, 100, 0.0, alpha=0.5)
    torch.testing.assert_close(damped, 0.5 * theta_p + 0.5 * anchor + (theta_l - theta_p))
    kept, _ = damped_compensate(theta_p, theta_l, anchor, tau, 100, 0.0, alpha=1.0)
    torch.testing.assert_close(kept, theta_l)


def _agree_with_a_late_peer(rank: int, world: int) -> dict[str, Any]:
    import time

    from wansync.comm.exchange import Exchange
    from wansync.strategies.transmission import agree

    exchange = Exchange()
    if rank == 1:
        time.sleep(0.3)  # rank 0 waits for it inside the agreement
    n, _, _ = agree(0.1, 0.05, 0.4, 10, 2, 2, exchange)
    return {"n": n, "schedule": exchange.ledger.snapshot()["schedule"]}


def test_the_agreement_on_n_is_booked_as_a_wait_so_the_profiler_counts_it_as_exposed_communication():
    """The mean that agrees on N blocks the training thread: the ledger's wait (the profiler's
    `exposed_comm`), not sync math. One float64 pair, nothing else: every rank computes the same
    N from the same mean."""
    r0, r1 = run_ranks(_agree_with_a_late_peer, 2)
    assert r0["n"] == r1["n"] == 4  # ⌊0.4·10·0.1/0.05⌋ = 8, capped at 2·P
    assert r0["schedule"]["bytes"] == 16 and r0["schedule"]["waited_s"] >= 0.2
