"""PNG plots for a report (matplotlib, Agg backend). Every plot has a title, axis labels with units
and a legend; one colour per setting, the same in every plot."""

from __future__ import annotations

import math
from pathlib import Path
from types import MappingProxyType
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .labels import distinct, human_label  # noqa: E402
from .runs import CATEGORIES, Quality, SettingRuns, number  # noqa: E402
from ..rundir import files  # noqa: E402
from ..rundir.layout import PLOTS, QUALITY_PLOTS  # noqa: E402
from ..units import human_bytes  # noqa: E402

CATEGORY_COLORS = MappingProxyType(
    {
        "compute": "#4c72b0",
        "exposed_comm": "#c44e52",
        "sync_math": "#dd8452",
        "data": "#8172b3",
        "eval": "#55a868",
        "checkpoint": "#937860",
        "other": "#bbbbbb",
    }
)
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")  # tell apart curves that coincide
CATEGORY_NAMES = MappingProxyType(
    {
        "compute": "compute",
        "exposed_comm": "exposed communication",
        "sync_math": "sync math",
        "data": "data loading",
        "eval": "evaluation",
        "checkpoint": "checkpoints",
        "other": "other",
    }
)


def _colors(settings: Sequence[SettingRuns]) -> dict[str, Any]:
    cmap = plt.get_cmap("tab10" if len(settings) <= 10 else "tab20")
    return {s.label: cmap(i % cmap.N) for i, s in enumerate(settings)}


def _names(settings: Sequence[SettingRuns]) -> dict[str, str]:
    """What a legend or an axis calls each setting: its label in words (`labels.py`)."""
    return distinct({s.label: human_label(s.strategy, s.setting) for s in settings})


def _ylabel(q: Quality) -> str:
    return f"{q.name} ({q.unit})"


def _curves(s: SettingRuns, q: Quality) -> tuple[list[float], list[float], list[float], list[float], list[float]]:
    """Per evaluation index: step, mean time, mean/min/max quality over the setting's finished seeds."""
    series = [[e for e in r.evals if number(e.get(q.eval_key)) is not None] for r in s.ok_runs]
    series = [x for x in series if x]
    if not series:
        return [], [], [], [], []
    n = min(len(x) for x in series)
    steps, times, mean, lo, hi = [], [], [], [], []
    for i in range(n):
        vals = [float(x[i][q.eval_key]) for x in series]
        ts = [t for x in series if (t := number(x[i].get("time"))) is not None]
        steps.append(series[0][i]["step"])
        times.append(sum(ts) / len(ts) if ts else math.nan)
        mean.append(sum(vals) / len(vals))
        lo.append(min(vals))
        hi.append(max(vals))
    return steps, times, mean, lo, hi


def _finish(fig: Any, ax: Any, path: Path, legend_title: str | None = None) -> Path:
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # outside the axes, so it never hides a curve, a bar or a label
        ax.legend(
            title=legend_title,
            fontsize=8,
            title_fontsize=8,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            borderaxespad=0.0,
        )
    fig.tight_layout()
    files.save_figure(path, fig, dpi=110)
    plt.close(fig)
    return path


def _target_line(ax: Any, q: Quality, target: float | None) -> None:
    if target is not None:
        ax.axhline(target, color="black", linestyle=":", linewidth=1, label=f"target {target:.4g} {q.unit}")


def quality_vs(settings: Sequence[SettingRuns], q: Quality, target: float | None, path: Path, x: str) -> Path:
    """x = 'step' or 'time': mean curve per setting, band = min..max over seeds; vs step, ticks on the
    x axis mark a fault-tolerant run's exchanges that had a worker missing (summary `short_exchanges`)."""
    colors, names = _colors(settings), _names(settings)
    fig, ax = plt.subplots(figsize=(10, 5))
    for i, s in enumerate(settings):
        steps, times, mean, lo, hi = _curves(s, q)
        if not steps:
            continue
        xs = steps if x == "step" else times
        n = len(s.ok_runs)
        ax.plot(
            xs,
            mean,
            marker=MARKERS[i % len(MARKERS)],
            markersize=4,
            color=colors[s.label],
            label=names[s.label] + (f" (mean of {n} seeds)" if n > 1 else ""),
        )
        if n > 1:
            ax.fill_between(xs, lo, hi, color=colors[s.label], alpha=0.15)
        short = sorted({t for r in s.ok_runs for t in r.summary.get("short_exchanges") or []})
        if x == "step" and short:  # fault-tolerant runs: a tick on the axis where a worker was missing
            ax.plot(
                short,
                [0.0] * len(short),
                transform=ax.get_xaxis_transform(),
                linestyle="none",
                marker="|",
                markersize=14,
                color=colors[s.label],
                label=f"{names[s.label]}: exchange with a worker missing",
            )
    _target_line(ax, q, target)
    what = "Validation loss" if q.kind == "lm" else "Test accuracy"
    if x == "step":
        ax.set_xlabel("training step (inner optimizer steps)")
        ax.set_title(f"{what} vs training step")
    else:
        ax.set_xlabel("wall clock since training started (s)")
        ax.set_title(f"{what} vs wall clock")
    ax.set_ylabel(_ylabel(q))
    return _finish(
        fig, ax, path, "setting (band: min–max over seeds)" if any(len(s.ok_runs) > 1 for s in settings) else "setting"
    )


