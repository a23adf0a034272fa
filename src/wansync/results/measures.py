"""Reading the tables' runs back: the metrics a table reports per run and their interval over seeds."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from ..analysis.report import exposed_pct, group, peer_wait_pct
from ..analysis.run_dirs import ReportError, find_runs
from ..analysis.runs import Run, SettingRuns, number
from ..analysis.stats import Interval, interval
from ..analysis.verdict import equal_time, value_at
from ..rundir.target import Target, first_reached
from .catalog import TABLES, TARGET_TABLE, Table


def sync_events(run: Run) -> list[dict[str, Any]]:
    """The run's fragment merges ("sync" records of kind "fragment") in step order."""
    out = []
    try:
        with open(run.dir / "metrics.jsonl", encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and rec.get("type") == "sync" and rec.get("kind") == "fragment":
                    out.append(rec)
    except OSError:
        pass
    return sorted(out, key=lambda r: r.get("step", 0))


def longest_repeat(sequence: Sequence[int]) -> int:
    """The longest run of one fragment chosen again and again (1: never twice in a row; 0: no syncs)."""
    best = cur = 0
    for i, p in enumerate(sequence):
        cur = cur + 1 if i and p == sequence[i - 1] else 1
        best = max(best, cur)
    return best


@dataclass(frozen=True)
class Context:
    """What a table's metrics are read against: its target, and the clock of "at equal wall clock"
    (`analysis.verdict.equal_time`: when its fastest setting's last evaluation happened)."""

    target: Target | None = None
    equal_time_s: float | None = None


@dataclass(frozen=True)
class Metric:
    header: str
    higher_is_better: bool
    value: Callable[[Run, Context], float | None]


def _to_target(index: int) -> Callable[[Run, Context], float | None]:
    def f(run: Run, ctx: Context) -> float | None:
        hit = first_reached(run.evals, ctx.target) if ctx.target is not None else None
        return None if hit is None or hit[index] is None else float(hit[index])

    return f


def _at_equal_time(run: Run, ctx: Context) -> float | None:
    return value_at(run.evals, "val_loss", ctx.equal_time_s) if ctx.equal_time_s is not None else None


def _lam(run: Run, _: Context) -> float | None:
    vals = [v for e in sync_events(run) if (v := number(e.get("lam_term_rel"))) is not None]
    return sum(vals) / len(vals) if vals else None


def _repeat(run: Run, _: Context) -> float | None:
    seq = [int(e["fragment"]) for e in sync_events(run) if "fragment" in e]
    return float(longest_repeat(seq)) if seq else None


METRICS: Mapping[str, Metric] = MappingProxyType(
    {
        "peak_acc": Metric("peak test acc %", True, lambda r, _: number(r.summary.get("peak_test_acc"))),
        "wall_clock_s": Metric("wall clock (s)", False, lambda r, _: number(r.summary.get("wall_clock_s"))),
        "exposed_pct": Metric("exposed comm %", False, lambda r, _: exposed_pct(r)),
        "peer_wait_pct": Metric("waiting for a slower peer %", False, lambda r, _: peer_wait_pct(r)),
        "final_loss": Metric("final val loss", False, lambda r, _: number(r.summary.get("final_val_loss"))),
        "loss_at_equal_time": Metric("val loss at equal wall clock", False, _at_equal_time),
        "bytes_sent": Metric(
            "MB sent per worker",
            False,
            lambda r, _: None if (b := number(r.summary.get("bytes_sent"))) is None else b / 1e6,
        ),
        "steps_to_target": Metric("steps to target", False, _to_target(0)),
        "time_to_target": Metric("wall clock to target (s)", False, _to_target(1)),
        "lam_term_rel": Metric("‖λ term‖ / ‖g‖ (mean over merges)", False, _lam),
        "longest_repeat": Metric("longest run of one fragment", False, _repeat),
    }
)


def load(root: Path, name: str) -> list[SettingRuns]:
    """The settings of one table's directory (empty when it holds no runs yet)."""
    try:
        return group(find_runs(root / name))
    except ReportError:
        return []


def table_context(t: Table, root: Path, shared_target: float | None) -> tuple[Context, float | None, str]:
    """The context of table `t`'s metrics, its target loss and where that came from: an LM table's the
    shared one (`lm_target`), or with `own_target` the highest final validation loss among its own
    runs (its workload is another's); a vision table has none."""
    settings = load(root, t.reads or t.name)
    loss, source = None, ""
    if t.kind == "lm" and t.own_target:
        finals = [v for s in settings for r in s.ok_runs if (v := number(r.summary.get("final_val_loss"))) is not None]
        loss, source = (max(finals) if finals else None), f"the runs of {t.name}"
    elif t.kind == "lm":
        loss, source = shared_target, lm_target_source(root)
    target = Target("val_loss", loss, False, "") if loss is not None else None
    return Context(target, equal_time(settings) if settings else None), loss, source


def lm_target(root: Path) -> float | None:
    """The LM tables' target: the highest final validation loss among TARGET_TABLE's runs, so that every
    one of them reaches it by its last evaluation. Before those runs exist (a table trained on its own,
    `wansync results --only staleness`), the same rule over every LM table's runs on disk; None when
    there are none."""

    def finals(names: Sequence[str]) -> list[float]:
        return [
            v
            for name in names
            for s in load(root, name)
            for r in s.ok_runs
            if (v := number(r.summary.get("final_val_loss"))) is not None
        ]

    first = finals([TARGET_TABLE])
    if first:
        return max(first)
    rest = finals([t.name for t in TABLES if t.kind == "lm" and not t.reads and not t.own_target])
    return max(rest) if rest else None


def lm_target_source(root: Path) -> str:
    """Whose runs `lm_target` took the target from, in words for the page."""
    has_runs = any(s.ok_runs for s in load(root, TARGET_TABLE))
    return f"the runs of {TARGET_TABLE}" if has_runs else "the LM runs on disk (cocodc-main has none yet)"


def cell_interval(setting: SettingRuns, metric: str, ctx: Context) -> tuple[Interval | None, int, int]:
    """(interval over the seeds that have a value, seeds with a value, seeds run)."""
    m = METRICS[metric]
    vals = [v for r in setting.ok_runs if (v := m.value(r, ctx)) is not None]
    return interval(vals), len(vals), len(setting.runs)
