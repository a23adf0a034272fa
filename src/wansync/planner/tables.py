"""What `wansync plan` prints: one setting on one screen, or strategies ranked at their best settings
(`choose.py`). The large-scale table, `plan --table`, is `scale_table.py`'s."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any, Sequence

from ..errors import ConfigError
from ..strategies import make_options, resolve_options
from ..net.wan import PRESETS, parse_wan
from ..units import human_bytes, human_seconds
from ..telemetry.memory import CATEGORIES
from .asynchronous import is_asynchronous
from .choose import CODECS, TARGET_PCT, Choice, choose, rank
from .measure import measure_step_s, run_step_times
from .memory import parse_capacity, smallest_fitting_ranks
from .prediction import H_CANDIDATES, AsyncPrediction, Prediction, Setting, periods, predict, recommend_h, setting
from .sizes import (
    FLOPS_PER_ACCELERATOR,
    ModelSize,
    flops_step_s,
    of_name,
    of_params,
    tokens_per_step as tokens_rule,
)


def algorithm_lines(s: Any) -> list[str]:
    """How an fp32 mean between workers crosses a topology of several sites: flat or by sites, the
    cost model's choice (`net.cost.allreduce_algorithm`), which the exchange makes too."""
    from ..net.cost import collective_duration, hierarchical_seconds

    r = s.ranks_per_worker
    if s.topology.sites < 2 or s.options.get("codec", "fp32") != "fp32" or s.strategy in ("ddp", "demo", "sparseloco"):
        return []
    if is_asynchronous(s.strategy):  # no mean between workers: messages to the syncer
        return []
    nbytes = 4 * s.size.sync_numel / max(1, int(s.options.get("fragments") or 1)) / r
    placed, world = dataclasses.replace(s.topology, ranks_per_worker=r), s.workers * r
    members = range(0, world, r)
    flat = collective_duration("allreduce", nbytes, world, placed, members, r)
    sites = hierarchical_seconds(nbytes, world, placed, members, r)
    chosen = "by sites (inside each, then between them, then back)" if sites < flat else "flat (one ring)"
    return [
        f"mean between workers: {chosen}: {human_seconds(min(flat, sites))} per exchange "
        f"(flat {human_seconds(flat)}, by sites {human_seconds(sites)})"
    ]


def straggler_words(s: Any) -> str:
    """Who arrives late at the exchanges, and what the slow policy does about it."""
    if is_asynchronous(s.strategy):
        return async_straggler_words(s)
    if s.step_times is not None:
        return "the run's, replayed: a worker that arrives early at an exchange waits for the last"
    if s.topology.speeds and s.topology.workers == s.workers:
        policy = s.options.get("slow_policy", "wait")
        what = {
            "wait": "the others wait for the slowest at each exchange",
            "balanced": "each computes its share of every round (slow_policy balanced)",
            "deadline": "each computes the steps it finishes before the round's deadline (slow_policy deadline)",
        }
        return (
            f"the topology's worker speeds ({', '.join(f'{v:g}' for v in s.topology.speeds)}): "
            f"{what.get(policy, policy)}"
        )
    return (
        "none (identical workers arrive at every exchange together; --step-times RUN replays a run's ranks, "
        "stragglers included; a topology file's speeds too)"
    )


def async_straggler_words(s: Any) -> str:
    """An asynchronous run's learners (`asynchronous.py`): each on its own clock; when the syncer merges."""
    o = s.options
    if s.step_times is not None:
        clocks = "each replays the run's step times"
    elif s.topology.speeds and s.topology.workers == s.workers:
        steps = ", ".join(f"{s.step_s * s.topology.slowdown(w):.3g}" for w in range(s.workers))
        speeds = ", ".join(f"{v:g}" for v in s.topology.speeds)
        clocks = f"the topology's worker speeds ({speeds}): steps of {steps} s"
    else:
        clocks = "every one at the step time"
    grace = "every learner still running" if math.isinf(o["grace"]) else f"{o['grace']:g} s more"
    return (
        f"none wait for another: each learner on its own clock ({clocks}); the syncer merges once every learner "
        f"still running has sent a round, or once {o['merge_quorum']} have and then {grace} (merge_quorum, grace)"
    )


def setting_lines(s: Setting, step_source: str) -> list[str]:
    """The model, the world and its link, the compute per step and where it comes from, the stragglers."""
    return [
        f"model: {s.size.name}, {s.size.params:,} parameters ({human_bytes(4 * s.size.sync_numel)} fp32 exchanged)",
        f"workers: {s.workers} x {s.ranks_per_worker} rank(s); link: {s.topology.describe()}",
        f"compute per step: {s.step_s:.4g} s ({step_source})",
        "stragglers: " + straggler_words(s),
    ]