def pareto_front(points: Sequence[tuple[float, float]], higher_is_better: bool) -> list[int]:
    """Indices of the points no other point beats in both time (lower) and quality."""
    front = []
    for i, (t, v) in enumerate(points):
        dominated = False
        for j, (t2, v2) in enumerate(points):
            if j == i:
                continue
            better_q = v2 >= v if higher_is_better else v2 <= v
            strictly = t2 < t or (v2 > v if higher_is_better else v2 < v)
            if t2 <= t and better_q and strictly:
                dominated = True
                break
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def pareto(settings: Sequence[SettingRuns], q: Quality, path: Path) -> Path:
    """Final quality vs wall clock: a point per run (faint), the mean per setting, the front highlighted."""
    colors, names = _colors(settings), _names(settings)
    use_ppl = q.kind == "lm"
    key = "final_val_ppl" if use_ppl else q.final_key
    fig, ax = plt.subplots(figsize=(10, 5))
    means: list[tuple[float, float]] = []
    labels: list[str] = []
    for s in settings:
        pts = [
            (w, v)
            for r in s.ok_runs
            if (w := number(r.summary.get("wall_clock_s"))) is not None
            and (v := number(r.summary.get(key))) is not None
        ]
        if not pts:
            continue
        ws, vs = zip(*pts)
        mw, mv = sum(ws) / len(ws), sum(vs) / len(vs)
        if len(pts) > 1:
            ax.scatter(ws, vs, color=colors[s.label], alpha=0.35, s=18)
        ax.scatter(
            [mw],
            [mv],
            color=colors[s.label],
            s=60,
            zorder=3,
            edgecolor="black",
            linewidth=0.5,
            label=names[s.label] + (f" (mean of {len(pts)} seeds; faint: each seed)" if len(pts) > 1 else ""),
        )
        means.append((mw, mv))
        labels.append(names[s.label])
    front = pareto_front(means, q.higher_is_better)
    if front:
        fx = [means[i][0] for i in front]
        fy = [means[i][1] for i in front]
        ax.plot(
            fx,
            fy,
            color="black",
            linewidth=1.5,
            linestyle="--",
            zorder=2,
            drawstyle="steps-post" if len(front) > 1 else "default",
            label="Pareto front (no setting is faster and better)",
        )
        ax.scatter(fx, fy, s=220, facecolors="none", edgecolors="black", linewidths=1.5, zorder=4)
    ax.set_xlabel("wall clock of the whole run (s)")
    ax.set_ylabel(
        "final validation perplexity (lower is better)" if use_ppl else f"final {q.name} ({q.unit}, higher is better)"
    )
    ax.set_title(("Final perplexity" if use_ppl else "Final accuracy") + " vs time: Pareto front (circled)")
    return _finish(fig, ax, path, "setting")


def _xticks(ax: Any, labels: Sequence[str]) -> None:
    ax.set_xticks(range(len(labels)))
    rot = 0 if max((len(x) for x in labels), default=0) * len(labels) < 70 else 25
    ax.set_xticklabels(labels, rotation=rot, ha="right" if rot else "center", fontsize=8)


def time_breakdown(settings: Sequence[SettingRuns], path: Path) -> Path:
    """Stacked bars: mean seconds per profiler category, per setting."""
    shown = [s for s in settings if any(r.profile for r in s.ok_runs)]
    names = _names(settings)
    fig, ax = plt.subplots(figsize=(max(9, 1.1 * len(shown) + 6), 5.5))
    bottoms = [0.0] * len(shown)
    for cat in CATEGORIES:
        vals = []
        for s in shown:
            xs = [number(r.profile.get("categories_s", {}).get(cat)) or 0.0 for r in s.ok_runs if r.profile]
            vals.append(sum(xs) / len(xs) if xs else 0.0)
        if not any(v > 0 for v in vals):
            continue
        ax.bar(
            range(len(shown)), vals, bottom=bottoms, color=CATEGORY_COLORS[cat], label=CATEGORY_NAMES[cat], width=0.6
        )
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for i, s in enumerate(shown):
        ex = [
            (number(r.profile.get("categories_s", {}).get("exposed_comm")) or 0.0)
            / max(1e-9, number(r.profile.get("wall_clock_s")) or 1e-9)
            for r in s.ok_runs
            if r.profile
        ]
        if ex:
            ax.text(i, bottoms[i], f"{100 * sum(ex) / len(ex):.1f}% exposed", ha="center", va="bottom", fontsize=8)
    _xticks(ax, [names[s.label] for s in shown])
    ax.set_ylim(0, max(bottoms, default=1) * 1.12 or 1)
    ax.set_xlabel("setting")
    ax.set_ylabel("time (s, mean over seeds)")
    ax.set_title("Where the wall clock went (profiler categories, sum = wall clock)")
    return _finish(fig, ax, path, "category")


