"""The link a run measures (`net.estimate`, `telemetry.linkwatch`) and the controller that turns H and
the compression to keep the predicted exposed share under a target (`--adapt`, `trainer.adapt`): the
estimate on samples of a known link, the choice against the planner's own prediction, knobs turned
between rounds on real gloo groups, runs under a link that drops and recovers, and the refusals."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import netns
from cli_harness import TINY, start, wansync
from strategy_harness import deep_model, flat_params, rank_batch
from wansync.comm.replicas import Replicas
from wansync.errors import ConfigError
from wansync.net import parse_wan
from wansync.net.estimate import LinkSample, duration, estimate_link, on_link
from wansync.net.link import Link
from wansync.planner.prediction import predict, setting
from wansync.planner.schedule import trace
from wansync.planner.sizes import of_module, of_name
from wansync.runner.localgroup import run_ranks
from wansync.strategies import make_options
from wansync.trainer.adapt import AGREED, HYSTERESIS, WINDOW, Tuner, parse_adapt, settled_step

pytestmark = pytest.mark.timeout(240)

WORLD = parse_wan("cross-continent")  # 2 sites, 200 ms, 200 Mbit/s between them
SMALL = ("allreduce", 32, (0, 1, 2, 3))  # an evaluation's mean over every rank
LARGE = ("allreduce", 4e6, (0, 2))  # the exchange across the sites' first members


def samples(
    link: Link, kinds: list[tuple], n: int, topology=WORLD, noise: float = 0.005, seed: int = 0
) -> list[LinkSample]:
    """`n` collectives of `kinds` in turn, timed by the cost model on `link`, with a little noise."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        op, nbytes, members = kinds[i % len(kinds)]
        s = LinkSample(op, nbytes, members, 4, 1.0, float(i))
        seconds = duration(s, topology, link.rtt_s, link.bandwidth_bps) * (1 + noise * rng.random())
        out.append(LinkSample(op, nbytes, members, 4, seconds, float(i)))
    return out


# ---- the estimate -----------------------------------------------------------------------------------
@pytest.mark.parametrize("topology", [WORLD, parse_wan("rtt=30ms,bw=1gbit,sites=4")], ids=["2-sites", "4-sites"])
@pytest.mark.parametrize("rtt, bw", [(0.2, 200e6), (0.05, 20e6), (0.01, 2e9)])
def test_the_estimate_finds_the_link_its_samples_ran_on(topology, rtt, bw):
    large = ("allreduce", 4e6, (0, 1, 2, 3)) if topology.sites == 4 else LARGE
    est = estimate_link(samples(Link(rtt, bw), [SMALL, large, ("barrier", 0, (0, 1, 2, 3))], 30, topology), topology)
    assert est.rtt_s == pytest.approx(rtt, rel=0.01)
    # the RTT is the fastest small sample's, so the large ones' (median) noise of up to 0.5 % is the bytes'
    assert est.bandwidth_bps == pytest.approx(bw, rel=0.015)
    assert est.samples == 30


def test_one_slow_sample_moves_neither_the_rtt_nor_the_bandwidth():
    got = samples(Link(0.2, 200e6), [SMALL, LARGE], 12)
    for i in (6, 7):  # one of each kind, five times as long
        got[i] = LinkSample(**{**got[i].__dict__, "seconds": 5 * got[i].seconds})
    est = estimate_link(got, WORLD, newest=3)
    assert est.rtt_s == pytest.approx(0.2, rel=0.01)
    assert est.bandwidth_bps == pytest.approx(200e6, rel=0.01)


def test_small_collectives_slowed_by_a_busy_machine_leave_the_rtt_and_the_bandwidth_as_they_are():
    # beside busy loops most small collectives wait for a peer to be scheduled (2-4x their time); the
    # large ones barely notice. A median of the small ones put the RTT past what explains the large ones,
    # and the bandwidth solved beside it came out without bound
    got = samples(Link(0.05, 200e6), [SMALL, LARGE], 20, noise=0.0)
    slow = iter([2.5, 3.0, 1.0, 2.0, 4.0] * 2)
    got = [LinkSample(**{**s.__dict__, "seconds": s.seconds * next(slow)}) if s.nbytes == 32 else s for s in got]
    est = estimate_link(got, WORLD, newest=3)
    assert est.rtt_s == pytest.approx(0.05, rel=0.01)
    assert est.bandwidth_bps == pytest.approx(200e6, rel=0.01)


