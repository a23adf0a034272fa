"""Every strategy's timetable, built from its options alone: the rules it states (DDP's phase, the
boundaries, the fragment work of a step and of `finish()`, the merges that land on the anchor,
CoCoDC's one decision on N), and that a strategy on a real 2-rank group exchanges exactly where the
timetable the planner builds from the same options says."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import wansync as ws
from wansync.strategies import STRATEGIES, strategy_class, timetable
from wansync.strategies.compensation import alpha_merge, damped_compensate, delay_compensate, lands_on_anchor
from wansync.strategies.inflight import InFlight

from strategy_harness import deep_model as model

pytestmark = pytest.mark.timeout(300)

STEPS = 13


def steps_where(predicate) -> list[int]:
    return [t for t in range(1, STEPS + 1) if predicate(t)]


# ---- the periodic family --------------------------------------------------------------------------
def test_ddp_all_reduces_gradients_over_every_rank_at_every_step_and_never_averages():
    tt = timetable("ddp", {})
    assert steps_where(tt.ddp_step) == steps_where(tt.exchanges_at) == list(range(1, STEPS + 1))
    assert steps_where(tt.is_boundary) == steps_where(tt.inside_step) == [] and not tt.final_sync(STEPS)


def test_a_periodic_strategy_averages_every_h_steps_and_once_more_at_the_end_off_a_boundary():
    tt = timetable("diloco", {"sync_every": 4})
    assert steps_where(tt.is_boundary) == steps_where(tt.exchanges_at) == [4, 8, 12]
    assert steps_where(tt.ddp_step) == [] and tt.final_sync(13) and not tt.final_sync(12)


def test_post_local_sgd_is_ddp_up_to_the_switch_then_boundaries_counted_from_it():
    tt = timetable("post_local_sgd", {"switch_step": 5, "sync_every": 3})
    assert steps_where(tt.ddp_step) == [1, 2, 3, 4, 5]
    assert steps_where(tt.is_boundary) == [8, 11]
    assert steps_where(tt.inside_step) == list(range(6, STEPS + 1))
    assert not tt.final_sync(4) and tt.final_sync(13) and not tt.final_sync(11)  # replicas equal in the DDP phase


@pytest.mark.parametrize("grad_phase, phase_one", [(True, [3, 6, 9, 12]), (False, [])])
def test_cpdp_starts_each_boundary_with_the_gradient_all_reduce_unless_ablated(grad_phase, phase_one):
    tt = timetable("cpdp", {"sync_every": 3, "grad_phase": grad_phase})
    assert steps_where(tt.is_boundary) == [3, 6, 9, 12] and steps_where(tt.ddp_step) == phase_one


# ---- the fragment strategies -----------------------------------------------------------------------
class Recorder:
    """A `FragmentWork` that writes down what it is told, in order."""

    def __init__(self, n: int = 4) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.halfways: list[tuple[int, int]] = []  # (step, fragment): kept apart from the order tested
        self.n = n

    def slot(self, t: int, choice: tuple[int, str] | None) -> None:
        self.log.append((t, "slot", None if choice is None else choice[0]))

    def start(self, sync: InFlight) -> None:
        self.log.append((sync.start, "start", sync.fragment, sync.merge_at))

    def halfway(self, sync: InFlight, t: int) -> None:
        self.halfways.append((t, sync.fragment))

    def merge(self, sync: InFlight, t: int, exact: bool) -> None:
        self.log.append((t, "merge", sync.fragment, exact))

    def final_sync(self, fragment: int, t: int) -> None:
        self.log.append((t, "final", fragment))

    def decide_n(self, t: int) -> int:
        self.log.append((t, "decide_n"))
        return self.n


def run(tt: Any, steps: int, finish: bool = True) -> list[tuple[Any, ...]]:
    work = Recorder()
    for t in range(1, steps + 1):
        tt.step(t, work)
    if finish:
        tt.finish(steps, work)
    return work.log


def test_streaming_merges_tau_steps_after_each_start_and_finish_merges_early_then_syncs_every_fragment():
    tt = timetable("streaming", {"sync_every": 8, "fragments": 2, "overlap": 2})
    assert run(tt, 13) == [
        (4, "slot", 0),
        (4, "start", 0, 6),
        (6, "merge", 0, False),
        (8, "slot", 1),
        (8, "start", 1, 10),
        (10, "merge", 1, False),
        (12, "slot", 0),
        (12, "start", 0, 14),
        (13, "merge", 0, False),
        (13, "final", 0),
        (13, "final", 1),
    ]  # early, with 1 step elapsed


def test_within_a_step_merges_due_come_first_then_the_slot_then_a_tau_zero_merge():
    tt = timetable("streaming", {"sync_every": 4, "fragments": 2, "overlap": 3, "syncs_per_period": 4})
    assert run(tt, 6, finish=False) == [
        (1, "slot", 0),
        (1, "start", 0, 4),
        (2, "slot", 1),
        (2, "start", 1, 5),
        (3, "slot", None),  # round robin's fragment in flight
        (4, "merge", 0, False),
        (4, "slot", 0),
        (4, "start", 0, 7),
        (5, "merge", 1, False),
        (5, "slot", 1),
        (5, "start", 1, 8),
        (6, "slot", None),
    ]
    tt = timetable("streaming", {"sync_every": 4, "fragments": 2, "overlap": 0, "alpha": 0.0})
    assert run(tt, 4) == [
        (2, "slot", 0),
        (2, "start", 0, 2),
        (2, "merge", 0, True),
        (4, "slot", 1),
        (4, "start", 1, 4),
        (4, "merge", 1, True),
        (4, "final", 0),
    ]  # fragment 1 landed on its anchor at this step: no final sync


def test_cocodc_decides_n_once_at_the_first_step_at_or_after_h_after_that_steps_slot():
    tt = timetable("cocodc", {"sync_every": 8, "fragments": 2, "overlap": 1, "schedule": "round_robin"})
    log = run(tt, 12, finish=False)
    assert [e for e in log if e[1] == "decide_n"] == [(8, "decide_n")]
    assert log.index((8, "decide_n")) == log.index((8, "start", 1, 9)) + 1
    assert tt.schedule.n == 4 and tt.n_decided
    assert [e[0] for e in log if e[1] == "start"] == [4, 8, 10, 12]  # N = 4 slots per period from then on
    fixed = timetable("cocodc", {"sync_every": 8, "fragments": 2, "syncs_per_period": 2})
    assert fixed.n_decided and not any(e[1] == "decide_n" for e in run(fixed, 12, finish=False))


def test_cocodc_exchanges_at_its_slots_and_where_it_decides_n():
    tt = timetable("cocodc", {"sync_every": 8, "fragments": 2, "overlap": 1, "syncs_per_period": 0})
    assert steps_where(tt.exchanges_at) == [4, 8, 9, 10, 11, 12, 13]  # undecided: every step from H asks
    run(tt, 8, finish=False)
    assert steps_where(tt.exchanges_at) == [2, 4, 6, 8, 10, 12]


@pytest.mark.parametrize("merge", ["alpha", "taylor", "damped"])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("elapsed", [0, 3])
def test_a_merge_lands_exactly_on_the_anchor_when_the_rule_says_so(merge, alpha, elapsed):
    """The rule the timetable decides by (`lands_on_anchor`) is the merges' own arithmetic."""
    g = torch.Generator().manual_seed(1)
    start, anchor = torch.randn(100, generator=g), torch.randn(100, generator=g)
    now = start + 0.01 * elapsed * torch.randn(100, generator=g)
    if merge == "alpha":
        new = alpha_merge(now.clone(), anchor, alpha)
    elif merge == "taylor":
        new, _ = delay_compensate(start, now, anchor, elapsed, 8, 0.5)
    else:
        new, _ = damped_compensate(start, now, anchor, elapsed, 8, 0.5, alpha)
    assert torch.equal(new, anchor) == lands_on_anchor(merge, alpha, elapsed)


