"""Regime guards: each fires on its bad setting, and none fires on a preset or the demo."""

import pytest

from wansync.runner import demo, experiments
from wansync.cli import DEMO_STEPS
from wansync.config import build_config
from wansync.strategies.guards import outer_step_interval, regime_warnings
from wansync.presets import PRESETS, layered_config
from wansync.strategies import resolve_options


def warnings_for(strategy: str, **values) -> list[str]:
    cfg = build_config(overrides={"strategy": strategy, **values})
    return regime_warnings(strategy, resolve_options(strategy, vars(cfg)))


@pytest.mark.parametrize("strategy", ["diloco", "streaming", "cocodc"])
def test_outer_nesterov_on_a_short_interval_is_warned_about(strategy):
    [line] = (
        [w for w in warnings_for(strategy, sync_every=8, overlap=1) if "Nesterov" in w]
        if strategy != "diloco"
        else warnings_for(strategy, sync_every=8)
    )
    assert line.startswith(f"{strategy}: outer Nesterov momentum 0.9") and "\n" not in line
    assert (
        warnings_for(strategy, sync_every=8, outer_momentum=0.0, **({} if strategy == "diloco" else {"overlap": 1}))
        == []
    )


def test_the_outer_step_interval_is_per_fragment():
    assert outer_step_interval("diloco", {"sync_every": 30, "outer_momentum": 0.9}) == 30
    streaming = {"sync_every": 100, "fragments": 4, "syncs_per_period": 0, "outer_momentum": 0.9}
    assert outer_step_interval("streaming", streaming) == 100
    assert outer_step_interval("streaming", {**streaming, "syncs_per_period": 8}) == 50
    assert outer_step_interval("cocodc", {**streaming, "max_syncs_per_fragment": 2}) == 50  # automatic N <= 2P
    assert outer_step_interval("local_sgd", {"sync_every": 8}) is None


def test_an_overlap_close_to_the_fragment_interval_is_warned_about():
    [line] = warnings_for("streaming", sync_every=30, overlap=27)
    assert line.startswith("streaming: --overlap 27 is 90% of a fragment's sync interval")
    assert warnings_for("streaming", sync_every=30, overlap=3) == []


@pytest.mark.parametrize("strategy", ["slowmo", "cpdp"])
def test_a_slowmo_gain_above_five_is_warned_about(strategy):
    [line] = warnings_for(strategy, slowmo_beta=0.9)
    assert line.startswith(f"{strategy}: SlowMo gain") and "= 10 (> 5)" in line
    assert warnings_for(strategy, slowmo_beta=0.8) == []  # gain 5: the edge, inside
    assert warnings_for(strategy, slowmo_beta=0.5, slowmo_lr=3.0) != []  # the gain, not beta alone


# The one preset cell outside a regime on purpose: the CPDP paper's beta = 0.9 collapse (gain 10).
DELIBERATE = {("cpdp-beta", "cpdp", 0.9)}


@pytest.mark.parametrize("name", list(PRESETS))
def test_no_preset_setting_triggers_a_guard(name):
    preset = PRESETS[name]
    cells = list(preset.runs) or [{"strategy": s} for s in preset.strategies]
    for cell in cells:
        cfg = layered_config({**preset.values, **cell}, None, {})
        found = regime_warnings(cfg.strategy, resolve_options(cfg.strategy, vars(cfg)), steps=cfg.steps)
        assert bool(found) == ((name, cfg.strategy, cell.get("slowmo_beta")) in DELIBERATE), (cell, found)


def test_no_demo_setting_triggers_a_guard(tmp_path):
    base = demo.demo_config(DEMO_STEPS, str(tmp_path))
    for cell in demo.demo_cells(experiments.available_strategies()):
        values = {**vars(base), **cell}
        found = regime_warnings(cell["strategy"], resolve_options(cell["strategy"], values), steps=values["steps"])
        assert found == [], (cell, found)


def test_a_sparse_exchange_that_cannot_send_the_model_within_the_run_is_warned_about_in_the_callers_words():
    """SparseLoCo's default density over one round of a 40-step run sends 0.8 % of each chunk's values."""
    options = resolve_options("sparseloco", {})
    [line] = regime_warnings("sparseloco", options, steps=40)
    assert line.startswith("sparseloco: --density 0.00781 over the 1 round(s) of this 40-step run sends at most 0.8%")
    assert "raise --density to 0.2 or more" in line and "\n" not in line
    [python] = regime_warnings("sparseloco", options, steps=40, python=True)
    assert python.startswith("sparseloco: density 0.00781") and "raise density to" in python and "--" not in python
    assert regime_warnings("sparseloco", options) == []  # the length unknown (ws.strategy): no guess
    assert regime_warnings("sparseloco", {**options, "sync_every": 10}, steps=300) == []  # the demo's: 30 rounds, 23 %
    assert regime_warnings("sparseloco", {**options, "density": 0.1}, steps=59) != []  # one round at 10 %
    assert regime_warnings("sparseloco", {**options, "density": 0.1}, steps=60) == []  # two: 20 %, the edge
    demo_options = resolve_options("demo", {})
    assert (
        regime_warnings("demo", demo_options, steps=20) != [] and regime_warnings("demo", demo_options, steps=300) == []
    )
    [nesterov] = regime_warnings("diloco", resolve_options("diloco", {"sync_every": 8}), python=True)
    assert "raise sync_every or set outer_momentum=0" in nesterov
