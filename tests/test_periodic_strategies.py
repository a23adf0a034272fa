"""SlowMo, CPDP, DiLoCo and post-local SGD on real gloo groups (spec §2–5, §8).

One 2-rank group runs every scenario (module fixture) and one 4-rank group the identities at 4
ranks; the tests then read the recorded per-step parameters, optimizer states, ledgers and the
collectives actually issued (periodic_harness's wiretap and counting DDP comm hook).
"""

from __future__ import annotations

import pytest
import torch

from periodic_harness import run_scenarios, scalar_target
from wansync.runner.localgroup import run_ranks

pytestmark = pytest.mark.timeout(240)

K = 3
PERIODIC = {  # every periodic strategy, K = 3: boundaries at 3, 6 (post-local: DDP for steps 1-2, then 5, 8, ...)
    "local_sgd": {"sync_every": K},
    "slowmo": {"sync_every": K},
    "cpdp": {"sync_every": K},
    "diloco": {"sync_every": K},
    "post_local_sgd": {"sync_every": K, "switch_step": 2},
}
BOUNDARIES = {name: ([5] if name == "post_local_sgd" else [3, 6]) for name in PERIODIC}  # within 7 steps
LR_SCHEDULE = [0.1, 0.1, 0.05, 0.05, 0.2, 0.2]


def _scenarios() -> dict[str, dict]:
    s = {
        "ddp": dict(name="ddp", options={}, steps=9, hook=True),
        "cpdp_k1_b0": dict(name="cpdp", options={"sync_every": 1, "slowmo_beta": 0.0}, steps=6),
        "local_sgd": dict(name="local_sgd", options={"sync_every": K}, steps=9),
        "slowmo_b0": dict(name="slowmo", options={"sync_every": K, "slowmo_beta": 0.0, "slowmo_lr": 1.0}, steps=9),
        "diloco_sgd1": dict(name="diloco", options={"sync_every": K, "outer_lr": 1.0, "outer_momentum": 0.0}, steps=9),
        "post_local_0": dict(name="post_local_sgd", options={"sync_every": K, "switch_step": 0}, steps=9),
        "post_local_4": dict(name="post_local_sgd", options={"sync_every": K, "switch_step": 4}, steps=9),
        "slowmo_b5": dict(name="slowmo", options={"sync_every": K, "slowmo_beta": 0.5, "slowmo_lr": 0.8}, steps=9),
        "cpdp_nograd": dict(
            name="cpdp", options={"sync_every": K, "slowmo_beta": 0.5, "slowmo_lr": 0.8, "grad_phase": False}, steps=9
        ),
        "cpdp_hook": dict(name="cpdp", options={"sync_every": K}, steps=9, hook=True),
        "slowmo_scalar": dict(
            name="slowmo",
            options={"sync_every": 2, "slowmo_beta": 0.5, "slowmo_lr": 0.8},
            steps=6,
            kind="scalar",
            optimizer="sgd",
            lr_schedule=LR_SCHEDULE,
        ),
    }
    for name, opts in PERIODIC.items():
        for sos in (False, True):
            s[f"{name}_adamw_sos{int(sos)}"] = dict(
                name=name, options={**opts, "sync_optimizer_state": sos}, steps=7, optimizer="adamw", lr=0.01
            )
        s[f"{name}_full"] = dict(name=name, options=opts, steps=10, optimizer="sgd_momentum")
        s[f"{name}_resume"] = dict(name=name, options=opts, steps=10, optimizer="sgd_momentum", resume_at=4)
    return s


@pytest.fixture(scope="module")
def two():
    return run_ranks(run_scenarios, 2, _scenarios(), timeout=200)


@pytest.fixture(scope="module")
def four():
    return run_ranks(
        run_scenarios,
        4,
        {
            "ddp": dict(name="ddp", options={}, steps=4),
            "cpdp_k1_b0": dict(name="cpdp", options={"sync_every": 1, "slowmo_beta": 0.0}, steps=4),
            "local_sgd": dict(name="local_sgd", options={"sync_every": 2}, steps=6),
            "diloco_sgd1": dict(
                name="diloco", options={"sync_every": 2, "outer_lr": 1.0, "outer_momentum": 0.0}, steps=6
            ),
            "cpdp": dict(name="cpdp", options={"sync_every": 2}, steps=6),
            "diloco": dict(name="diloco", options={"sync_every": 2}, steps=6),
        },
        timeout=200,
    )


def close_all_steps(a, b, ranks, atol=1e-6):
    """a's steps (a may be the shorter run) equal b's to atol, on every rank."""
    for rank in range(ranks):
        assert len(a[rank]["params"]) <= len(b[rank]["params"])
        for step, (pa, pb) in enumerate(zip(a[rank]["params"], b[rank]["params"])):
            torch.testing.assert_close(pa, pb, rtol=0, atol=atol, msg=lambda m: f"rank {rank} step {step + 1}: {m}")