# ---- the strategies follow their timetable ----------------------------------------------------------
CASES: list[tuple[str, dict[str, Any]]] = [
    ("ddp", {}),
    ("local_sgd", {"sync_every": 3}),
    ("slowmo", {"sync_every": 4}),
    ("cpdp", {"sync_every": 3}),
    ("post_local_sgd", {"switch_step": 4, "sync_every": 3}),
    ("diloco", {"sync_every": 5}),
    ("streaming", {"sync_every": 6, "fragments": 3, "overlap": 2}),
    (
        "cocodc",
        {
            "sync_every": 6,
            "fragments": 2,
            "overlap": 0,
            "syncs_per_period": 4,
            "compensation": "taylor",
            "schedule": "round_robin",
        },
    ),
    ("sparseloco", {"sync_every": 4}),
    ("demo", {}),
    ("async_diloco", {"sync_every": 5}),
]


def _purposes(sync: Any, before: Counter) -> tuple[set[str], Counter]:
    now = Counter({k: v["bytes"] for k, v in sync.comm.snapshot().items()})
    return {k for k, v in (now - before).items() if v}, now


def _exchanges(rank: int, world: int) -> list[dict[str, Any]]:
    out = []
    for name, options in CASES:
        m = model()
        sync = ws.strategy(name, m, torch.optim.SGD(m.parameters(), lr=1e-2), **options)
        _, before = _purposes(sync, Counter())
        steps = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(rank + step)
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
            nn.functional.mse_loss(sync.model(x), y).backward()
            sync.step()
            sync.zero_grad()
            purposes, before = _purposes(sync, before)
            steps.append(purposes)
        sync.finish()
        final, _ = _purposes(sync, before)
        out.append(
            {
                "steps": steps,
                "finish": final,
                "timetable": type(sync.timetable).__name__,
                "exact_at": list(getattr(sync.timetable, "exact_at", [])),
            }
        )
    return out


