"""What a comparison says, in the figures a user decides on, and one sentence computed from them.

Two questions decide between strategies on a slow link: which one is better *at equal wall clock*
(the validation quality each reached by the time the fastest run finished), and which one gets to a
quality worth having *soonest* (the wall clock to the experiment's target). Both come from the
evaluation records' clock (seconds since training started), so start-up does not count. Then the
costs: exposed communication and bytes. The sentence names the winner of each question; it is
computed here, never written by hand.
"""
from __future__ import annotations

from typing import Any, Sequence

from .runs import Quality, SettingRuns, number
from ..units import human_bytes
from ..rundir.target import Target, first_reached


def value_at(evals: Sequence[dict[str, Any]], metric: str, seconds: float) -> float | None:
    """The metric of the last evaluation at or before `seconds` on the run's clock (None: none yet)."""
    seen = [(t, v) for e in evals if (t := number(e.get("time"))) is not None and t <= seconds + 1e-9
            and (v := number(e.get(metric))) is not None]
    return max(seen)[1] if seen else None


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def equal_time(settings: Sequence[SettingRuns]) -> float | None:
    """The comparison's common clock: when the fastest setting's last evaluation happened (its
    mean over seeds), so every setting has been evaluated up to then."""
    ends = [_mean([number(r.evals[-1].get("time")) for r in s.ok_runs if r.evals]) for s in settings]
    ends = [e for e in ends if e is not None]
    return min(ends) if ends else None


def decision_rows(settings: Sequence[SettingRuns], q: Quality, target: float | None) -> list[dict[str, Any]]:
    """Per setting: quality at equal wall clock, wall clock to the target, exposed comm %, bytes."""
    at = equal_time(settings)
    goal = Target(q.eval_key, target, q.higher_is_better, "") if target is not None else None
    rows = []
    for s in settings:
        runs = s.ok_runs
        hits = [first_reached(r.evals, goal) for r in runs] if goal else []
        times = [h[1] for h in hits if h is not None]
        rows.append({
            "setting": s.label, "strategy": s.strategy, "seeds": len(runs),
            "at_equal_time": _mean([value_at(r.evals, q.eval_key, at) for r in runs]) if at is not None else None,
            "time_to_target_s": _mean(times) if times and len(times) == len(runs) else None,
            "reached": len(times),
            "wall_clock_s": _mean([number(r.summary.get("wall_clock_s")) for r in runs]),
            "exposed_comm_pct": _mean([number(r.summary.get("exposed_comm_pct")) for r in runs]),
            "bytes_sent": _mean([number(r.summary.get("bytes_sent")) for r in runs]),
        })
    return rows


def decision_table(rows: Sequence[dict[str, Any]], q: Quality, at: float | None) -> str:
    """The rows as a markdown table, the decision figures first."""
    def f(v: float | None, fmt: str) -> str:
        return "–" if v is None else format(v, fmt)
    head = ["setting", f"{q.name} at {f(at, '.0f')} s", "time to target (s)", "exposed comm %", "bytes sent",
            "wall clock (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ttt = f(r["time_to_target_s"], ".1f") if r["time_to_target_s"] is not None else \
            f"not reached ({r['reached']}/{r['seeds']})"
        lines.append("| " + " | ".join([r["setting"], f(r["at_equal_time"], ".4f"), ttt, f(r["exposed_comm_pct"], ".1f"),
                                         human_bytes(r["bytes_sent"]), f(r["wall_clock_s"], ".1f")]) + " |")
    return "\n".join(lines)


def verdict(rows: Sequence[dict[str, Any]], q: Quality, target: float | None, target_source: str,
            link: str, at: float | None) -> str:
    """One sentence: which setting was best on `link` at equal wall clock, and which reached the target first."""
    where = f"On the {link} link" if link else "Without an emulated link"
    scored = [r for r in rows if r["at_equal_time"] is not None]
    if not scored or at is None:
        return f"{where}, no run finished an evaluation: nothing to compare."
    pick = max if q.higher_is_better else min
    best = pick(scored, key=lambda r: r["at_equal_time"])
    text = (f"{where}, {best['setting']} had the best {q.name} at equal wall clock "
            f"({best['at_equal_time']:.4f} after {at:.0f} s)")
    reached = [r for r in rows if r["time_to_target_s"] is not None]
    if target is None:
        return text + "."
    goal = f"the target {q.name} {target:.4f} ({target_source})"
    if not reached:
        return text + f", and no setting reached {goal} in every seed."
    first = min(reached, key=lambda r: r["time_to_target_s"])
    ddp = next((r for r in reached if r["strategy"] == "ddp"), None)
    speed = f", {ddp['time_to_target_s'] / first['time_to_target_s']:.1f}x sooner than DDP" \
        if ddp is not None and first is not ddp and first["time_to_target_s"] > 0 else ""
    who = "it also" if first is best else first["setting"]
    return text + f"; {who} reached {goal} first, after {first['time_to_target_s']:.0f} s{speed}."