def test_the_newest_samples_follow_a_link_that_dropped():
    before = samples(Link(0.2, 200e6), [SMALL, LARGE], 20)
    after = [LinkSample(**{**s.__dict__, "at_s": s.at_s + 100}) for s in samples(Link(0.2, 20e6), [SMALL, LARGE], 4)]
    assert estimate_link(before + after[:2], WORLD, newest=3).bandwidth_bps == pytest.approx(200e6, rel=0.01)
    assert estimate_link(before + after, WORLD, newest=3).bandwidth_bps == pytest.approx(20e6, rel=0.01)


def test_without_small_collectives_the_rtt_is_unknown_and_the_topologys_is_used():
    est = estimate_link(samples(Link(0.2, 50e6), [LARGE], 5), WORLD)
    assert est.rtt_s is None
    assert est.bandwidth_bps == pytest.approx(50e6, rel=0.01)  # solved at the topology's own 200 ms


def test_a_collective_inside_a_site_says_nothing_of_the_link_between_sites():
    inside = [LinkSample("allreduce", 4e6, (0, 1), 4, 0.01, float(i)) for i in range(5)]
    assert estimate_link(inside, WORLD).samples == 0
    assert estimate_link(inside, WORLD).bandwidth_bps is None


# ---- the controller's choice --------------------------------------------------------------------------
def fake_sync(strategy: str = "diloco", module: nn.Module | None = None, **options: Any) -> SimpleNamespace:
    opts = make_options(strategy, **options)
    return SimpleNamespace(
        name=strategy,
        module=module if module is not None else deep_model(0),
        opts=opts,
        replicas=Replicas(),
        world_size=4,
        group=None,
        codec=SimpleNamespace(name=getattr(opts, "codec", "sparse")),
        t=0,
        timetable=SimpleNamespace(origin=0),
        retune=lambda **knobs: None,
        emit=lambda *args, **fields: None,
    )


def tuner(text: str, strategy: str = "diloco", **options: Any) -> Tuner:
    sync = fake_sync(strategy, **options)
    import dataclasses

    spec = parse_adapt(text, strategy, dataclasses.asdict(sync.opts))
    return Tuner(spec, sync, WORLD, step_times=lambda: [])


def planner_pct(t: Tuner, knobs: dict[str, Any], link: Link, step_s: float, topology=WORLD, agreement=True) -> float:
    """The planner's exposed share for `knobs`, with the controller's own agreement (or without)."""
    size = t.size
    options = {**t.options, **knobs}
    agreement_bytes = 8 * AGREED if agreement else 0
    s = setting(t.sync.name, options, size, 4, on_link(topology, link), step_s, agreement_bytes=agreement_bytes)
    return predict(s).exposed_pct


def test_the_choice_is_the_first_candidate_the_planner_puts_under_the_target():
    """The current knobs stay while predicted under the target; another setting is taken only if it holds
    the target at a step 10 % faster than the settled one (HYSTERESIS)."""
    t = tuner("exposed=5%,h=4..16", sync_every=4)
    assert t.spec.sync_every == (4, 5, 8, 10, 16) and t.spec.ladder == ("fp32", "bf16", "int8", "fp4")
    assert HYSTERESIS == 0.1
    for bw in (10e9, 2e6, 1e5):
        choice, why = t.choose(bw, 0.001, 0.05, 0.0)
        link = Link(0.001, bw)
        order = t.spec.candidates()

        def taken(k: dict[str, Any]) -> bool:
            return planner_pct(t, k, link, 0.05 if k == t.current else 0.045) <= 5

        first = next((k for k in order if taken(k)), None)
        if first is not None:
            assert choice == first and why["within_target"]
        else:  # none reaches it: the least exposed
            assert choice == min(order, key=lambda k: planner_pct(t, k, link, 0.05)) and not why["within_target"]
        assert why["predicted_exposed_pct"] == pytest.approx(planner_pct(t, choice, link, 0.05), abs=0.01)
    fast, _ = t.choose(10e9, 0.001, 0.05, 0.0)
    slow, _ = t.choose(2e6, 0.001, 0.05, 0.0)
    assert fast == {"sync_every": 4, "codec": "fp32"}
    assert order.index(slow) > order.index(fast)


