"""Fragments (partition) and the fragment schedule shared by Streaming DiLoCo and CoCoDC (spec §6, §7b)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from wansync.errors import ConfigError
from wansync.strategies.fragments import Schedule, model_stages, offsets, partition, slot_index
from wansync.workloads.lm.model import LMShape, TransformerLM
from wansync.workloads.vision.cnn import SmallCNN


def tiny_lm(layers: int = 4) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(LMShape(dim=16, n_layers=layers, n_heads=2, ffn_hidden=32, max_seq_len=16), 32)


def covers_every_tensor_once(model: nn.Module, frags) -> None:
    ids = [id(t) for f in frags for t in f.tensors]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()} | {
        id(b) for n, b in model.named_buffers() if n in model.state_dict() and b.is_floating_point()
    }


def test_lm_strided_partition_puts_embeddings_first_and_final_norm_last():
    model = tiny_lm(4)
    frags = partition(model, 2, "strided")
    assert [f.stages for f in frags] == [["embed", "blocks.0", "blocks.2"], ["blocks.1", "blocks.3", "norm"]]
    covers_every_tensor_once(model, frags)
    assert sum(f.numel for f in frags) == sum(p.numel() for p in model.parameters())  # tied head once


def test_lm_sequential_partition_and_four_fragments():
    model = tiny_lm(5)
    seq = partition(model, 2, "sequential")
    assert [f.stages for f in seq] == [["embed", "blocks.0", "blocks.1", "blocks.2"], ["blocks.3", "blocks.4", "norm"]]
    four = partition(model, 4, "strided")
    assert [f.stages for f in four] == [
        ["embed", "blocks.0", "blocks.4"],
        ["blocks.1"],
        ["blocks.2"],
        ["blocks.3", "norm"],
    ]
    for frags in (seq, four):
        covers_every_tensor_once(model, frags)


def test_one_fragment_is_the_whole_model():
    model = tiny_lm(3)
    (f,) = partition(model, 1)
    assert f.stages == ["embed", "blocks.0", "blocks.1", "blocks.2", "norm"]
    covers_every_tensor_once(model, [f])


def test_vision_stages_and_buffers_and_children_fallback():
    cnn = SmallCNN(1, 10, width=0.25)
    frags = partition(cnn, 2)
    assert [f.stages for f in frags] == [["block1", "block2"], ["block3", "head"]]
    covers_every_tensor_once(cnn, frags)  # BatchNorm running stats included
    seq = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    assert [s.name for s in model_stages(seq)] == ["0", "2"]  # parameter-free stages dropped
    assert [f.stages for f in partition(seq, 2)] == [["0"], ["2"]]  # < 3 stages: all are blocks


NO_BLOCKS = (
    ": it defines no stages() and has no repeated blocks (a ModuleList or nn.Sequential of modules of "
    "one type); define model.stages() (docs/strategies.md) or use at most 2 fragments"
)


@pytest.mark.parametrize(
    "model, p, blocks, hint",
    [
        (lambda: tiny_lm(4), 5, 4, ""),
        (lambda: tiny_lm(2), 99, 2, ""),
        (lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), 3, 2, NO_BLOCKS),
    ],
)
def test_more_fragments_than_blocks_is_one_line(model, p, blocks, hint):
    with pytest.raises(ConfigError) as e:
        partition(model(), p)
    assert str(e.value) == f"fragments must be between 1 and the model's {blocks} blocks (stages), got {p}{hint}"
    with pytest.raises(ConfigError, match="partition must be one of strided, sequential"):
        partition(model(), 1, "zigzag")


def test_offsets_as_specified():
    assert offsets(100, 4) == [25, 50, 75, 0]
    assert offsets(10, 3) == [3, 6, 0]
    assert offsets(50, 1) == [0]


@pytest.mark.parametrize("H, P", [(100, 4), (10, 3), (7, 2), (12, 1)])
def test_round_robin_with_n_equal_p_starts_each_fragment_at_its_offset(H, P):
    sched = Schedule(H, P, P, "round_robin")
    o = offsets(H, P)
    starts: dict[int, list[int]] = {p: [] for p in range(P)}
    for t in range(1, 3 * H + 1):
        if sched.is_slot(t):
            p, reason = sched.choose(t)
            assert reason == "round_robin"
            sched.record_start(p, t)
            starts[p].append(t)
    for p in range(P):
        assert starts[p] == [t for t in range(1, 3 * H + 1) if (t - o[p]) % H == 0]
        assert len(starts[p]) == 3  # once per period


@pytest.mark.parametrize("H, N", [(100, 8), (10, 3), (50, 50), (7, 4)])
def test_exactly_n_slots_per_period(H, N):
    slots = [t for t in range(1, 4 * H + 1) if slot_index(t, H, N) is not None]
    assert len(slots) == 4 * N and len(set(slots)) == len(slots)
    for k in range(4):
        assert sum(1 for t in slots if k * H < t <= (k + 1) * H) == N


def test_round_robin_with_more_syncs_visits_every_fragment_equally():
    sched = Schedule(40, 4, 8, "round_robin")
    chosen = []
    for t in range(1, 41):
        if sched.is_slot(t):
            p, _ = sched.choose(t)
            sched.record_start(p, t)
            chosen.append(p)
    assert chosen == [0, 1, 2, 3, 0, 1, 2, 3]


def test_round_robin_skips_a_slot_whose_fragment_is_in_flight():
    sched = Schedule(8, 2, 4, "round_robin")
    assert sched.choose(2) == (0, "round_robin")
    assert sched.choose(4, {1}) is None  # fragment 1 still in flight: skipped
    assert sched.choose(6) == (1, "round_robin")  # the pointer did not move


def simulate_adaptive(
    H: int, P: int, N: int, steps: int, rate_of, mode: str = "adaptive"
) -> list[tuple[int, int, str]]:
    """Drive an adaptive schedule with merges right after each start; rate_of(p) = ‖Δθ̃_p‖ per step."""
    sched = Schedule(H, P, N, mode)
    out = []
    for t in range(1, steps + 1):
        if sched.is_slot(t):
            p, reason = sched.choose(t)
            interval = sched.record_start(p, t)
            sched.record_merge(p, rate_of(p) * interval, interval)
            out.append((t, p, reason))
    return out


def test_adaptive_visits_every_fragment_first_then_follows_the_rate():
    picks = simulate_adaptive(H=40, P=3, N=6, steps=30, rate_of=lambda p: [1.0, 5.0, 2.0][p])
    assert [(p, r) for _, p, r in picks[:3]] == [(0, "rate"), (1, "rate"), (2, "rate")]  # R = +inf first
    assert all(p == 1 for _, p, r in picks[3:] if r == "rate")


def test_staleness_rule_forces_a_fragment_unsynced_for_h_steps():
    H, P, N = 20, 3, 10  # a slot every 2 steps
    picks = simulate_adaptive(H, P, N, steps=200, rate_of=lambda p: [10.0, 1.0, 0.0][p])
    last = {0: 0, 1: 0, 2: 0}
    for t, p, reason in picks:
        if reason == "stale":
            assert t - last[p] >= H
        for q in range(P):  # nothing ever waits more than H + one slot spacing
            assert t - last[q] <= H + H // N
        last[p] = t
    stale = [(t, p) for t, p, r in picks if r == "stale"]
    assert {p for _, p in stale} == {1, 2} and all(p == 0 for _, p, r in picks[3:] if r == "rate")
    # oldest first when several are stale, ties to the lowest index
    sched = Schedule(10, 3, 5, "adaptive")
    sched.last_start = [4, 2, 2]
    assert sched.choose(14) == (1, "stale")
    assert sched.choose(14, {1}) == (2, "stale")


def test_adaptive_ties_go_to_the_lowest_fragment_and_in_flight_is_excluded():
    sched = Schedule(10, 3, 5, "adaptive")
    sched.rate = [2.0, 3.0, 3.0]
    sched.last_start = [1, 1, 1]
    assert sched.choose(2) == (1, "rate")
    assert sched.choose(2, {1}) == (2, "rate")
    assert sched.choose(2, {0, 1, 2}) is None


def test_adaptive_fair_never_syncs_a_fragment_twice_before_every_fragment_had_a_turn():
    rate = lambda p: [10.0, 1.0, 0.0][p]  # noqa: E731
    locked = [p for _, p, _ in simulate_adaptive(20, 3, 10, steps=60, rate_of=rate)]
    assert locked[:8] == [0, 1, 2, 0, 0, 0, 0, 0]  # plain adaptive locks in
    fair = simulate_adaptive(20, 3, 10, steps=60, rate_of=rate, mode="adaptive_fair")
    rounds = [[p for _, p, _ in fair[i : i + 3]] for i in range(0, len(fair) - 2, 3)]
    assert all(sorted(r) == [0, 1, 2] for r in rounds)
    assert all(r[0] == 0 for r in rounds[1:])  # the rate still orders a round


def test_the_paper_preset_keeps_n_8_and_the_papers_schedule():
    from wansync.presets import get
    from wansync.strategies import resolve_options
    from wansync.strategies.transmission import syncs_per_period

    o = resolve_options("cocodc", get("cocodc-paper").values)
    assert (o["sync_every"], o["fragments"], o["schedule"], o["outer_scaling"], o["compensation"]) == (
        100,
        4,
        "adaptive",
        "none",
        "taylor",
    )  # the paper's rules, not the defaults
    for t_s in (5.0, 1e-3, 0.0):  # the paper's link, a fast one, an instant one
        assert syncs_per_period(o["gamma"], 100, 4, t_c=1.0, t_s=t_s, per_fragment=o["max_syncs_per_fragment"]) == 8
    sched = Schedule(100, 4, 8, o["schedule"])
    assert [t for t in range(1, 201) if sched.is_slot(t)] == [
        12,
        25,
        37,
        50,
        62,
        75,
        87,
        100,
        112,
        125,
        137,
        150,
        162,
        175,
        187,
        200,
    ]
    rate = lambda p: [1.0, 4.0, 2.0, 3.0][p]  # noqa: E731
    picks = [(t, p, r) for t, p, r in simulate_adaptive(100, 4, 8, steps=200, rate_of=rate)]
    assert picks[:4] == [(12, 0, "rate"), (25, 1, "rate"), (37, 2, "rate"), (50, 3, "rate")]
    assert [p for _, p, _ in picks[4:]] == [1, 1, 1, 1, 0, 1, 2, 3, 1, 1, 1, 1]  # argmax R_p, then stale


def test_schedule_state_round_trips():
    a = Schedule(30, 3, 6, "adaptive")
    for t in range(1, 25):
        if a.is_slot(t):
            p, _ = a.choose(t)
            a.record_merge(p, float(t), a.record_start(p, t))
    b = Schedule(30, 3, 3, "adaptive")
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert [b.choose(t) for t in (25, 30)] == [a.choose(t) for t in (25, 30)]


def test_bad_syncs_per_period():
    with pytest.raises(
        ConfigError, match=r"syncs per period must be between fragments \(4\) and sync_every \(10\), got 11"
    ):
        Schedule(10, 4, 11)
    with pytest.raises(ConfigError, match="schedule must be one of adaptive, adaptive_fair, round_robin"):
        Schedule(10, 4, 4, "random")
    assert math.isinf(Schedule(10, 2, 2).rate[0])


@pytest.mark.parametrize("strategy, model, p, blocks", [("streaming", "tiny", 99, 4), ("cocodc", "cnn", 5, 2)])
def test_a_fragment_count_the_model_cannot_take_is_refused_before_any_worker_starts(strategy, model, p, blocks):
    from wansync.config import build_config
    from wansync.runner.run import check_run

    cfg = build_config(None, {"strategy": strategy, "model": model, "fragments": p, "sync_every": 100})
    with pytest.raises(ConfigError, match=rf"^fragments must be between 1 and the model's {blocks} blocks"):
        check_run(cfg)  # the check the launcher and --dry-run make: nothing is spawned
    check_run(build_config(None, {"strategy": strategy, "model": model, "fragments": blocks, "sync_every": 100}))


def _default_fragments_on_two_blocks(rank: int, world: int) -> list[str]:
    import wansync as ws

    said = []
    for name, options in (("streaming", {}), ("cocodc", {}), ("streaming", {"fragments": 2})):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        try:
            ws.strategy(name, model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=8, **options)
            said.append("accepted")
        except ConfigError as e:
            said.append(str(e))
    return said


def test_the_default_fragments_on_a_model_of_fewer_blocks_says_it_was_a_default():
    """A newcomer's 2-layer model under streaming/cocodc: the line names the default and what to pass."""
    from wansync.runner.localgroup import run_ranks

    streaming, cocodc, two = run_ranks(_default_fragments_on_two_blocks, 1)[0]
    for name, line in (("streaming", streaming), ("cocodc", cocodc)):
        assert line == (
            f"{name} cuts the model into fragments=4 by default, and this model has 2 blocks (stages): pass "
            "fragments=2 or fewer (--fragments 2 on the command line)"
        )
    assert two == "accepted"