def pick(results, key):
    return [r[key] for r in results]


# ---- identities (spec §3, §4, §5, DESIGN "identities are the strongest tests") -----------------
def test_cpdp_k1_beta0_equals_ddp(two, four):
    close_all_steps(pick(two, "cpdp_k1_b0"), pick(two, "ddp"), 2)
    close_all_steps(pick(four, "cpdp_k1_b0"), pick(four, "ddp"), 4)


def test_diloco_outer_sgd_lr1_no_momentum_equals_local_sgd(two, four):
    close_all_steps(pick(two, "diloco_sgd1"), pick(two, "local_sgd"), 2)
    close_all_steps(pick(four, "diloco_sgd1"), pick(four, "local_sgd"), 4)


def test_slowmo_beta0_alpha1_equals_local_sgd(two):
    close_all_steps(pick(two, "slowmo_b0"), pick(two, "local_sgd"), 2)


def test_cpdp_without_gradient_phase_equals_slowmo(two):
    close_all_steps(pick(two, "cpdp_nograd"), pick(two, "slowmo_b5"), 2)
    assert not torch.allclose(two[0]["slowmo_b5"]["final"], two[0]["local_sgd"]["final"], atol=1e-4)  # β matters


def test_post_local_sgd_is_ddp_then_local_sgd(two):
    for rank in range(2):
        plsgd, ddp = two[rank]["post_local_4"]["params"], two[rank]["ddp"]["params"]
        for step in range(4):  # steps 1-4: DDP, bitwise
            assert torch.equal(plsgd[step], ddp[step]), f"step {step + 1}"
        assert not torch.equal(plsgd[5], ddp[5])
        for pa, pb in zip(two[rank]["post_local_0"]["params"], two[rank]["local_sgd"]["params"]):
            assert torch.equal(pa, pb)  # switch_step 0 is LocalSGD
    assert [(e["type"], e["step"]) for e in two[0]["post_local_4"]["events"]] == [("sync", 7), ("sync", 9)]
    r = two[0]["post_local_4"]
    assert r["comm"][3]["grads"]["calls"] == 4 and r["comm"][-1]["grads"]["calls"] == 4  # DDP steps only
    assert all(r["wire"][t - 1] == [] for t in (5, 6, 8, 9))  # local steps: nothing
    assert [b for _, b in r["wire"][6]] == [r["flat_bytes"] + 4]  # t = 7: the average, the drift's element riding on it


# ---- SlowMo by hand ---------------------------------------------------------------------------
def test_slowmo_matches_the_formula_with_a_changing_learning_rate(two):
    beta, alpha, k = 0.5, 0.8, 2
    anchor, u = 0.5, 0.0
    w = [0.5, 0.5]
    expected = []
    for step in range(6):
        eta = LR_SCHEDULE[step]
        w = [w[r] - eta * (w[r] - scalar_target(r, step)) for r in range(2)]  # ∇½(w − c)² = w − c
        if (step + 1) % k == 0:
            mean = (w[0] + w[1]) / 2
            u = beta * u + (anchor - mean) / eta  # η at the boundary
            anchor = anchor - alpha * eta * u
            w = [anchor, anchor]
        expected.append(list(w))
    assert len({LR_SCHEDULE[1], LR_SCHEDULE[3], LR_SCHEDULE[5]}) == 3  # η differs at each boundary
    for rank in range(2):
        got = [float(p[0]) for p in two[rank]["slowmo_scalar"]["params"]]
        assert got == pytest.approx([e[rank] for e in expected], abs=1e-12, rel=1e-12)
    assert [e["step"] for e in two[0]["slowmo_scalar"]["events"] if e["type"] == "sync"] == [2, 4, 6]


# ---- every periodic strategy: boundaries, drift, optimizer state, resume ------------------------
@pytest.mark.parametrize("name", list(PERIODIC))
def test_parameters_bitwise_identical_right_after_every_boundary(two, name):
    a, b = two[0][f"{name}_adamw_sos0"], two[1][f"{name}_adamw_sos0"]
    switch = PERIODIC[name].get("switch_step", 0)
    for step in range(7):
        t = step + 1
        same = torch.equal(a["params"][step], b["params"][step])
        assert same == (t in BOUNDARIES[name] or t <= switch), f"{name} step {t}: identical={same}"
    assert torch.equal(a["final"], b["final"])  # finish() reconciles