def test_a_setting_other_than_the_current_one_must_hold_the_target_at_a_faster_step():
    """At the step where fp32 is predicted just under a 10 % target, and over it 10 % faster: the current
    fp32 stays, and neither a run on int8 goes back to it nor one on a heavier setting takes it."""
    t = tuner("exposed=10%,h=4..4", sync_every=4)
    link = Link(0.001, 3e6)
    fp32 = {"sync_every": 4, "codec": "fp32"}
    lo, hi = 1e-4, 100.0  # the step at which fp32 is predicted 9.5 % exposed
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if planner_pct(t, fp32, link, mid) > 9.5 else (lo, mid)
    step = hi
    assert 9 < planner_pct(t, fp32, link, step) <= 9.5 < 10 < planner_pct(t, fp32, link, 0.9 * step)
    t.current = {"sync_every": 4, "codec": "int8"}
    assert t.choose(3e6, 0.001, step, 0.0)[0] != fp32  # under the target, not at a faster step
    t.current = fp32
    assert t.choose(3e6, 0.001, step, 0.0)[0] == fp32  # the current one stays up to the target
    t.current = {"sync_every": 4, "codec": "fp4"}  # toward less protection alike
    assert t.choose(3e6, 0.001, step, 0.0)[0] != fp32


def test_the_plan_holds_the_controllers_agreement_behind_each_exchange():
    """The agreement `after_round` issues after each boundary's exchange and `before_round` waits for at the
    next boundary, before that boundary's exchange: where the planner's trace puts it too."""
    size = of_module("diloco", nn.Linear(64, 64))
    for overlap in (False, True):
        options = {"sync_every": 4, "overlap_rounds": overlap, "codec": "bf16"}
        tr = trace("diloco", make_options("diloco", **options).__dict__, size, 4, 12, agreement_bytes=48)
        for t in (4, 8, 12):
            acts = [(a.kind, a.transfer.purpose, a.transfer.step) for a in tr.steps[t - 1]]
            issued = [i for i, (kind, purpose, _) in enumerate(acts) if kind == "issue" and purpose != "adapt"]
            assert acts[-1] == ("issue", "adapt", t) and issued and max(issued) < len(acts) - 1, acts
            assert (acts[0] == ("wait", "adapt", t - 4)) == (t > 4), acts
            assert sum(1 for a in acts if a[1] == "adapt") == (2 if t > 4 else 1)
        assert not any(a.transfer.purpose == "adapt" for s in tr.steps for a in s if a.transfer.step % 4)
    with pytest.raises(ValueError, match="periodic rounds only"):
        trace("streaming", make_options("streaming").__dict__, size, 4, 8, agreement_bytes=48)


def test_an_overlapped_means_second_phase_waits_behind_the_agreement_and_the_tuner_plans_it():
    """The benchmark's dropped link (benchmarks/adapt.py: 20 Mbit/s, 100 ms; a 7.3 MB model in bf16, two-phase,
    each phase behind half a round of 0.284 s steps): the agreement of 48 bytes takes 0.15 s on that link, and
    the second phase, issued halfway through the round, waits behind it. Without it the planner put bf16 under
    a 5 % target (4.4 %) that the busy runs measured at 8-12 % a round; with it, bf16 is over the target and
    the controller takes the next setting."""
    t = bench_tuner()
    t.size = of_name("tiny")  # the benchmark's model: 1.82 M values, 7.3 MB of fp32
    bf16, link, step = {"sync_every": 8, "codec": "bf16"}, Link(0.1, SLOW), 0.284
    planner = dict(link=link, step_s=step, topology=BENCH_WAN)
    without, with_it = planner_pct(t, bf16, agreement=False, **planner), planner_pct(t, bf16, **planner)
    assert without < 5 < with_it, (without, with_it)
    assert t.predicted(bf16, link, step, 0.0) == pytest.approx(with_it)
    assert t.choose(SLOW, 0.1, step, 0.0)[0] not in (FP32, bf16)


