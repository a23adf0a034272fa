"""The `diverged` flag: one rule over the evaluation records (divergence.py), carried by summary.json,
the report and the runner's printout."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from wansync.analysis import report as R
from wansync.rundir.divergence import chance_level, diverged, warning
from test_report import fake_run

BYTES = math.log(256)  # byte-level chance, 5.545 nats


def evals_of(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "eval"]


def test_a_synthetic_diverging_metrics_file_is_flagged_and_a_converging_one_is_not(tmp_path):
    up = fake_run(tmp_path / "up", "cocodc", 1, [3.58, 4.2, 5.45])  # the CoCoDC run
    down = fake_run(tmp_path / "down", "diloco", 1, [3.58, 3.1, 2.9])
    assert diverged(evals_of(up / "metrics.jsonl"), BYTES)
    assert not diverged(evals_of(down / "metrics.jsonl"), BYTES)


def test_ending_at_chance_or_not_finite_is_diverged_even_below_the_first_evaluation():
    assert diverged([{"val_loss": 6.0}, {"val_loss": 5.6}], BYTES)
    assert diverged([{"val_loss": 3.0}, {"val_loss": float("nan")}], BYTES)
    assert not diverged([{"val_loss": 5.0}], BYTES)  # one evaluation: chance only
    assert not diverged([], BYTES)


def test_vision_judges_accuracy_against_the_first_evaluation_and_chance():
    assert chance_level({"classes": 10}) == 10.0 and chance_level({"vocab": 256}) == BYTES
    assert chance_level({}) is None
    assert diverged([{"test_acc": 60.0}, {"test_acc": 40.0}], 10.0)
    assert diverged([{"test_acc": 8.0}, {"test_acc": 9.5}], 10.0)
    assert not diverged([{"test_acc": 60.0}, {"test_acc": 80.0}], 10.0)


def test_the_report_marks_a_diverged_setting_and_run(tmp_path):
    root = tmp_path / "exp"
    fake_run(root / "cocodc" / "seed0", "cocodc", 0, [3.58, 3.2, 3.0])
    fake_run(root / "cocodc" / "seed1", "cocodc", 1, [3.58, 4.2, 5.45])  # no flag in summary: the rule
    fake_run(root / "diloco" / "seed0", "diloco", 0, [3.58, 3.1, 2.9])
    rep = R.report(root, plots=False)
    with open(root / "summary.csv", newline="") as f:
        rows = {r["setting"]: r for r in csv.DictReader(f)}
    assert rows["cocodc"]["status"] == "diverged (1/2 seeds)" and rows["cocodc"]["diverged"] == "1"
    assert rows["diloco"]["status"] == "ok" and rows["diloco"]["diverged"] == "0"
    with open(root / "runs.csv", newline="") as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["ok", "diverged", "ok"]
    text = rep.path.read_text()
    assert "## Diverged runs" in text and "`cocodc` seed 1: first 3.58, final 5.45" in text


def test_the_warning_is_one_line():
    line = warning({"final_val_loss": 5.45, "first_eval": 3.58, "chance_level": BYTES, "diverged": True})
    assert "\n" not in line and line.startswith("wansync: warning: the run diverged")