def figures_for(p: Prediction) -> str:
    """What the figures cover: a whole run, or a steady state per 1000 steps."""
    if isinstance(p, AsyncPrediction):
        if p.whole:
            return (
                f"of the whole run, {p.steps:,} steps (until the syncer has merged {p.setting.workers} learners x "
                f"{p.steps:,} steps, then every learner's final version)"
            )
        return "per 1000 steps (steady state: between the merges at 1/4 and 3/4 of a run's budget; --steps N for a whole run)"
    if p.whole:
        return f"of the whole run, {p.steps:,} step{'s' if p.steps > 1 else ''} (step 1 to finish()'s last exchange)"
    return "per 1000 steps (steady state, after the warm-up; --steps N for a whole run)"


def describe(
    p: Prediction, step_source: str, target_pct: float | None, capacity: float | None = None, stated: bool = False
) -> str:
    """One setting on one screen; `stated`: the capacity is the default, not given."""
    s = p.setting
    knobs = ", ".join(f"{k}={v}" for k, v in s.options.items()) or "no options"
    lines = [
        f"plan: {s.strategy} ({knobs})",
        *setting_lines(s, step_source),
        f"wall clock {figures_for(p)}: {human_seconds(p.wall_s)} "
        f"(compute alone {human_seconds(p.compute_s)}: {p.utilization_pct:.1f} % utilization)",
        f"exposed communication: {p.exposed_pct:.1f} % of the wall clock"
        + (" (of the learners' together: each waiting for a version)" if isinstance(p, AsyncPrediction) else ""),
        *(
            async_lines(p)
            if isinstance(p, AsyncPrediction)
            else [
                f"bytes per worker per step: {human_bytes(p.bytes_per_step)} payload, {human_bytes(p.sent_per_step)} "
                "put on the wire (a ring all-reduce sends about 2(M-1)/M of its payload, an all-gather M-1 payloads)"
            ]
        ),
        *memory_lines(p, capacity, stated),
    ]
    if p.syncs_per_period is not None:
        lines.append(f"fragment syncs per period N: {p.syncs_per_period}")
    lines += sparse_lines(s) + algorithm_lines(s)
    if target_pct is not None:
        h = recommend_h(s, target_pct, p.steps if p.whole else None)
        if "sync_every" not in s.options:
            lines.append(f"{s.strategy} has no period H to tune")
        else:
            lines.append(
                f"smallest H (sync_every) with exposed communication <= {target_pct:g} %: "
                + (str(h) if h is not None else f"none up to {(periods(p.steps if p.whole else None) or (0,))[-1]}")
            )
    return "\n".join(lines)


def async_lines(p: AsyncPrediction) -> list[str]:
    """An asynchronous run's own figures: each learner's utilization, the goodput, the merges'
    staleness, the syncer's idle share and the bytes of each learner (`asynchronous.py`)."""
    s, r, f = p.setting, p.result, p.figures
    o, m = s.options, s.workers
    over = "" if p.whole else f" (over a run of {r.run_steps:,} steps)"
    each = ", ".join(f"{i}: {u:.1f} %" for i, u in enumerate(f.utilization_pct))
    lost = []
    if r.dropped_steps:
        lost.append(f"{r.dropped_steps:,} steps dropped, more than max_staleness {o['max_staleness']} versions old")
    shares = ", ".join(f"{t}: {100 * v:.1f} %" for t, v in r.staleness_shares().items())
    contributions = sum(len(x.staleness) for x in r.merges)
    per = "run" if p.whole else "1000 steps"
    scale = 1.0 if p.whole else 1000 / f.steps
    return [
        f"learners' utilization (compute share of each one's wall clock): {f.learners_utilization_pct:.1f} % "
        f"together; learner {each}",
        f"steps computed per learner{over}: {', '.join(f'{x.steps:,}' for x in r.learners)} "
        f"({m} x {r.run_steps:,} = {m * r.run_steps:,} merged at least)",
        f"goodput{over}: {100 * r.goodput:.1f} % of the tokens computed were merged"
        + (f" ({'; '.join(lost)})" if lost else ""),
        f"staleness of the merged contributions{over}: {shares} ({contributions:,} contributions in "
        f"{len(r.merges):,} merges)",
        f"syncer{over}: idle {100 * r.syncer_idle():.1f} % of the wall clock (a merge's outer step taken as "
        "instantaneous; busy sending its merge's versions on rank 0's link)",
        f"bytes per learner per {per}, sent (contributions) / received (versions, the whole model in fp32): "
        + ", ".join(f"{i}: {human_bytes(a * scale)} / {human_bytes(b * scale)}" for i, (a, b) in enumerate(f.bytes)),
        f"bytes per worker per step: {human_bytes(p.bytes_per_step)} payload, sent to the syncer (a learner's ledger "
        "books its contributions; the versions it receives are booked nowhere)",
    ]