# ---- the controller's decisions over rounds: settled inputs, going back once confirmed ------------------------
# the benchmark's case (benchmarks/adapt.py) at unit scale: 4 MB of fp32 across 2 sites, 100 ms, 200 Mbit/s that
# drop to 20, diloco --overlap-rounds at H = 8; at 20 Mbit/s fp32 is hidden behind a round of 0.25 s steps but
# exposed behind one of 0.16 s steps, which a loaded machine's rounds swing between
BENCH_WAN = parse_wan("rtt=100ms,bw=200mbit,sites=2")
FAST, SLOW = 200e6, 20e6
NOISY = [0.16, 0.45, 0.3, 0.52, 0.25]  # a round's median step (s): loaded but for one round in five
FP32, INT8 = {"sync_every": 8, "codec": "fp32"}, {"sync_every": 8, "codec": "int8"}


def bench_tuner(codec: str = "fp32") -> Tuner:
    import dataclasses

    sync = fake_sync(module=nn.Linear(1024, 1024), sync_every=8, overlap_rounds=True, codec=codec)
    spec = parse_adapt("exposed=5%,h=8..32,codec=fp32..fp4", "diloco", dataclasses.asdict(sync.opts))
    return Tuner(spec, sync, BENCH_WAN, step_times=lambda: [])


