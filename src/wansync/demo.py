"""`wansync demo`: every available strategy side by side on the tiny LM (bundled Shakespeare), 4 local
workers, on the emulated two-site link (16.6 ms RTT, the CPDP paper's setting), then the report."""
from __future__ import annotations

from pathlib import Path

from . import experiments
from .config import Config, build_config, replace
from .errors import ConfigError, WansyncError
from .strategies import option_names, resolve_options

WAN = "two-site"
# Periods H to try, smallest first: the demo uses the smallest one every periodic strategy accepts.
SYNC_EVERY_CHOICES = (8, 10, 12, 16, 20, 24, 25, 30, 40, 50)


def demo_config(steps: int, out: str) -> Config:
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    return build_config(overrides={"model": "tiny", "workers": 4, "batch_size": 8, "seq_len": 64, "threads": 1,
                                   "steps": steps, "eval_every": max(1, steps // 6), "eval_batches": 4,
                                   "warmup_steps": min(20, steps // 5), "wan": WAN, "out": out,
                                   # overlapped strategies: one step of overlap fits the short period
                                   # (tau < H/P); strategies without the knob ignore it
                                   "overlap": 1})


def common_sync_every(base: Config, strategies: list[str]) -> int | None:
    """The smallest H every periodic strategy accepts with its other knobs at their defaults."""
    periodic = [s for s in strategies if "sync_every" in option_names(s)]
    for h in SYNC_EVERY_CHOICES:
        try:
            for s in periodic:
                resolve_options(s, {**vars(base), "sync_every": h})
            return h
        except WansyncError:
            continue
    return None


def run_demo(out: str, steps: int, force: bool) -> int:
    """Plan, train and report the demo; prints what it does."""
    strategies = experiments.available_strategies()
    base = demo_config(steps, out)
    h = common_sync_every(base, strategies)
    if h is not None:
        base = replace(base, sync_every=h)
    print(f"demo: {', '.join(strategies)} on the tiny LM (Shakespeare), 4 workers, link {WAN}, {steps} steps"
          + (f", sync_every {h}" if h else "") + f"; runs in {out}")
    specs = experiments.plan(base, strategies, 1, None, Path(out))
    return experiments.run_and_report(specs, Path(out), force, 1, None, None)