@pytest.fixture(scope="module")
def exchanges() -> list[dict[str, Any]]:
    from wansync.runner.localgroup import run_ranks

    return run_ranks(_exchanges, 2)[0]


def test_every_strategy_has_a_case():
    assert {name for name, _ in CASES} == set(STRATEGIES)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[n for n, _ in CASES])
def test_a_strategy_exchanges_where_the_timetable_built_from_its_options_says(exchanges, case):
    name, options = CASES[case]
    got, tt = exchanges[case], timetable(name, options)
    assert got["timetable"] == type(tt).__name__
    grads = [t for t, p in enumerate(got["steps"], 1) if "grads" in p]
    assert grads == steps_where(tt.ddp_step)
    if hasattr(tt, "step"):  # the fragment strategies: the starts the timetable makes
        log = run(tt, STEPS)
        assert [t for t, p in enumerate(got["steps"], 1) if "pseudo_grads" in p] == sorted(
            {e[0] for e in log if e[1] == "start" and e[0] <= STEPS}
        )
        assert ("pseudo_grads" in got["finish"]) == any(e[1] == "final" for e in log)
        assert got["exact_at"] == tt.exact_at
    else:  # the periodic ones, and DeMo's exchange at every step
        purpose = strategy_class(name).exchange_purpose
        assert [t for t, p in enumerate(got["steps"], 1) if purpose in p] == steps_where(tt.is_boundary)
        assert (purpose in got["finish"]) == tt.final_sync(STEPS)


def test_a_sync_of_two_phases_starts_its_second_halfway_through_the_overlap():
    """Start at t, τ = 5: halfway at t + 2 (⌊τ/2⌋), the merge at t + 5; τ = 1 has no halfway."""
    from wansync.strategies import timetable

    for tau, expected in ((5, [(27, 0), (52, 1)]), (1, [])):
        tt = timetable("streaming", {"sync_every": 50, "fragments": 2, "overlap": tau})
        work = Recorder()
        for t in range(1, 60):
            tt.step(t, work)
        assert work.halfways == expected
