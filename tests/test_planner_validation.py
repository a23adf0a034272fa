"""benchmarks/planner_validation.py's grid: what the validation runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from wansync.net.wan import PRESETS
from wansync.strategies import STRATEGIES

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "planner_validation.py"


@pytest.fixture(scope="module")
def validation():
    spec = importlib.util.spec_from_file_location("planner_validation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_default_subset_covers_every_preset_and_every_strategy(validation):
    rows = validation.grid(False)
    assert {p for _, _, p, _ in rows} == set(PRESETS)
    assert {s for _, _, _, s in rows} == set(STRATEGIES)
    assert set(validation.KNOBS) == set(STRATEGIES)


def test_the_full_grid_is_tiny_and_small_by_two_four_eight_workers_by_every_preset_and_strategy(validation):
    rows = validation.grid(True)
    assert len(rows) == 2 * 3 * len(PRESETS) * len(STRATEGIES) == len(set(rows))
    assert validation.grid(False, models="small", workers="8", presets="lan", strategies="ddp,diloco") == [
        ("small", 8, "lan", "ddp"),
        ("small", 8, "lan", "diloco"),
    ]
