"""`wansync demo`: what the choice of strategy is worth where communication matters.

Every available strategy trains the tiny LM (bundled Shakespeare) on 2 local workers behind the
emulated `cross-region` link (100 ms RTT, 1 Gbit/s: one all-reduce of the model costs about as much
as a training step, so DDP spends about half its wall clock communicating). Each strategy runs at
settings inside its working regime (`SETTINGS`: none trips a regime guard, `guards.py`), then the
report leads with the decision figures and ends with one computed sentence (`verdict.py`).
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

from . import experiments, grid
from ..config import Config, build_config
from ..errors import ConfigError

WAN = "cross-region"
WORKERS = 2
# Per strategy, settings from its paper's working regime, scaled to a 300-step run: averaging every
# 25 steps for the plain periodic methods, CPDP at the paper's K = 4, the outer-Nesterov methods at
# H = 50 (the guard wants >= 25 steps between two outer steps on the same parameters; cocodc may sync
# a fragment twice per period), two fragments with an overlap of 5 steps for the streaming ones;
# SparseLoCo at H = 10 (30 rounds: its error feedback pays back over many), DeMo at its defaults.
SETTINGS = MappingProxyType(
    {
        "ddp": {},
        "local_sgd": {"sync_every": 25},
        "post_local_sgd": {"sync_every": 25, "switch_step": 50},
        "slowmo": {"sync_every": 25},
        "cpdp": {"sync_every": 4},
        "diloco": {"sync_every": 50},
        "streaming": {"sync_every": 50, "fragments": 2, "overlap": 5},
        "cocodc": {"sync_every": 50, "fragments": 2, "overlap": 5},
        "sparseloco": {"sync_every": 10},  # many rounds: its error feedback sends a little every time
        "demo": {},
        "async_diloco": {"sync_every": 50},  # DiLoCo's H; at equal speeds it merges both learners per round
    }
)
STEPS = 300
# How far seeds alone move one run's validation loss at equal wall clock on this workload: the pooled
# standard deviation over the 3 seeds of each of the 7 cells of the results page's sparse-demo table
# (docs/results.md, 2026-12-05; tests/test_demo_verdict.py recomputes it from the page). The demo runs
# one seed each, so its verdict calls leaders closer than this allows too close to call.
SPREAD = MappingProxyType({"sd": 0.0457, "source": "seeds measured on the results page's sparse-demo table"})


def demo_values(steps: int = STEPS) -> dict:
    """The demo's workload: what every strategy trains on (the results page's sparse tables too)."""
    return {
        "model": "tiny",
        "workers": WORKERS,
        "batch_size": 8,
        "seq_len": 64,
        "threads": 1,
        "steps": steps,
        "eval_every": max(1, steps // 12),
        "eval_batches": 4,
        "warmup_steps": min(20, steps // 5),
        "wan": WAN,
    }


def demo_config(steps: int, out: str) -> Config:
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    return build_config(overrides={**demo_values(steps), "out": out})


def demo_cells(strategies: list[str]) -> list[dict]:
    """One run per strategy, at its demo settings (a strategy added later runs at its defaults)."""
    return [{"strategy": s, **SETTINGS.get(s, {})} for s in strategies]


def run_demo(out: str, steps: int, force: bool) -> int:
    """Plan, train and report the demo; prints what it does."""
    strategies = grid.available_strategies()
    base = demo_config(steps, out)
    print(
        f"demo: {', '.join(strategies)} on the tiny LM (Shakespeare), {WORKERS} workers, link {WAN} "
        f"(100 ms RTT, 1 Gbit/s), {steps} steps; runs in {out}"
    )
    specs = experiments.grid_runs(base, strategies, 1, None, Path(out), cells=demo_cells(strategies))
    return experiments.run_and_report(
        specs, Path(out), force, 1, None, None, target_rule="common", extra={"spread": dict(SPREAD)}
    )