def test_parameters_bitwise_identical_at_boundaries_on_four_ranks(four):
    for key in ("cpdp", "diloco", "local_sgd"):
        for step in (1, 3, 5):  # t = 2, 4, 6
            ps = [four[r][key]["params"][step] for r in range(4)]
            assert all(torch.equal(ps[0], p) for p in ps[1:]), f"{key} step {step + 1}"
        assert not torch.equal(four[0][key]["params"][0], four[1][key]["params"][0])


@pytest.mark.parametrize("name", list(PERIODIC))
def test_drift_is_logged_at_every_boundary(two, name):
    events = two[0][f"{name}_adamw_sos0"]["events"]
    assert [(e["type"], e["step"]) for e in events] == [("sync", t) for t in BOUNDARIES[name] + [7]]  # finish()'s 7
    assert all(e["strategy"] == name for e in events)
    drifts = [e["drift"] for e in events]  # each boundary's own
    assert all(isinstance(d, float) and 0 < d < 1 for d in drifts)
    other = two[1][f"{name}_adamw_sos0"]["events"]
    assert drifts == [e["drift"] for e in other]  # the same on every worker


@pytest.mark.parametrize("name", list(PERIODIC))
def test_sync_optimizer_state_averages_the_inner_state_at_boundaries(two, name):
    for sos in (0, 1):
        a, b = two[0][f"{name}_adamw_sos{sos}"], two[1][f"{name}_adamw_sos{sos}"]
        for t in BOUNDARIES[name]:
            same = torch.equal(a["optim"][t - 1], b["optim"][t - 1])
            assert same == bool(sos), f"{name} sync_optimizer_state={bool(sos)} step {t}: identical={same}"
        assert not torch.equal(a["optim"][BOUNDARIES[name][0]], b["optim"][BOUNDARIES[name][0]])  # local again
        calls = a["comm"][-1].get("optim_state", {}).get("calls", 0)
        assert calls == (len(BOUNDARIES[name]) if sos else 0)


@pytest.mark.parametrize("name", list(PERIODIC))
def test_state_dict_round_trip_resumes_exactly(two, name):
    """Save after 4 steps (mid-period, outer momentum and inner momentum non-zero), build a fresh
    strategy on a differently initialized model, load, continue to 10: the same bits as a run
    that was never interrupted, at every step."""
    for rank in range(2):
        resumed, full = two[rank][f"{name}_resume"], two[rank][f"{name}_full"]
        assert resumed["state_t"] == full["state_t"] == 10
        for step, (pr, pf) in enumerate(zip(resumed["params"], full["params"], strict=True)):
            assert torch.equal(pr, pf), f"{name} rank {rank} step {step + 1}"
        assert torch.equal(resumed["final"], full["final"])
        assert [e["step"] for e in resumed["events"]] == [e["step"] for e in full["events"]]
    if name in ("slowmo", "cpdp", "diloco"):
        assert "anchor" in two[0][f"{name}_resume"]["saved_keys"]


# ---- CPDP's communication -----------------------------------------------------------------------
def test_cpdp_boundary_exchanges_gradients_once_and_parameters_once(two):
    r = two[0]["cpdp_hook"]
    grad_bytes, flat_bytes = r["grad_bytes"], r["flat_bytes"]
    prev_hook, prev = (0, 0), r["comm0"]
    assert set(prev) == {"init"}  # the initial broadcast only
    for step in range(9):
        t = step + 1
        wire, hook, comm = r["wire"][step], r["hook"][step], r["comm"][step]
        if t % K:
            assert wire == [], f"local step {t} issued {wire}"
            assert hook == prev_hook
            assert comm == prev
        else:
            # DDP's reducer: one all-reduce of every gradient (one bucket for this model)
            assert hook[0] - prev_hook[0] == 1 and hook[1] - prev_hook[1] == grad_bytes
            # what went on the wire this step: the gradients once, the parameters once (the drift rides on them)
            assert sorted(wire) == sorted([("all_reduce", grad_bytes), ("all_reduce", flat_bytes + 4)])
            assert comm["params"]["calls"] == t // K and comm["params"]["bytes"] == t // K * flat_bytes
            assert comm["grads"]["calls"] == t // K and comm["grads"]["bytes"] == t // K * grad_bytes
            assert comm["telemetry"]["calls"] == 0 and comm["telemetry"]["bytes"] == t // K * 4
        prev_hook, prev = hook, comm
    ddp = two[0]["ddp"]
    assert [h[0] for h in ddp["hook"]] == list(range(1, 10))  # DDP: one gradient all-reduce per step
    assert ddp["hook"][0][1] == grad_bytes
    event = r["events"][0]
    assert event["kind"] == "cpdp" and event["grad_phase"] is True and event["grad_bytes"] == grad_bytes
