"""The decision figures and the one computed sentence, on synthetic runs."""

from __future__ import annotations

from pathlib import Path

from wansync.analysis.runs import LM, Run, SettingRuns
from wansync.analysis.verdict import (
    Spread,
    decision_rows,
    decision_table,
    equal_time,
    recorded_spread,
    seed_spread,
    value_at,
    verdict,
)


def run(strategy: str, curve: list[tuple[float, float]], wall: float) -> SettingRuns:
    evals = [{"type": "eval", "step": 10 * (i + 1), "time": t, "val_loss": v} for i, (t, v) in enumerate(curve)]
    summary = {"wall_clock_s": wall, "exposed_comm_pct": 50.0 if strategy == "ddp" else 5.0, "bytes_sent": 1e6}
    return SettingRuns(
        strategy, strategy, {}, [Run(Path(strategy), strategy, strategy, 0, {}, "ok", summary, {}, evals)]
    )


DDP = run("ddp", [(10, 3.0), (20, 2.5), (40, 2.0)], 41)
DILOCO = run("diloco", [(5, 2.9), (10, 2.4), (20, 2.1)], 21)


def test_the_value_at_a_time_is_the_last_evaluation_made_by_then():
    evals = DDP.runs[0].evals
    assert value_at(evals, "val_loss", 25) == 2.5
    assert value_at(evals, "val_loss", 40) == 2.0
    assert value_at(evals, "val_loss", 5) is None


def test_equal_wall_clock_is_when_the_fastest_setting_made_its_last_evaluation():
    assert equal_time([DDP, DILOCO]) == 20


def test_the_sentence_names_the_best_at_equal_time_and_the_first_to_the_target():
    rows = decision_rows([DDP, DILOCO], LM, 2.2)
    by = {r["setting"]: r for r in rows}
    assert by["ddp"]["at_equal_time"] == 2.5 and by["diloco"]["at_equal_time"] == 2.1
    assert by["ddp"]["time_to_target_s"] == 40 and by["diloco"]["time_to_target_s"] == 20
    text = verdict(rows, LM, 2.2, "cross-region", 20)
    assert text == (
        "On the cross-region link, DiLoCo had the best validation loss at equal wall clock, 2.1000 after "
        "20 s (one seed each); it also reached the target validation loss of 2.2000 first, after 20 s, "
        "2.0x sooner than DDP."
    )
    assert "(" not in text.split("(one seed each)")[1]  # plain: no nested brackets
    table = decision_table(rows, LM, 20)
    assert table.splitlines()[0].startswith("| setting | validation loss at 20 s | time to target (s)")


def test_a_target_nobody_reaches_is_said():
    rows = decision_rows([DDP, DILOCO], LM, 1.0)
    assert "no setting reached the target" in verdict(rows, LM, 1.0, "lan", 20)
    assert "not reached (0/1)" in decision_table(rows, LM, 20)


def seeds(strategy: str, finals: list[float]) -> SettingRuns:
    runs = [
        Run(
            Path(f"{strategy}{i}"),
            strategy,
            strategy,
            i,
            {},
            "ok",
            {"wall_clock_s": 20},
            {},
            [{"type": "eval", "step": 10, "time": 20, "val_loss": v}],
        )
        for i, v in enumerate(finals)
    ]
    return SettingRuns(strategy, strategy, {}, runs)


def test_leaders_closer_than_the_seeds_allow_are_too_close_to_call():
    """The demo's case: one seed each, 2.1592 against 2.1173, a spread of 0.033 measured over seeds."""
    rows = decision_rows([run("cocodc", [(20, 2.1592)], 21), run("local_sgd", [(20, 2.1173)], 21)], LM, None)
    text = verdict(rows, LM, None, "cross-region", 20, Spread(0.033, "measured over 3 seeds on the results page"))
    assert text == (
        "On the cross-region link, LocalSGD and CoCoDC are too close to call at equal wall clock: 2.1173 "
        "and 2.1592 after 20 s differ by less than the 0.091 that seeds alone allow (measured over 3 "
        "seeds on the results page)."
    )
    far = verdict(rows, LM, None, "cross-region", 20, Spread(0.01, "x"))
    assert far.startswith("On the cross-region link, LocalSGD had the best validation loss at equal wall clock, 2.1173")
    assert "one seed" not in far  # the spread is known: no caveat


def test_the_spread_of_seeds_is_pooled_over_the_settings_that_have_several():
    settings = [seeds("diloco", [2.0, 2.2, 2.1]), seeds("ddp", [3.0, 3.4]), seeds("cpdp", [2.5])]
    sd = seed_spread(settings, LM, 20)
    assert sd is not None and abs(sd.sd - ((0.02 + 0.08) / 3) ** 0.5) < 1e-12
    assert seed_spread([seeds("cpdp", [2.5])], LM, 20) is None and seed_spread(settings, LM, None) is None


def test_a_recorded_spread_is_read_only_when_well_formed():
    assert recorded_spread({"spread": {"sd": 0.03, "source": "page"}}) == Spread(0.03, "page")
    for bad in (
        {},
        {"spread": 0.03},
        {"spread": {"sd": "x"}},
        {"spread": {"sd": -1}},
        {"spread": {"sd": float("nan")}},
        {"spread": {"sd": True}},
        {"spread": ["sd", 0.03]},
    ):
        assert recorded_spread(bad) is None, bad