def rounds(t: Tuner, agreed: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """Each boundary as every rank sees it: (bandwidth, median step) agreed, then the decision; the knobs after."""
    held = []
    for bw, step_s in agreed:
        t.record([bw, 0.1, step_s, 0.01])
        change = t.decide()
        if change is not None:
            t.apply(t.sync, *change)
        held.append(dict(t.current))
    return held


def test_the_settled_step_is_the_fastest_of_the_last_rounds():
    assert WINDOW == 5
    assert settled_step([(0.1, 0.0), (0.3, 0.0), (0.5, 0.1), (0.2, 0.05), (0.4, 0.0), (0.6, 0.0)]) == (0.2, 0.05)
    assert settled_step([(0.3, 0.2), (0.4, 0.0)]) == (0.4, 0.0)  # the round, not the least of each


def test_noisy_step_times_take_one_decision_per_change_of_the_link_and_none_back_while_it_is_down():
    t = bench_tuner()
    # the last round's step alone would flap: fp32 is hidden at 20 Mbit/s behind a loaded round, not a fast one
    assert t.choose(SLOW, 0.1, 0.45, 0.01)[0] == FP32 and t.choose(SLOW, 0.1, 0.16, 0.01)[0] != FP32
    steps = NOISY * 6
    link = [FAST] * 8 + [SLOW] * 12 + [FAST] * 10
    held = rounds(t, list(zip(link, steps)))
    changes = [i for i in range(1, len(held)) if held[i] != held[i - 1]]
    assert held[0] == FP32 and changes == [8, 21], held  # at the drop's first round; the second after recovery
    assert held[8] != FP32 and all(h == held[8] for h in held[8:21])  # nothing goes back while it is down
    assert held[21] == FP32 and t.decisions == 2


def test_a_drop_takes_one_decision_though_a_faster_round_follows_it():
    """The busy benchmark's seed 1 (2026-12-07): on the dropped link the settled step was 295 ms, at which
    bf16 is predicted 4.5 % exposed, under the 5 % target; a round later a faster one made it 289 ms and bf16
    over the target, a second decision for one drop. Taken only if it holds at a step 10 % faster, the
    setting for the drop leaves room for that round."""
    t = bench_tuner()
    t.size = of_name("tiny")
    held = rounds(t, [(FAST, 0.295)] * 5 + [(SLOW, 0.295), (SLOW, 0.289), (SLOW, 0.284), (SLOW, 0.3)])
    changes = [i for i in range(1, len(held)) if held[i] != held[i - 1]]
    assert held[4] == FP32 and held[5] not in (FP32, {"sync_every": 8, "codec": "bf16"}), held
    assert changes == [5] and t.decisions == 1, held


def test_a_lighter_setting_is_taken_back_after_two_consecutive_settled_rounds_under_the_target():
    t = bench_tuner()
    held = rounds(t, [(SLOW, 0.16)] * 6)
    assert held[0] == held[-1] != FP32  # protection at the first round, on a window of one
    heavy = held[-1]
    # one round of the recovered link (a blip), then the drop again, then a recovery, confirmed the round after
    held = rounds(t, [(FAST, 0.16), (SLOW, 0.16), (FAST, 0.16), (FAST, 0.16), (FAST, 0.16)])
    assert held == [heavy, heavy, heavy, FP32, FP32]


def test_an_unsettled_window_takes_nothing_back():
    t = bench_tuner(codec="int8")  # a run that starts heavier than the link needs
    assert t.current == INT8
    held = rounds(t, [(FAST, 0.16)] * 7)
    assert held == [INT8] * 5 + [FP32] * 2  # the window is full at the fifth round, confirmed at the sixth


def test_a_resumed_tuner_keeps_its_window_and_what_awaits_confirmation():
    t = bench_tuner()
    rounds(t, [(SLOW, 0.16)] * 5 + [(FAST, 0.16)])
    assert t.under and t.current != FP32  # fp32 under the target once: one round more to go
    state = t.state_dict()
    resumed = bench_tuner()
    resumed.load_state_dict(state)
    assert resumed.rounds == t.rounds and rounds(resumed, [(FAST, 0.16)]) == rounds(t, [(FAST, 0.16)]) == [FP32]


def test_sparseloco_turns_its_density_down_by_halves():
    t = tuner("exposed=5%,h=30..30", "sparseloco")
    assert t.spec.knob == "density" and t.spec.ladder[0] == pytest.approx(t.sync.opts.density)
    assert [b / a for a, b in zip(t.spec.ladder, t.spec.ladder[1:])] == pytest.approx([0.5] * 3)


@pytest.mark.parametrize(
    "strategy, text, options, words",
    [
        ("diloco", "exposed=0%", {}, "strictly between 0 and 100"),
        ("diloco", "exposed=100", {}, "strictly between 0 and 100"),
        ("diloco", "exposed=-3%", {}, "strictly between 0 and 100"),
        ("diloco", "exposed=five", {}, "a percentage like 5%"),
        ("diloco", "h=8..64", {}, "the target is missing"),
        ("diloco", "exposed=5%,exposed=6%", {}, "given twice"),
        ("diloco", "exposed=5%,speed=2", {}, "expected exposed=PCT"),
        ("diloco", "exposed=5%,h=8..8,codec=int8..int8", {}, "nothing to choose"),
        ("diloco", "exposed=5%,h=64..8", {}, "1 <= LOW <= HIGH"),
        ("diloco", "exposed=5%,h=a..b", {}, "a value or a range"),
        ("diloco", "exposed=5%,codec=fp32..zip", {}, "not one of fp32, bf16, int8, fp4"),
        ("diloco", "exposed=5%,codec=fp4..fp32", {}, "lightest compression first"),
        ("diloco", "exposed=5%,density=0.01..0.001", {}, "turns its codec, not a density"),
        ("diloco", "exposed=5%", {"slow_policy": "balanced"}, "--slow-policy wait"),
        ("sparseloco", "exposed=5%,codec=fp32..int8", {}, "turns its density, not a codec"),
        ("sparseloco", "exposed=5%,density=0.01..0.00001", {}, "less than one value"),
        ("sparseloco", "exposed=5%", {"topk": 8, "density": None}, "give --density instead of --topk"),
        ("ddp", "exposed=5%", {}, "ddp has no knob"),
        ("local_sgd", "exposed=5%", {}, "local_sgd has no knob"),
        ("streaming", "exposed=5%", {}, "streaming has no knob"),
    ],
)
def test_bad_adapt_specs_are_refused_in_one_line(strategy, text, options, words):
    import dataclasses
    from wansync.strategies import strategy_class

    opts = dataclasses.asdict(strategy_class(strategy).Options()) | options
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("+", r"\+")) as e:
        parse_adapt(text, strategy, opts)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--strategy", "diloco", "--adapt", "exposed=5%"], "give --wan"),
        (["--strategy", "diloco", "--adapt", "exposed=150%", "--wan", "lan"], "strictly between 0 and 100"),
        (["--strategy", "ddp", "--adapt", "exposed=5%", "--wan", "lan"], "ddp has no knob"),
        (["--strategy", "diloco", "--adapt", "exposed=5%", "--wan", "lan", "--fault-tolerant"], "drop one of the two"),
    ],
)
def test_the_command_line_refuses_adapt_without_what_it_needs(tmp_path, args, words):
    r = wansync("train", *args, "--workers", "2", "--steps", "4", "--out", str(tmp_path / "run"), *TINY, timeout=60)
    assert r.returncode == 1, r.stderr
    assert words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ---- knobs turned between rounds, on gloo -----------------------------------------------------------------
