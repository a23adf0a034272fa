"""What `wansync plan` prints: one setting on one screen, or the large-scale table."""
from __future__ import annotations

import itertools
from typing import Any

from ..errors import ConfigError
from ..strategies import resolve_options
from ..net.link import PRESETS, parse_wan
from ..units import human_bytes, human_seconds
from .measure import measure_step_s, run_step_times
from .predict import Prediction, predict, recommend_h, setting
from .sizes import (ACCELERATORS_PER_WORKER, FLOPS_PER_ACCELERATOR, TOKENS_PER_WORKER_STEP, ModelSize,
                    flops_step_s, of_name, of_params)

TABLE_SIZES = (150e6, 1e9, 7e9, 70e9)
TABLE_WORKERS = (8, 64, 512)
TABLE_STRATEGIES = ("ddp", "diloco", "streaming", "cocodc")
TARGET_PCT = 10.0


def describe(p: Prediction, step_source: str, target_pct: float | None) -> str:
    s = p.setting
    knobs = ", ".join(f"{k}={v}" for k, v in s.options.items()) or "no options"
    lines = [
        f"plan: {s.strategy} ({knobs})",
        f"model: {s.size.name}, {s.size.params:,} parameters ({human_bytes(4 * s.size.sync_numel)} fp32 exchanged)",
        f"workers: {s.workers} x {s.ranks_per_worker} rank(s); link: {s.topology.describe()}",
        f"compute per step: {s.step_s:.4g} s ({step_source})",
        "stragglers: " + ("the run's, replayed: a worker that arrives early at an exchange waits for the last"
                          if s.step_times is not None else
                          "none (identical workers arrive at every exchange together; --step-times RUN "
                          "replays a run's ranks, stragglers included)"),
        f"wall clock per 1000 steps: {human_seconds(p.wall_per_1000_s)} "
        f"(compute alone {human_seconds(1000 * (s.step_s + s.other_s))})",
        f"exposed communication: {p.exposed_pct:.1f} % of the wall clock",
        f"bytes per worker per step: {human_bytes(p.bytes_per_step)} (payload; a ring all-reduce sends about "
        f"2(M-1)/M times it, an all-gather (M-1) times it)",
        f"peak extra memory per rank: {human_bytes(p.peak_extra_memory_bytes)}",
    ]
    if p.syncs_per_period is not None:
        lines.append(f"fragment syncs per period N: {p.syncs_per_period}")
    if target_pct is not None:
        h = recommend_h(s, target_pct)
        if "sync_every" not in s.options:
            lines.append(f"{s.strategy} has no period H to tune")
        else:
            lines.append(f"smallest H (sync_every) with exposed communication <= {target_pct:g} %: "
                         + (str(h) if h is not None else "none up to 5000"))
    return "\n".join(lines)


def plan_command(cfg: Any, *, params: float | None, step_s: float | None,
                 measure: bool, target_pct: float | None, tokens_per_step: float | None,
                 flops: float, step_times: str | None = None) -> str:
    """The one-screen answer for a Config (strategy, options, model, workers, wan) and the plan flags."""
    if not cfg.wan:
        raise ConfigError("plan needs a link: --wan PRESET or a spec (" + ", ".join(PRESETS) + ")")
    ranks_per_worker = cfg.ranks_per_worker             # >= 1: a config rule
    vocab = cfg.bpe_vocab if cfg.tokenizer == "bpe" else 256
    size: ModelSize = of_params(params) if params is not None else of_name(cfg.model, vocab)
    replay, other_s = None, 0.0
    if step_times is not None:
        if step_s is not None or measure:
            raise ConfigError("give one of --step-time, --measure and --step-times")
        if ranks_per_worker != 1:
            raise ConfigError("--step-times replays one rank per worker; it cannot take --ranks-per-worker")
        replay = run_step_times(step_times)
        step_s = sum(c for c, _ in replay[0]) / len(replay[0])
        other_s = sum(o for _, o in replay[0]) / len(replay[0])
        source = (f"mean of rank 0's; replayed step by step from {step_times}: {len(replay)} rank(s), "
                  f"{len(replay[0])} steps each, worker w taking rank w mod {len(replay)}")
    elif step_s is not None:
        if not step_s > 0:
            raise ConfigError(f"--step-time must be > 0 seconds, got {step_s}")
        source = "given"
    elif measure:
        if params is not None:
            raise ConfigError("--measure needs a named --model, not --params")
        step_s, source = measure_step_s(cfg), "measured on this machine, one process"
    else:
        tokens = tokens_per_step if tokens_per_step is not None else cfg.batch_size * cfg.seq_len
        step_s = flops_step_s(size.params, tokens, ranks_per_worker, flops)
        source = (f"FLOPs rule 6*N*tokens/throughput: {tokens:,.0f} tokens per worker step, "
                  f"{ranks_per_worker} accelerator(s) at {flops / 1e12:g} TFLOP/s")
    options = resolve_options(cfg.strategy, vars(cfg))
    s = setting(cfg.strategy, options, size, cfg.workers, parse_wan(cfg.wan), step_s,
                ranks_per_worker=ranks_per_worker, other_s=other_s, step_times=replay)
    return describe(predict(s), source, target_pct)


def large_table(target_pct: float = TARGET_PCT) -> str:
    """150M-70B parameters x 8/64/512 workers x the four presets x ddp/diloco/streaming/cocodc, every
    strategy at its defaults, step time from the FLOPs rule (sizes.py)."""
    head = ("| params | workers | link | strategy | step (s) | wall / 1000 steps | exposed % | bytes/worker/step "
            f"| peak extra mem | smallest H for <= {target_pct:g}% |")
    out = [head, "|" + "---|" * 10]
    for n, m, link, name in itertools.product(TABLE_SIZES, TABLE_WORKERS, PRESETS, TABLE_STRATEGIES):
        size = of_params(n)
        step = flops_step_s(n)
        s = setting(name, {}, size, m, PRESETS[link], step, ranks_per_worker=ACCELERATORS_PER_WORKER)
        p = predict(s)
        h = recommend_h(s, target_pct) if name != "ddp" else None
        out.append(f"| {size.name} | {m} | {link} | {name} | {step:.3g} | {human_seconds(p.wall_per_1000_s)} "
                   f"| {p.exposed_pct:.1f} | {human_bytes(p.bytes_per_step)} | "
                   f"{human_bytes(p.peak_extra_memory_bytes)} | {'-' if name == 'ddp' else (h or '> 5000')} |")
    return "\n".join(out)


def table_preamble() -> str:
    return (f"step time = 6*N*{TOKENS_PER_WORKER_STEP:,} tokens per worker step / ({ACCELERATORS_PER_WORKER} "
            f"accelerators x {FLOPS_PER_ACCELERATOR / 1e12:g} TFLOP/s); {ACCELERATORS_PER_WORKER} ranks per worker; "
            "strategies at their defaults; steady state (see docs/planner.md)")