def sparse_lines(s: Any) -> list[str]:
    """A sparse exchange's payload and the workers up to which its all-gather beats a dense mean."""
    from ..comm.mean_cost import sparse_crossing
    from ..planner.schedule import planned_timetable, sparse_exchange

    sparse = sparse_exchange(s.strategy, planned_timetable(s.strategy, s.options), s.size)
    if sparse is None:
        return []
    codec, n = sparse[0], sparse[0].layout.numel
    if is_asynchronous(s.strategy):  # one learner's payload to the syncer, decoded there alone
        return [
            f"sparse payload: {human_bytes(codec.wire_bytes())} per contribution ({100 * codec.wire_bytes() / (4 * n):.2g} % "
            "of fp32), sent to the syncer beside the float buffers in fp32"
        ]
    cross = {d: sparse_crossing(codec, n, d) for d in ("fp32", "int8", "fp4")}
    return [
        f"sparse exchange: a payload of {human_bytes(codec.wire_bytes())} per worker ({100 * codec.wire_bytes() / (4 * n):.2g} % "
        f"of fp32), all-gathered: each rank receives M - 1 = {s.workers - 1} of them; it moves fewer bytes than fp32's "
        f"ring all-reduce while M < {cross['fp32']:.0f}, than int8's reduce-scatter while M < {cross['int8']:.0f}, "
        f"fp4's while M < {cross['fp4']:.0f}"
    ]


def memory_lines(p: Prediction, capacity: float | None, stated: bool = False) -> list[str]:
    """Rank 0's memory: held by category, the transient at an exchange, the peak; with `capacity`
    (`--gpu-memory`, or the default when `stated`) one line that says whether it fits, and what would."""
    s, m = p.setting, p.memory
    r = s.ranks_per_worker
    how = (
        "its learner and the syncer"
        if isinstance(p, AsyncPrediction)
        else f"FSDP inside: sharded over {r} ranks"
        if s.inside == "fsdp"
        else f"DDP inside: each of {r} ranks holds the whole model"
        if r > 1
        else "one rank per worker"
    )
    where = "the pending contributions, as received" if isinstance(p, AsyncPrediction) else "outer_state_device=cpu"
    host = f"; in host memory ({where}): {human_bytes(m['host'])}" if m["host"] else ""
    held = m["total"] - m["host"]
    lines = [
        f"memory per GPU (rank 0, {how}): {human_bytes(held)} held + {human_bytes(m['per_gpu'] - held)} "
        f"transient at an exchange = {human_bytes(m['per_gpu'])} at the peak (activations not included)",
        "  held: " + ", ".join(f"{c.replace('_', ' ')} {human_bytes(m[c])}" for c in CATEGORIES) + host,
    ]
    if capacity is not None:
        gpu = capacity_words(capacity, stated)
        if m["per_gpu"] <= capacity:
            lines.append(
                f"fits on {gpu}: {human_bytes(m['per_gpu'])} per GPU at the peak "
                f"({100 * m['per_gpu'] / capacity:.0f} %)"
            )
        else:
            lines.append(
                f"does not fit on {gpu}: {human_bytes(m['per_gpu'])} per GPU at the peak{fit_hint(p, capacity)}"
            )
    return lines


def capacity_words(capacity: float, stated: bool) -> str:
    """The accelerator's memory, and whether it is the default (`--gpu-memory` not given)."""
    return human_bytes(capacity) + (" (the default; --gpu-memory SIZE for another)" if stated else "")


def fit_hint(p: Prediction, capacity: float) -> str:
    """What would fit `capacity`: FSDP inside over enough ranks, and with the outer state in host memory."""
    s, flying = p.setting, p.timeline.held_in_flight
    if isinstance(p, AsyncPrediction):
        return "; async_diloco runs one rank per learner: no sharding inside a worker"
    r_fit = smallest_fitting_ranks(s, flying, capacity)
    hint = (
        f"; --inside fsdp fits from --ranks-per-worker {r_fit}"
        if r_fit
        else "; no --ranks-per-worker up to 1024 fits it with --inside fsdp"
    )
    if s.options.get("outer_state_device") == "model":
        on_host = dataclasses.replace(s, options={**s.options, "outer_state_device": "cpu"})
        r_host = smallest_fitting_ranks(on_host, flying, capacity)
        hint += f" ({r_host} with --outer-state-device cpu)" if r_host and r_host != r_fit else ""
    return hint