def use_log_scale(values: Sequence[float], spread: float = 100.0) -> bool:
    """Log scale when every value is positive and the largest is more than `spread` times the smallest."""
    return bool(values) and all(v > 0 for v in values) and max(values) / min(values) > spread


def bytes_per_setting(settings: Sequence[SettingRuns], path: Path) -> Path:
    """Mean bytes sent per worker; log scale when the values span more than 100x."""
    colors, names = _colors(settings), _names(settings)
    shown, vals = [], []
    for s in settings:
        xs = [b for r in s.ok_runs if (b := number(r.summary.get("bytes_sent"))) is not None]
        if xs:
            shown.append(s)
            vals.append(sum(xs) / len(xs))
    top = max(vals, default=0.0)
    unit, scale = next(((u, f) for u, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if top >= f), ("bytes", 1.0))
    scaled = [v / scale for v in vals]
    fig, ax = plt.subplots(figsize=(max(9, 1.1 * len(shown) + 6), 5.5))
    for i, (s, v) in enumerate(zip(shown, scaled)):
        ax.bar([i], [v], color=colors[s.label], label=names[s.label], width=0.6)
        ax.text(i, v, human_bytes(vals[i]), ha="center", va="bottom", fontsize=8)
    log = use_log_scale(scaled)
    positive = [v for v in scaled if v > 0]
    if log:
        ax.set_yscale("log")
        ax.set_ylim(min(positive) / 2, max(positive) * 4)
    else:
        ax.set_ylim(0, max(scaled, default=1) * 1.15 or 1)
    _xticks(ax, [names[s.label] for s in shown])
    ax.set_xlabel("setting")
    ax.set_ylabel(f"bytes sent per worker ({unit}{', log scale' if log else ''})")
    ax.set_title("Communication volume per setting (payload of collectives, mean over seeds)")
    return _finish(fig, ax, path, "setting")


def exposed_share(steps: Sequence[dict[str, Any]], window: int) -> tuple[list[float], list[float]]:
    """(wall clock, exposed share in %) over the run: each point the exposed communication of the
    `window` steps up to it over the time they took (metrics.jsonl's per-step `exposed_s`, `time`)."""
    pts = [
        (t, e)
        for r in steps
        if (t := number(r.get("time"))) is not None and (e := number(r.get("exposed_s"))) is not None
    ]
    xs, ys = [], []
    for i in range(window, len(pts)):
        span = pts[i][0] - pts[i - window][0]
        if span > 0:
            xs.append(pts[i][0])
            ys.append(min(100.0, 100.0 * sum(e for _, e in pts[i - window + 1 : i + 1]) / span))
    return xs, ys