class Scripted:
    """A tuner that turns the knobs it is told at the boundaries it is told (no measurement)."""

    def __init__(self, at: dict[int, dict[str, Any]]):
        self.at, self.rounds = at, []

    def before_round(self, sync):
        if sync.t in self.at:
            sync.retune(**self.at[sync.t])
        self.rounds.append(sync.t)

    def after_round(self, sync):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _scripted(
    rank: int, world: int, name: str, options: dict[str, Any], at: dict[int, dict[str, Any]], steps: int
) -> dict[str, Any]:
    import wansync as ws

    model = deep_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = ws.strategy(name, model, opt, **options)
    sync.tuner = Scripted(at)
    events = []
    sync.on_event(lambda r: events.append((r["step"], r.get("codec"), r.get("bytes"))) if r["type"] == "sync" else None)
    for step in range(steps):
        x, y = rank_batch(rank, step)
        nn.functional.mse_loss(sync.model(x), y).backward()
        sync.step()
        sync.zero_grad()
    sync.finish()
    return {"rounds": sync.tuner.rounds, "events": events, "final": flat_params(model)}


@pytest.mark.parametrize(
    "name, options, knob, fewer",
    [
        ("diloco", {"sync_every": 4, "outer_momentum": 0.0}, {"codec": "int8"}, True),
        ("diloco", {"sync_every": 4, "outer_momentum": 0.0, "overlap_rounds": True}, {"codec": "fp4"}, True),
        ("sparseloco", {"sync_every": 4}, {"density": 0.25}, False),  # the tiny model's default keeps less
    ],
)
def test_h_and_the_compression_change_at_a_boundary_alike_on_every_rank(name, options, knob, fewer):
    at = {8: {"sync_every": 3, **knob}}
    out = run_ranks(_scripted, 2, name, options, at, 17)
    for o in out:
        assert o["rounds"] == [4, 8, 11, 14, 17]  # H 4 up to step 8, then 3 from there
    assert torch.equal(out[0]["final"], out[1]["final"])
    steps = [e[0] for e in out[0]["events"]]
    assert steps[:5] == [4, 8, 11, 14, 17]
    sent = {e[0]: e[2] for e in out[0]["events"]}
    assert (sent[8] < sent[4]) == fewer and sent[8] != sent[4]  # from the boundary it was turned at


def test_a_knob_a_strategy_lacks_is_refused():
    sync = fake_sync()
    from wansync.strategies.base import Strategy

    with pytest.raises(ConfigError, match="has no knob density to turn"):
        Strategy.retune(SimpleNamespace(name="diloco", knobs=("sync_every", "codec")), density=0.1)
    del sync


# ---- runs under a link that drops and recovers -------------------------------------------------------------
DROP = """
name = "drop-and-restore"
[sites.a]
workers = 1
[sites.b]
workers = 1
[[links]]
sites = ["a", "b"]
rtt = "4ms"
bw = "{bw}"
[compute]
step = "40ms"
{schedule}
"""
SCHEDULE = """[[schedules]]
links = "all"
steps = [{ at = "2.5s", scale = 0.1 }, { at = "5s", scale = 1.0 }]
"""


def _records(run) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["type"] == "step"], [r for r in rows if r["type"] == "adapt"]