def check_same_model(run_dir: str, model: str, params: float | None) -> None:
    """A run's step times describe its own model: replaying them for another is refused in one line."""
    if params is not None:
        raise ConfigError("--step-times replays the run's own model; drop --params (or give --step-time)")
    try:
        ran = tomllib.loads((Path(run_dir) / "config.toml").read_text()).get("model", {}).get("model")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return  # run_step_times says what is wrong with the directory
    if ran is not None and ran != model:
        raise ConfigError(
            f"--step-times {run_dir} is a run of model {ran!r}, this plan is for {model!r}: pass "
            f"--model {ran}, or replay a run of {model}"
        )


def plan_command(
    cfg: Any,
    *,
    params: float | None,
    step_s: float | None,
    measure: bool,
    target_pct: float | None,
    tokens_per_step: float | None,
    flops: float | None = None,
    step_times: str | None = None,
    gpu_memory: str | None = None,
    steps: int | None = None,
    strategies: Sequence[str] | None = None,
    given: frozenset[str] = frozenset(),
    left_out: Sequence[str] = (),
) -> str:
    """The one-screen answer for a Config (strategy, options, model, workers, wan) and the plan flags
    (`flops` None: the throughput of the config's precision; `gpu_memory`: '80GB', the capacity check,
    DEFAULT_GPU_MEMORY when None; `steps`: a whole run of that many steps, else the steady state);
    with `strategies`, those strategies ranked, each at its best settings (`choose.py`), the knobs
    in `given` (the config keys the user gave) kept as given; `left_out`: why each strategy `all` named
    and this world cannot run is not ranked (one sentence each, said under the table)."""
    capacity = parse_capacity(gpu_memory)
    if not cfg.wan:
        raise ConfigError("plan needs a link: --wan PRESET or a spec (" + ", ".join(PRESETS) + ")")
    ranks_per_worker = cfg.ranks_per_worker  # >= 1: a config rule
    vocab = cfg.bpe_vocab if cfg.tokenizer == "bpe" else 256
    size: ModelSize = of_params(params) if params is not None else of_name(cfg.model, vocab)
    replay, other_s = None, 0.0
    if step_times is not None:
        if step_s is not None or measure:
            raise ConfigError("give one of --step-time, --measure and --step-times")
        if ranks_per_worker != 1:
            raise ConfigError("--step-times replays one rank per worker; it cannot take --ranks-per-worker")
        check_same_model(step_times, cfg.model, params)
        replay = run_step_times(step_times)
        step_s = sum(c for c, _ in replay[0]) / len(replay[0])
        other_s = sum(o for _, o in replay[0]) / len(replay[0])
        source = (
            f"mean of rank 0's; replayed step by step from {step_times}: {len(replay)} rank(s), "
            f"{len(replay[0])} steps each, worker w taking rank w mod {len(replay)}"
        )
    elif step_s is not None:
        if not step_s > 0:
            raise ConfigError(f"--step-time must be > 0 seconds, got {step_s}")
        source = "given"
    elif measure:
        if params is not None:
            raise ConfigError("--measure needs a named --model, not --params")
        step_s, source = measure_step_s(cfg), "measured on this machine, one process"
    else:
        tokens, why = tokens_rule(
            ranks_per_worker,
            cfg.batch_size,
            cfg.seq_len,
            bare=params is not None,
            given=set(given),
            tokens=tokens_per_step,
        )
        rate_given = flops is not None
        flops = flops if rate_given else FLOPS_PER_ACCELERATOR[cfg.precision]
        step_s = flops_step_s(size.params, tokens, ranks_per_worker, flops)
        source = (
            f"FLOPs rule 6*N*tokens/throughput: {tokens:,.0f} tokens per worker step ({why}), "
            f"{ranks_per_worker} accelerator(s) at {flops / 1e12:g} TFLOP/s"
            + ("" if rate_given else f" ({cfg.precision}; --throughput to change it)")
        )
    topology = parse_wan(cfg.wan)
    topology.check_workers(cfg.workers)  # `train` refuses more sites than workers: so does its plan

    def of(name: str) -> Setting:
        return setting(
            name,
            resolve_options(name, vars(cfg)),
            size,
            cfg.workers,
            topology,
            step_s,
            ranks_per_worker=ranks_per_worker,
            other_s=other_s,
            step_times=replay,
            inside=cfg.inside,
            optimizer=cfg.optimizer,
            momentum=cfg.momentum,
        )

    def ranked(name: str) -> Setting:
        try:
            return of(name)
        except ConfigError as e:  # an option given for all of them that this one cannot take
            raise ConfigError(f"plan --strategies: {name}: {e}") from None

    stated = gpu_memory is None
    if strategies is None:
        p = predict(of(cfg.strategy), steps, finish=steps is not None)
        return describe(p, source, target_pct, capacity, stated)
    target = target_pct if target_pct is not None else TARGET_PCT
    settings = [ranked(name) for name in strategies]  # every one checked before any is searched
    choices = rank([choose(s, capacity, target, steps, given) for s in settings])
    return describe_ranking(choices, source, target, capacity, stated, left_out)


