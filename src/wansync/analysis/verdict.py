"""What a comparison says, in the figures a user decides on, and one sentence computed from them.

Two questions decide between strategies on a slow link: which one is better *at equal wall clock*
(the validation quality each reached by the time the fastest run finished), and which one gets to a
quality worth having *soonest* (the wall clock to the experiment's target). Both come from the
evaluation records' clock (seconds since training started), so start-up does not count. Then the
costs: exposed communication and bytes. The sentence names the winner of each question; it is
computed here, never written by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from .labels import human_label
from .runs import Quality, SettingRuns, number
from ..units import human_bytes
from ..rundir.target import Target, first_reached


def value_at(evals: Sequence[dict[str, Any]], metric: str, seconds: float) -> float | None:
    """The metric of the last evaluation at or before `seconds` on the run's clock (None: none yet)."""
    seen = [
        (t, v)
        for e in evals
        if (t := number(e.get("time"))) is not None and t <= seconds + 1e-9 and (v := number(e.get(metric))) is not None
    ]
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
        rows.append(
            {
                "setting": s.label,
                "name": human_label(s.strategy, s.setting),
                "strategy": s.strategy,
                "seeds": len(runs),
                "at_equal_time": _mean([value_at(r.evals, q.eval_key, at) for r in runs]) if at is not None else None,
                "time_to_target_s": _mean(times) if times and len(times) == len(runs) else None,
                "reached": len(times),
                "wall_clock_s": _mean([number(r.summary.get("wall_clock_s")) for r in runs]),
                "exposed_comm_pct": _mean([number(r.summary.get("exposed_comm_pct")) for r in runs]),
                "bytes_sent": _mean([number(r.summary.get("bytes_sent")) for r in runs]),
            }
        )
    return rows


def decision_table(rows: Sequence[dict[str, Any]], q: Quality, at: float | None) -> str:
    """The rows as a markdown table, the decision figures first."""

    def f(v: float | None, fmt: str) -> str:
        return "–" if v is None else format(v, fmt)

    head = [
        "setting",
        f"{q.name} at {f(at, '.0f')} s",
        "time to target (s)",
        "exposed comm %",
        "bytes sent",
        "wall clock (s)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ttt = (
            f(r["time_to_target_s"], ".1f")
            if r["time_to_target_s"] is not None
            else f"not reached ({r['reached']}/{r['seeds']})"
        )
        lines.append(
            "| "
            + " | ".join(
                [
                    r["name"],
                    f(r["at_equal_time"], ".4f"),
                    ttt,
                    f(r["exposed_comm_pct"], ".1f"),
                    human_bytes(r["bytes_sent"]),
                    f(r["wall_clock_s"], ".1f"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Spread:
    """How far seeds alone move one run's quality at equal wall clock (a standard deviation), and where
    that was measured: two settings closer than the spread allows are too close to call."""

    sd: float
    source: str

    def allows(self, n_a: int, n_b: int) -> float:
        """The gap two means of n_a and n_b seeds may show by chance (95 %, normal)."""
        return 1.96 * self.sd * math.sqrt(1 / max(1, n_a) + 1 / max(1, n_b))


def seed_spread(settings: Sequence[SettingRuns], q: Quality, at: float | None) -> Spread | None:
    """The pooled standard deviation over seeds of the quality at equal wall clock, from the settings
    that ran two seeds or more (None: every setting ran one)."""
    if at is None:
        return None
    squares, dof = 0.0, 0
    for s in settings:
        vals = [v for r in s.ok_runs if (v := value_at(r.evals, q.eval_key, at)) is not None]
        if len(vals) >= 2:
            m = sum(vals) / len(vals)
            squares += sum((v - m) ** 2 for v in vals)
            dof += len(vals) - 1
    return Spread(math.sqrt(squares / dof), "measured over these runs' seeds") if dof else None


def recorded_spread(experiment: dict[str, Any]) -> Spread | None:
    """The spread an experiment recorded for itself (experiment.json's `spread`: the demo's, measured
    on the results page), when well formed."""
    rec = experiment.get("spread")
    sd = number(rec.get("sd")) if isinstance(rec, dict) and not isinstance(rec.get("sd"), bool) else None
    return Spread(sd, str(rec.get("source", ""))) if sd is not None and sd >= 0 and isinstance(rec, dict) else None


def verdict(
    rows: Sequence[dict[str, Any]],
    q: Quality,
    target: float | None,
    link: str,
    at: float | None,
    spread: Spread | None = None,
) -> str:
    """One plain sentence: which setting was best on `link` at equal wall clock (or that the leaders are
    closer than seeds alone move them), and which reached the target first."""
    where = f"On the {link} link" if link else "Without an emulated link"
    scored = [r for r in rows if r["at_equal_time"] is not None]
    if not scored or at is None:
        return f"{where}, no run finished an evaluation: nothing to compare."
    ranked = sorted(scored, key=lambda r: r["at_equal_time"], reverse=q.higher_is_better)
    best = ranked[0]
    close = (
        len(ranked) > 1
        and spread is not None
        and abs(best["at_equal_time"] - ranked[1]["at_equal_time"]) < spread.allows(best["seeds"], ranked[1]["seeds"])
    )
    if close and spread is not None:
        second = ranked[1]
        text = (
            f"{where}, {best['name']} and {second['name']} are too close to call at equal wall clock: "
            f"{best['at_equal_time']:.4f} and {second['at_equal_time']:.4f} after {at:.0f} s differ by less "
            f"than the {spread.allows(best['seeds'], second['seeds']):.3f} that seeds alone allow"
            + (f" ({spread.source})" if spread.source else "")
        )
    else:
        one = spread is None and all(r["seeds"] == 1 for r in scored) and len(scored) > 1
        text = (
            f"{where}, {best['name']} had the best {q.name} at equal wall clock, {best['at_equal_time']:.4f} "
            f"after {at:.0f} s" + (" (one seed each)" if one else "")
        )
    reached = [r for r in rows if r["time_to_target_s"] is not None]
    if target is None:
        return text + "."
    if not reached:
        return text + f"; no setting reached the target {q.name} of {target:.4f} in every seed."
    first = min(reached, key=lambda r: r["time_to_target_s"])
    ddp = next((r for r in reached if r["strategy"] == "ddp"), None)
    speed = (
        f", {ddp['time_to_target_s'] / first['time_to_target_s']:.1f}x sooner than DDP"
        if ddp is not None and first is not ddp and first["time_to_target_s"] > 0
        else ""
    )
    who = "it also" if first is best and not close else first["name"]
    return text + (
        f"; {who} reached the target {q.name} of {target:.4f} first, after "
        f"{first['time_to_target_s']:.0f} s{speed}."
    )
