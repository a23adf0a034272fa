"""The decision figures and the one computed sentence, on synthetic runs."""
from __future__ import annotations

from pathlib import Path

from wansync.analysis.runs import LM, Run, SettingRuns
from wansync.analysis.verdict import decision_rows, decision_table, equal_time, value_at, verdict


def run(strategy: str, curve: list[tuple[float, float]], wall: float) -> SettingRuns:
    evals = [{"type": "eval", "step": 10 * (i + 1), "time": t, "val_loss": v} for i, (t, v) in enumerate(curve)]
    summary = {"wall_clock_s": wall, "exposed_comm_pct": 50.0 if strategy == "ddp" else 5.0, "bytes_sent": 1e6}
    return SettingRuns(strategy, strategy, {}, [Run(Path(strategy), strategy, strategy, 0, {}, "ok", summary, {}, evals)])


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
    text = verdict(rows, LM, 2.2, "given", "cross-region", 20)
    assert text == ("On the cross-region link, diloco had the best validation loss at equal wall clock (2.1000 after "
                    "20 s); it also reached the target validation loss 2.2000 (given) first, after 20 s, 2.0x sooner "
                    "than DDP.")
    table = decision_table(rows, LM, 20)
    assert table.splitlines()[0].startswith("| setting | validation loss at 20 s | time to target (s)")


def test_a_target_nobody_reaches_is_said():
    rows = decision_rows([DDP, DILOCO], LM, 1.0)
    assert "no setting reached the target" in verdict(rows, LM, 1.0, "given", "lan", 20)
    assert "not reached (0/1)" in decision_table(rows, LM, 20)