def describe_ranking(
    choices: list[Choice],
    step_source: str,
    target_pct: float,
    capacity: float,
    stated: bool,
    left_out: Sequence[str] = (),
) -> str:
    """Strategies ranked at their chosen settings: one table, the rule that chose and ranked them above it."""
    first = choices[0].prediction
    lock_step = next((c.prediction for c in choices if not isinstance(c.prediction, AsyncPrediction)), first)
    searched = sorted({k for c in choices for k in c.searched})
    rule = []
    if "sync_every" in searched:
        rule.append(
            f"the smallest H (sync_every) whose exposed communication stays <= {target_pct:g} % "
            f"(--target-exposed), of {', '.join(map(str, H_CANDIDATES[:3]))}, ... {H_CANDIDATES[-1]}"
            + (f" up to steps / 2 = {first.steps // 2}" if first.whole else "")
        )
    if "codec" in searched:
        rule.append(f"then the codec that loses least ({', '.join(CODECS)})")
    if "inside" in searched:
        rule.append("DDP inside a worker where it fits, else FSDP")
    rule += ["a knob you give is kept", "short of the target, the least exposed"] if rule else ["as given"]
    head = [
        f"plan: {len(choices)} {'strategies' if len(choices) > 1 else 'strategy'} ranked by predicted utilization "
        f"(compute alone / wall clock) at each one's chosen settings, those that fit {human_bytes(capacity)} per "
        "GPU first",
        *setting_lines(first.setting, step_source),
        f"GPU memory: {capacity_words(capacity, stated)}",
        "settings: " + "; ".join(rule),
        f"figures: wall clock {figures_for(lock_step)}; bytes per worker per step; memory per GPU at the peak",
        "",
        "| rank | strategy | settings | utilization | exposed | wall clock | bytes/worker/step | memory/GPU | "
        f"fits {human_bytes(capacity)} |",
        "|" + "---|" * 9,
    ]
    rows = []
    for i, c in enumerate(choices, 1):
        p = c.prediction
        fits = "yes" if c.fits else f"no{fit_hint(p, capacity)}"
        reached = "" if c.reached else f" (> {target_pct:g} %)"
        rows.append(
            f"| {i} | {c.strategy} | {settings_words(c)} | {p.utilization_pct:.1f} % | {p.exposed_pct:.1f} %{reached} "
            f"| {human_seconds(p.wall_s)} | {human_bytes(p.bytes_per_step)} | {human_bytes(p.memory['per_gpu'])} "
            f"| {fits} |"
        )
    tail = [
        "",
        "Time, bytes and memory are predicted; what a setting learns is not: a longer H, or a lossier codec, "
        "may need more steps to the same loss (docs/planner.md#ranking-strategies). "
        "`--strategy NAME` with these settings prints one in full.",
        *(f"Not ranked: {why}" for why in left_out),
    ]
    return "\n".join(head + rows + tail)


def _flag_value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


SETTING_KEYS = (
    "sync_every",
    "codec",
    "fragments",
    "overlap",
    "switch_step",
    "sparse",
    "density",
    "bits",
    "merge_quorum",
    "grace",
)


def settings_words(c: Choice) -> str:
    """The chosen setting as the flags that give it: the period and the codec, and the knobs that shape
    the exchange (fragments and overlap, post-local SGD's switch, a sparse payload's density and bits),
    those that act in it (async_diloco's codec or its sparse payload's knobs; a switch when on)."""
    s = c.prediction.setting
    opts = make_options(s.strategy, **s.options)
    acting = [k for k in SETTING_KEYS if k in s.options and s.options[k] is not False and opts.idle([k]) is None]
    flags = [
        f"--{k.replace('_', '-')}" + ("" if s.options[k] is True else f" {_flag_value(s.options[k])}") for k in acting
    ]
    if s.ranks_per_worker > 1:
        flags.append(f"--inside {s.inside}")
    return " ".join(flags) or "-"
