"""Options of SlowMo, CPDP, DiLoCo and post-local SGD: defaults, one-line errors, the CLI."""

from __future__ import annotations

import json

import pytest

from cli_harness import TINY, wansync
from wansync.errors import ConfigError
from wansync.strategies import STRATEGIES, make_options, option_names
from wansync.config import key_names

pytestmark = pytest.mark.timeout(180)

MINE = ("slowmo", "cpdp", "diloco", "post_local_sgd")


PACE = {"slow_policy": "wait", "deadline": 0.0}  # workers of different speeds (`strategies.pace`)
ROBUST = {"robust_mean": "off", "robust_kappa": 2.0}  # the robust mean of pseudo-gradients (`comm.robust`)


def test_registered_with_spec_defaults():
    assert set(MINE) <= set(STRATEGIES)
    outer = {"outer_state_device": "model", **PACE, **ROBUST}
    assert vars(make_options("slowmo")) == {
        "sync_every": 8,
        "slowmo_beta": 0.5,
        "slowmo_lr": 1.0,
        "sync_optimizer_state": False,
        "drift_telemetry": True,
        "codec": "fp32",
        "codec_collective": "auto",
        "error_feedback": False,
        **outer,
    }
    assert vars(make_options("cpdp")) == {
        "sync_every": 4,
        "slowmo_beta": 0.3,
        "slowmo_lr": 1.0,
        "grad_phase": True,
        "sync_optimizer_state": False,
        "drift_telemetry": True,
        "codec": "fp32",
        "codec_collective": "auto",
        "error_feedback": False,
        **outer,
    }
    assert vars(make_options("diloco")) == {
        "sync_every": 100,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "sync_optimizer_state": False,
        "drift_telemetry": True,
        "codec": "fp32",
        "codec_collective": "auto",
        "error_feedback": False,
        **outer,
        "overlap_rounds": False,
    }
    assert vars(make_options("post_local_sgd")) == {
        "sync_every": 8,
        "switch_step": 100,
        "sync_optimizer_state": False,
        "drift_telemetry": True,
        "codec": "fp32",
        "codec_collective": "auto",
        "error_feedback": False,
        **PACE,
        **ROBUST,
    }


@pytest.mark.parametrize("name", MINE)
def test_every_option_is_a_config_key(name):
    assert set(option_names(name)) <= set(key_names())
    assert "sync_optimizer_state" in option_names(name) and "drift_telemetry" in option_names(name)


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("slowmo", {"sync_every": 0}, "sync_every must be >= 1, got 0"),
        ("cpdp", {"sync_every": 0}, "sync_every must be >= 1, got 0"),
        ("diloco", {"sync_every": -3}, "sync_every must be >= 1, got -3"),
        ("post_local_sgd", {"sync_every": 0}, "sync_every must be >= 1, got 0"),
        ("slowmo", {"slowmo_beta": 1.0}, "slowmo_beta must be in [0, 1), got 1.0"),
        ("cpdp", {"slowmo_beta": -0.1}, "slowmo_beta must be in [0, 1), got -0.1"),
        ("cpdp", {"slowmo_beta": 1.0}, "slowmo_beta must be in [0, 1), got 1.0"),
        ("slowmo", {"slowmo_lr": 0.0}, "slowmo_lr must be > 0, got 0.0"),
        ("cpdp", {"slowmo_lr": -1.0}, "slowmo_lr must be > 0, got -1.0"),
        ("diloco", {"outer_lr": 0.0}, "outer_lr must be > 0, got 0.0"),
        ("diloco", {"outer_momentum": 1.0}, "outer_momentum must be in [0, 1), got 1.0"),
        ("post_local_sgd", {"switch_step": -1}, "switch_step must be >= 0, got -1"),
        ("cpdp", {"outer_lr": 0.5}, "strategy cpdp has no option 'outer_lr'"),
    ],
)
def test_bad_options_are_one_line_config_errors(name, options, message):
    with pytest.raises(ConfigError) as e:
        make_options(name, **options)
    assert str(e.value) == message or message in str(e.value)
    assert "\n" not in str(e.value)


def test_cli_bad_beta_is_one_line_and_nonzero(tmp_path):
    r = wansync("train", "--strategy", "cpdp", "--slowmo-beta", "1.0", "--out", str(tmp_path / "run"), timeout=60)
    assert r.returncode != 0
    assert "slowmo_beta must be in [0, 1), got 1.0" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_cli_cpdp_run_without_gradient_phase_and_with_optimizer_state_sync(tmp_path):
    out = tmp_path / "run"
    r = wansync(
        "train",
        "--strategy",
        "cpdp",
        "--workers",
        "2",
        "--steps",
        "8",
        "--sync-every",
        "4",
        "--slowmo-beta",
        "0.3",
        "--slowmo-lr",
        "1",
        "--no-grad-phase",
        "--sync-optimizer-state",
        "--eval-every",
        "8",
        "--out",
        str(out),
        *TINY,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["options"] == {
        "sync_every": 4,
        "slowmo_beta": 0.3,
        "slowmo_lr": 1.0,
        "grad_phase": False,
        "sync_optimizer_state": True,
        "drift_telemetry": True,
        "codec": "fp32",
        "codec_collective": "auto",
        "error_feedback": False,
        "outer_state_device": "model",
        **PACE,
        **ROBUST,
    }
    assert summary["sync_events"] == 2 and "grads" not in summary["comm"]
    assert summary["comm"]["params"]["calls"] == 2 and summary["comm"]["optim_state"]["calls"] == 2
    syncs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    syncs = [s for s in syncs if s["type"] == "sync"]
    assert [s["step"] for s in syncs] == [4, 8] and syncs[1]["drift"] > 0 and not any(s["grad_phase"] for s in syncs)