def test_the_controller_compresses_through_a_drop_and_goes_back_when_the_link_recovers(tmp_path):
    path = tmp_path / "drop.toml"
    path.write_text(DROP.format(bw="400mbit", schedule=SCHEDULE))
    run = tmp_path / "run"
    # 200 steps (~9.5 s idle) run ~4 s past the recovery: taking back waits for two exchanges to confirm
    # it and two settled rounds (1.1-1.6 s idle); 150 steps left a loaded CI run without it
    r = wansync(
        "train",
        "--strategy",
        "diloco",
        "--sync-every",
        "4",
        "--workers",
        "2",
        "--steps",
        "200",
        "--wan",
        str(path),
        "--adapt",
        "exposed=10%,h=4..8",
        "--eval-every",
        "1000",
        "--quiet",
        "--out",
        str(run),
        *TINY,
        timeout=200,
    )
    assert r.returncode == 0, r.stderr
    steps, decisions = _records(run)
    assert decisions, "no decision was logged"
    order = ("fp32", "bf16", "int8", "fp4")
    heaviest = max(decisions, key=lambda d: (d["after"]["sync_every"], order.index(d["after"]["codec"])))
    assert steps[heaviest["step"] - 1]["time"] < 5.5 + 1.0  # compressed by the end of the drop
    # every step of the drop past a round's lag runs compressed: on a loaded machine a slow exchange may
    # compress it a little early (the estimate errs low, toward protection: docs/adapt.md), never late
    for s in steps:
        if 3.2 < s["time"] < 4.8:
            knobs = next((d["after"] for d in reversed(decisions) if d["step"] < s["step"]), None)
            assert knobs is not None and knobs != {"sync_every": 4, "codec": "fp32"}, (s, decisions)
    last = decisions[-1]
    assert steps[last["step"] - 1]["time"] > 5.0  # and back after it
    assert (
        order.index(last["after"]["codec"]) < order.index(heaviest["after"]["codec"])
        or last["after"]["sync_every"] < heaviest["after"]["sync_every"]
    )
    for d in decisions:
        assert d["reason"].startswith("predicted") and d["target_pct"] == 10.0
    during = [s["link_bw_bps"] for s in steps if "link_bw_bps" in s and 3.5 < s["time"] < 4.8]
    # the drop, measured: 40 Mbit/s, a tenth of the link before it (39.8-40.8 beside two busy loops since the
    # RTT is the fastest small collective's; the median's 46-75 Mbit/s under load is why the bound is wide;
    # test_on_real_tcp_the_estimate_is_the_rate_tbf_holds_the_link_to holds its accuracy)
    assert during and all(30e6 < bw < 100e6 for bw in during)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["comm"]["adapt"]["calls"] > 0
    assert 0.004 <= summary["link_estimate"]["rtt_s"] < 0.012  # 4 ms, and the real backend's own time
    rep = wansync("report", str(tmp_path), timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert (tmp_path / "adapt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "report.md").read_text()
    assert "## What --adapt decided" in text and f"| {heaviest['step']} |" in text


def test_two_runs_with_one_seed_take_the_same_decisions(tmp_path):
    """On 2 Mbit/s no setting within the bounds reaches the target, and the least exposed one (H = 16, fp4)
    is so by far: a choice that measured times which wander (a loaded machine) cannot move. Where a
    prediction sits at the target they may: decisions rest on measured numbers (docs/adapt.md)."""
    path = tmp_path / "slow.toml"
    path.write_text(DROP.format(bw="2mbit", schedule=""))
    args = ("train", "--strategy", "diloco", "--sync-every", "4", "--workers", "2", "--steps", "24", "--wan", str(path))
    args += ("--adapt", "exposed=10%,h=4..16", "--eval-every", "1000", "--quiet", *TINY)
    # side by side: each waits on its own emulated link most of the time
    legs = {leg: start(*args, "--out", str(tmp_path / leg)) for leg in ("one", "two")}
    logs = []
    for leg, running in legs.items():
        r = running.result(200)
        assert r.returncode == 0, r.stderr
        logs.append([(d["step"], d["after"]) for d in _records(tmp_path / leg)[1]])
    assert logs[0] == [(8, {"sync_every": 16, "codec": "fp4"})]
    assert logs[0] and logs[0] == logs[1]


def _resumed(rank: int, world: int) -> dict[str, Any]:
    """A run whose knobs were turned at step 8, and one resumed from its state there."""
    import dataclasses
    import wansync as ws

    def build():
        model = deep_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        sync = ws.strategy("diloco", model, opt, sync_every=4, outer_momentum=0.0)
        spec = parse_adapt("exposed=5%,h=3..4", "diloco", dataclasses.asdict(sync.opts))
        sync.tuner = Tuner(spec, sync, WORLD, step_times=lambda: [])
        return model, opt, sync

    def train(model, sync, steps):
        for step in steps:
            x, y = rank_batch(rank, step)
            nn.functional.mse_loss(sync.model(x), y).backward()
            sync.step()
            sync.zero_grad()

    model, opt, sync = build()
    train(model, sync, range(8))
    sync.tuner.apply(
        sync,
        {"sync_every": 3, "codec": "int8"},
        {"predicted_exposed_pct": 1.0, "link_bw_bps": 1e6, "link_rtt_s": 0.1, "step_s": 0.1, "within_target": True},
    )
    saved = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": opt.state_dict(),
        "sync": sync.state_dict(),
    }
    train(model, sync, range(8, 14))
    sync.finish()
    model2, opt2, sync2 = build()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sync2.load_state_dict(saved["sync"])
    knobs = (sync2.opts.sync_every, sync2.codec.name, sync2.timetable.origin, sync2.tuner.current)
    train(model2, sync2, range(8, 14))
    sync2.finish()
    return {"knobs": knobs, "same": torch.equal(flat_params(model), flat_params(model2))}


def test_a_run_resumed_after_a_decision_keeps_its_knobs_bit_for_bit():
    for o in run_ranks(_resumed, 2):
        assert o["knobs"] == (3, "int8", 8, {"sync_every": 3, "codec": "int8"})
        assert o["same"]


# ---- on real TCP: the namespace bed ---------------------------------------------------------------------
# one rank per host under a link model that adds nothing measurable (`--wan lan`): small and large
# all-reduces, then the estimate from the emulator's records
ESTIMATE = """
import sys, json, datetime, torch, torch.distributed as dist
from wansync import net
from wansync.telemetry.linkwatch import LinkWatch
rank, addr = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
store = dist.TCPStore(addr, 29578, 2, rank == 0, datetime.timedelta(seconds=60))
dist.init_process_group(net.install(), store=store, rank=rank, world_size=2,
                        pg_options=net.Emulator(net.parse_wan("lan"), seed=0), timeout=datetime.timedelta(seconds=60))
small, large = torch.ones(2), torch.ones(455_000)
for k in range(4):
    dist.all_reduce(small)
    dist.all_reduce(large)
est = LinkWatch().run()
if rank == 0:
    print(json.dumps(est.as_dict()))
dist.barrier()
dist.destroy_process_group()  # a group left to the interpreter's exit aborted rank 0 once (SIGABRT)
"""


@pytest.mark.skipif(netns.unavailable() is not None, reason=netns.unavailable() or "")
def test_on_real_tcp_the_estimate_is_the_rate_tbf_holds_the_link_to():
    import os
    import subprocess
    import sys

    with netns.Bed(2, rate="100mbit") as bed:
        procs = [
            bed.start(
                h,
                [sys.executable, "-c", ESTIMATE, str(r), bed.hosts[0].address],
                env=dict(os.environ, GLOO_SOCKET_IFNAME=h.ifname),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r, h in enumerate(bed.hosts)
        ]
        out, err = procs[0].communicate(timeout=90)
        for p in procs[1:]:
            p.wait(timeout=30)
        assert procs[0].returncode == 0, err[-2000:]
    est = json.loads(out.strip().splitlines()[-1])
    print(est)
    assert est["bandwidth_bps"] == pytest.approx(100e6, rel=0.10)
    # the bed's is a tenth of a millisecond; a gloo collective's own latency beside another test file's
    # processes measured 5.06 ms once: small against any wide-area link (cross-region: 100 ms)
    assert est["rtt_s"] is not None and est["rtt_s"] < 0.02


def test_sparseloco_sends_a_lower_density_on_a_link_too_slow_for_its_own(tmp_path):
    run = tmp_path / "run"
    r = wansync(
        "train",
        "--strategy",
        "sparseloco",
        "--sync-every",
        "4",
        "--workers",
        "2",
        "--steps",
        "24",
        "--wan",
        "rtt=4ms,bw=2mbit,sites=2",
        "--adapt",
        "exposed=1%,h=4..4",
        "--eval-every",
        "1000",
        "--quiet",
        "--out",
        str(run),
        *TINY,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # H is held at 4, so only the density can answer; one round's ~20 ms against 1 % of four steps: a
    # step would have to take half a second (a machine loaded far past CI's) for the density to stay
    (first, *_) = [x for x in rows if x["type"] == "adapt"]
    assert first["after"]["density"] < first["before"]["density"] and "within_target" in first
    sent = {x["step"]: x["bytes"] for x in rows if x["type"] == "sync"}
    assert sent[max(sent)] < sent[min(sent)]  # the payload shrank with the density
    summary = json.loads((run / "summary.json").read_text())
    # a 3 KB sparse payload is mostly latency on this link: its bandwidth is measured loosely (1.69 Mbit/s
    # on a loaded machine); the estimate's accuracy is checked on exchanges that bytes dominate, above
    assert 1e6 < summary["link_estimate"]["bandwidth_bps"] < 3e6