def exposed_over_time(settings: Sequence[SettingRuns], path: Path) -> Path:
    """Exposed communication's share of the wall clock over the run, one line per run (a link that
    changes, a straggler: where and when the time went); a rolling window of about 1/40 of the run."""
    colors, names = _colors(settings), _names(settings)
    fig, ax = plt.subplots(figsize=(10, 5))
    for s in settings:
        for k, run in enumerate(s.ok_runs):
            steps = run.steps()
            xs, ys = exposed_share(steps, max(1, len(steps) // 40))
            if xs:
                ax.plot(
                    xs,
                    ys,
                    color=colors[s.label],
                    alpha=0.9 if k == 0 else 0.4,
                    linewidth=1.2,
                    label=names[s.label] if k == 0 else None,
                )
    ax.set_ylim(0, 100)
    ax.set_xlabel("wall clock since training started (s)")
    ax.set_ylabel("exposed communication (% of the wall clock, rolling)")
    ax.set_title("Exposed communication over the run (per-step timeline; one line per seed)")
    return _finish(fig, ax, path, "setting")


def _knob_series(run: Any, steps: list[dict[str, Any]]) -> dict[str, tuple[list[float], list[Any]]]:
    """H and the compression over the wall clock: the run's own at its start, then each decision's."""
    at = {int(r["step"]): float(r["time"]) for r in steps if number(r.get("time")) is not None and "step" in r}
    decisions = run.decisions()
    first = decisions[0]["before"] if decisions else {}
    out: dict[str, tuple[list[float], list[Any]]] = {k: ([0.0], [v]) for k, v in first.items()}
    for d in decisions:
        t = at.get(int(d.get("step", 0)))
        for k, v in (d.get("after") or {}).items():
            if t is not None and k in out:
                out[k][0].append(t)
                out[k][1].append(v)
    end = max(at.values(), default=0.0)
    for xs, ys in out.values():
        xs.append(end)
        ys.append(ys[-1])
    return out


def adapt_over_time(settings: Sequence[SettingRuns], path: Path) -> Path | None:
    """What `--adapt` saw and did, beside what it was for: the exposed share (its target dotted),
    the bandwidth measured, H and the compression, over the wall clock; one line per run. None
    when no run adapted."""
    runs = [(s, r) for s in settings for r in s.ok_runs if r.decisions()]
    if not runs:
        return None
    colors, names = _colors(settings), _names(settings)
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    exposed, bw, h, comp = axes
    for s, run in runs:
        steps, color = run.steps(), colors[s.label]
        xs, ys = exposed_share(steps, max(1, len(steps) // 40))
        exposed.plot(xs, ys, color=color, linewidth=1.2, label=names[s.label])
        pts = [(r["time"], r["link_bw_bps"] / 1e6) for r in steps if number(r.get("link_bw_bps")) is not None]
        if pts:
            bw.plot(*zip(*pts), color=color, linewidth=1.2, marker=".", markersize=3)
        series = _knob_series(run, steps)
        for ax, key in ((h, "sync_every"), (comp, "codec"), (comp, "density")):
            if key in series:
                ax.step(*series[key], where="post", color=color, linewidth=1.4)
        target = run.decisions()[0].get("target_pct")
        if number(target) is not None:
            exposed.axhline(float(target), color=color, linestyle=":", linewidth=1)
    exposed.set_ylabel("exposed (% of wall)")
    exposed.set_ylim(0, 100)
    bw.set_ylabel("bandwidth measured\n(Mbit/s)")
    h.set_ylabel("H (steps per round)")
    comp.set_ylabel("codec / density")
    comp.set_xlabel("wall clock since training started (s)")
    exposed.set_title("--adapt: the link it measured and the knobs it turned (dotted: the target)")
    for ax in axes[1:]:
        ax.grid(True, alpha=0.3)
    return _finish(fig, exposed, path, "setting")


def staleness_over_time(settings: Sequence[SettingRuns], path: Path) -> Path | None:
    """An asynchronous run's merges: each contribution's staleness (versions between the one its learner
    started from and the merge) over the syncer's wall clock, and how often each staleness came; one
    colour per setting. None when no run was asynchronous."""
    runs = [(s, r) for s in settings for r in s.ok_runs if r.merges()]
    if not runs:
        return None
    colors, names = _colors(settings), _names(settings)
    fig, (over, share) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    counts: dict[str, dict[int, int]] = {}
    for s, run in runs:
        xs, ys = [], []
        for m in run.merges():
            for tau in m.get("staleness") or []:
                xs.append(float(m.get("time", 0.0)))
                ys.append(int(tau))
                counts.setdefault(s.label, {}).setdefault(int(tau), 0)
                counts[s.label][int(tau)] += 1
        over.scatter(xs, ys, color=colors[s.label], s=12, alpha=0.6, label=names[s.label])
    width = 0.8 / max(1, len(counts))
    for i, (label, by_tau) in enumerate(counts.items()):
        total = sum(by_tau.values())
        taus = sorted(by_tau)
        share.bar([t + i * width for t in taus], [100 * by_tau[t] / total for t in taus], width, color=colors[label])
    over.set_xlabel("syncer wall clock (s)")
    over.set_ylabel("staleness (versions)")
    over.set_title("Asynchronous merges: the staleness of each contribution")
    share.set_xlabel("staleness (versions)")
    share.set_ylabel("% of contributions")
    share.grid(True, alpha=0.3)
    return _finish(fig, over, path, "setting")


def all_plots(root: Path, settings: Sequence[SettingRuns], q: Quality, target: float | None) -> list[Path]:
    """Every plot, under the names the run directory's layout gives them (`rundir.layout`); the
    decisions of `--adapt` only where a run adapted, the staleness of merges only where one was asynchronous."""
    root = Path(root)
    by_step, by_time = (root / p.format(quality="loss" if q.kind == "lm" else "accuracy") for p in QUALITY_PLOTS)
    front, breakdown, volume, exposed, adapt, stale = (root / p for p in PLOTS)
    made = [
        quality_vs(settings, q, target, by_step, "step"),
        quality_vs(settings, q, target, by_time, "time"),
        pareto(settings, q, front),
        time_breakdown(settings, breakdown),
        bytes_per_setting(settings, volume),
        exposed_over_time(settings, exposed),
        adapt_over_time(settings, adapt),
        staleness_over_time(settings, stale),
    ]
    return [p for p in made if p is not None]
