"""Tables and plots from run directories: summary.csv, runs.csv, report.md and PNG plots.

`report(root)` reads every run directory under `root` (one wansync wrote: its config.toml, summary.json
or failed.json is wansync's; `rundir.layout`; read by `analysis.run_dirs`), groups the runs into settings (one setting = one strategy
and one choice of grid values, all seeds) and aggregates mean ± std over seeds:

- quality: final and best validation loss, final validation perplexity and bits per byte (LM; the
  one of the three that compares runs with different tokenizers), or final and peak test accuracy
  (vision);
- steps and wall clock until the validation loss first reaches a target (`target_loss`) or the test
  accuracy first reaches `target_acc`. Default target: DDP's final value with 1% slack (loss x 1.01,
  accuracy x 0.99) when DDP is among the settings, else the best setting's final value, same slack;
- exposed communication % (profile.json: categories_s.exposed_comm / wall_clock_s), bytes sent and
  sync events (summary.json).

Settings come from the experiment's grid (`experiment.json`) when there is one, else from the
directory layout (`<label>/seed<k>/`). A failed run is a row whose status says why, and so is a
damaged one (a summary.json that is not the trainer's, a metrics.jsonl cut short): never `ok`.

The report's files are replaced only where wansync wrote them (`rundir.owned`; `force` replaces any),
which is checked before anything is written; `lock` holds the directory (`rundir.lock`) while writing.
"""

from __future__ import annotations

import contextlib
import csv
import io
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..rundir.layout import EXPERIMENT_FILE, REPORT_FILE, REPORT_FILES, RUNS_CSV, SUMMARY_CSV, add_to_summary
from ..rundir.lock import RunLock
from ..rundir import files
from ..rundir.owned import check_replaceable, record_written
from .run_dirs import ReportError, find_runs, read_json
from .runs import LM, VISION, Quality, Run, SettingRuns, number
from ..units import human_bytes
from ..rundir.target import Target, first_reached, target_record
from .verdict import Spread, decision_rows, decision_table, equal_time, recorded_spread, seed_spread, verdict


# ---------------------------------------------------------------- metrics


def quality_of(runs: Sequence[Run]) -> Quality:
    ok = [r for r in runs if r.ok]
    n_vision = sum(1 for r in ok if "final_test_acc" in r.summary)
    return VISION if ok and n_vision > len(ok) / 2 else LM


def exposed_pct(run: Run) -> float | None:
    wall = number(run.profile.get("wall_clock_s"))
    exposed = number(run.profile.get("categories_s", {}).get("exposed_comm"))
    if wall is None or exposed is None or wall <= 0:
        return None
    return 100.0 * exposed / wall


def peer_wait_pct(run: Run) -> float | None:
    """The part of the exposed % that rank 0 spent waiting for later-arriving peers (a straggler's
    cost, not the link's; telemetry.peerwait); None where the launcher could not compare ranks."""
    return number(run.profile.get("derived", {}).get("peer_wait_pct"))


def to_target(run: Run, q: Quality, target: float) -> tuple[int | None, float | None]:
    """(step, seconds) of the first evaluation that reaches the target, or (None, None)."""
    return first_reached(run.evals, Target(q.eval_key, target, q.higher_is_better, "")) or (None, None)


def mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None, int]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None, 0
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None), len(vals)


def group(runs: Sequence[Run]) -> list[SettingRuns]:
    out: dict[str, SettingRuns] = {}
    for r in runs:
        s = out.setdefault(r.label, SettingRuns(r.label, r.strategy, r.setting, []))
        s.runs.append(r)
    return list(out.values())


METRICS = (
    "final",
    "best",
    "final_ppl",
    "final_bpb",
    "steps_to_target",
    "time_to_target_s",
    "wall_clock_s",
    "exposed_comm_pct",
    "peer_wait_pct",
    "bytes_sent",
    "sync_events",
    "bytes_inside_workers",
    "exposed_comm_inside_s",
)
# Shown only when some run has workers of several ranks (traffic that stays inside a worker).
INSIDE_COLUMNS = ("bytes inside workers", "exposed inside workers (s)")


def common_target(settings: Sequence[SettingRuns], q: Quality) -> tuple[float | None, str]:
    """The quality every setting reached: the worst mean final value among the settings that did
    not diverge (so time to target ranks them all, not only those that match the best)."""
    finals = [
        (s, v)
        for s in settings
        if s.ok_runs
        and not any(r.diverged for r in s.ok_runs)
        and (v := mean_std([number(r.summary.get(q.final_key)) for r in s.ok_runs])[0]) is not None
    ]
    if not finals:
        return None, "no finished run"
    s, v = (min if q.higher_is_better else max)(finals, key=lambda sv: sv[1])
    return v, f"the final {q.name} every setting reached (the worst of them: {s.label})"


TARGET_RULES = ("ddp", "common")


def default_target(settings: Sequence[SettingRuns], q: Quality, rule: str = "ddp") -> tuple[float | None, str]:
    """The experiment's target when none is given: rule "ddp" (below) or "common" (`common_target`)."""
    if rule == "common":
        return common_target(settings, q)

    def final_mean(s: SettingRuns) -> float | None:
        return mean_std([number(r.summary.get(q.final_key)) for r in s.ok_runs])[0]

    slack = 0.99 if q.higher_is_better else 1.01
    scored = [(s, v) for s in settings if (v := final_mean(s)) is not None]
    if not scored:
        return None, "no finished run"
    ddp = [(s, v) for s, v in scored if s.strategy == "ddp"]
    pool, who = (ddp, "DDP") if ddp else (scored, "the best setting")
    s, v = max(pool, key=lambda sv: sv[1]) if q.higher_is_better else min(pool, key=lambda sv: sv[1])
    how = "x 0.99" if q.higher_is_better else "x 1.01"
    return v * slack, f"{who}'s final {q.name} ({s.label}: {v:.4g}) {how}"


def aggregate(settings: Sequence[SettingRuns], q: Quality, target: float | None) -> list[dict[str, Any]]:
    rows = []
    for s in settings:
        ok = s.ok_runs
        per: dict[str, list[float | None]] = {m: [] for m in METRICS}
        reached = 0
        for r in ok:
            sm = r.summary
            per["final"].append(number(sm.get(q.final_key)))
            per["best"].append(number(sm.get(q.best_key)))
            per["final_ppl"].append(number(sm.get("final_val_ppl")))
            per["final_bpb"].append(number(sm.get("final_val_bpb")))
            step, sec = to_target(r, q, target) if target is not None else (None, None)
            reached += step is not None
            per["steps_to_target"].append(step)
            per["time_to_target_s"].append(sec)
            per["wall_clock_s"].append(number(sm.get("wall_clock_s")))
            per["exposed_comm_pct"].append(exposed_pct(r))
            per["peer_wait_pct"].append(peer_wait_pct(r))
            per["bytes_sent"].append(number(sm.get("bytes_sent")))
            per["sync_events"].append(number(sm.get("sync_events")))
            per["bytes_inside_workers"].append(number(sm.get("bytes_inside_workers")))
            per["exposed_comm_inside_s"].append(number(sm.get("exposed_comm_inside_s")))
        row: dict[str, Any] = {
            "setting": s.label,
            "strategy": s.strategy,
            **{k: v for k, v in s.setting.items()},
            "seeds": len(s.runs),
            "seeds_ok": len(ok),
            "reached_target": reached,
            "diverged": sum(r.diverged for r in ok),
            "status": s.status,
        }
        for m, vals in per.items():
            mean, std, _ = mean_std(vals)
            row[f"{m}_mean"], row[f"{m}_std"] = mean, std
        rows.append(row)
    return rows


# ---------------------------------------------------------------- formatting


def _f(v: float | None, digits: int = 4) -> str:
    if v is None:
        return "–"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def _pm(row: dict[str, Any], m: str, digits: int = 4) -> str:
    mean, std = row.get(f"{m}_mean"), row.get(f"{m}_std")
    if mean is None:
        return "–"
    return _f(mean, digits) if std is None else f"{_f(mean, digits)} ± {_f(std, 2)}"


def columns(q: Quality) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    def target_col(m: str) -> Callable[[dict[str, Any]], str]:
        def f(row: dict[str, Any]) -> str:
            if not row["seeds_ok"]:
                return "–"
            if not row["reached_target"]:
                return f"not reached (0/{row['seeds_ok']})"
            text = _pm(row, m, 4)
            return (
                text
                if row["reached_target"] == row["seeds_ok"]
                else f"{text} ({row['reached_target']}/{row['seeds_ok']})"
            )

        return f

    cols: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("setting", lambda r: r["setting"]),
        ("seeds", lambda r: f"{r['seeds_ok']}/{r['seeds']}"),
    ]
    if q.kind == "lm":
        cols += [
            ("final val loss", lambda r: _pm(r, "final")),
            ("best val loss", lambda r: _pm(r, "best")),
            ("final val ppl", lambda r: _pm(r, "final_ppl")),
            ("final val bpb", lambda r: _pm(r, "final_bpb")),
        ]
    else:
        cols += [("final test acc %", lambda r: _pm(r, "final")), ("peak test acc %", lambda r: _pm(r, "best"))]
    cols += [
        ("steps to target", target_col("steps_to_target")),
        ("time to target (s)", target_col("time_to_target_s")),
        ("wall clock (s)", lambda r: _pm(r, "wall_clock_s", 3)),
        ("exposed comm %", lambda r: _pm(r, "exposed_comm_pct", 3)),
        ("of it waiting for a peer %", lambda r: _pm(r, "peer_wait_pct", 2)),
        ("bytes sent", lambda r: human_bytes(r.get("bytes_sent_mean"))),
        (INSIDE_COLUMNS[0], lambda r: human_bytes(r.get("bytes_inside_workers_mean"))),
        (INSIDE_COLUMNS[1], lambda r: _pm(r, "exposed_comm_inside_s", 3)),
        ("sync events", lambda r: _pm(r, "sync_events", 4)),
        ("status", lambda r: r["status"]),
    ]
    return cols


def markdown_table(rows: Sequence[dict[str, Any]], q: Quality) -> str:
    cols = columns(q)
    if not any(r.get("bytes_inside_workers_mean") for r in rows):
        cols = [c for c in cols if c[0] not in INSIDE_COLUMNS]
    cells = [[f(r).replace("|", "\\|") for _, f in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _) in enumerate(cols)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join(
        [line([h for h, _ in cols]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(c) for c in cells)]
    )


def _csv_value(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.10g}"
    return v


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=keys)
    w.writeheader()
    for r in rows:
        w.writerow({k: _csv_value(r.get(k)) for k in keys})
    files.write_text(path, text.getvalue())


def run_rows(runs: Sequence[Run], q: Quality, target: float | None) -> list[dict[str, Any]]:
    rows = []
    for r in runs:
        step, sec = to_target(r, q, target) if r.ok and target is not None else (None, None)
        sm = r.summary
        rows.append(
            {
                "setting": r.label,
                "strategy": r.strategy,
                "seed": r.seed,
                **r.setting,
                "status": "diverged" if r.diverged else r.status,
                "diverged": r.diverged,
                "final": number(sm.get(q.final_key)),
                "best": number(sm.get(q.best_key)),
                "final_ppl": number(sm.get("final_val_ppl")),
                "final_bpb": number(sm.get("final_val_bpb")),
                "steps_to_target": step,
                "time_to_target_s": sec,
                "wall_clock_s": number(sm.get("wall_clock_s")),
                "exposed_comm_pct": exposed_pct(r) if r.ok else None,
                "peer_wait_pct": peer_wait_pct(r) if r.ok else None,
                "bytes_sent": number(sm.get("bytes_sent")),
                "sync_events": number(sm.get("sync_events")),
                "dir": str(r.dir),
            }
        )
    return rows


# ---------------------------------------------------------------- the report


@dataclass
class Report:
    root: Path
    quality: Quality
    target: float | None
    target_source: str
    rows: list[dict[str, Any]]
    table: str
    plots: list[Path]
    failed: list[Run]
    decision: str = ""  # the decision figures (verdict.py): quality at equal wall clock, time to target, costs
    verdict: str = ""  # the one computed sentence

    @property
    def path(self) -> Path:
        return self.root / REPORT_FILE


def confined(root: Path) -> None:
    """A report searches `root` for runs and writes its files there: never the whole file system or a
    home directory (a typo away from tabulating every run on the machine and writing into `/`)."""
    resolved = root.resolve()
    homes = (
        {Path.home().resolve(), *(p.resolve() for p in Path("/home").glob("*") if p.is_dir())}
        if Path("/home").is_dir()
        else {Path.home().resolve()}
    )
    if resolved == Path(resolved.anchor) or resolved in homes:
        raise ReportError(
            f"report: refusing to search all of {root} for runs and write a report into it: give "
            f"the experiment's directory (wansync compare --out DIR, or a run directory)"
        )


def report(
    root: str | Path,
    target_loss: float | None = None,
    target_acc: float | None = None,
    plots: bool = True,
    record_targets: bool = False,
    target_rule: str = "ddp",
    force: bool = False,
    lock: bool = False,
) -> Report:
    """Write summary.csv, runs.csv, report.md and the plots into root; returns what it wrote.
    With `record_targets` (the runner, once its runs are done) each finished run's summary.json also
    gets the experiment's target and when that run reached it. Files of those names that wansync did
    not write are refused before anything is written, unless `force`; `lock` holds root meanwhile
    (the runner holds it already)."""
    root = Path(root)
    confined(root)
    runs = find_runs(root)
    check_replaceable(root, REPORT_FILES, force)
    q = quality_of(runs)
    experiment: dict[str, Any] = {}
    try:
        experiment = read_json(root / EXPERIMENT_FILE)
    except (OSError, ValueError):
        pass
    if target_loss is None and target_acc is None and isinstance(experiment, dict):
        target_loss, target_acc = experiment.get("target_loss"), experiment.get("target_acc")
    settings = group(runs)
    given = target_acc if q.higher_is_better else target_loss
    if given is not None:
        target, source = float(given), f"given (--target-{'acc' if q.higher_is_better else 'loss'})"
    else:
        target, source = default_target(settings, q, str(experiment.get("target_rule", target_rule)))
    rows = aggregate(settings, q, target)
    table = markdown_table(rows, q)
    written: list[Path] = []
    try:
        with RunLock(root, "write a report into") if lock else contextlib.nullcontext(), _recorded(root, written):
            return _write(
                root,
                runs,
                settings,
                q,
                rows,
                table,
                target,
                source,
                plots,
                record_targets,
                written,
                recorded_spread(experiment) if isinstance(experiment, dict) else None,
            )
    except OSError as e:  # a read-only directory, a full disk
        raise ReportError(f"report: cannot write into {root}: {e.strerror or e}") from None


@contextlib.contextmanager
def _recorded(root: Path, written: list[Path]) -> Any:
    """Record what was written as wansync's, also when a later write fails."""
    try:
        yield
    finally:
        if written:
            record_written(root, written)


def _write(
    root: Path,
    runs: list[Run],
    settings: list[SettingRuns],
    q: Quality,
    rows: list[dict[str, Any]],
    table: str,
    target: float | None,
    source: str,
    plots: bool,
    record_targets: bool,
    written: list[Path],
    recorded: Spread | None = None,
) -> Report:
    """The report's files, each added to `written` once it is on disk."""
    for path, data in ((root / SUMMARY_CSV, rows), (root / RUNS_CSV, run_rows(runs, q, target))):
        write_csv(path, data)
        written.append(path)
    made: list[Path] = []
    if plots and any(r.ok for r in runs):
        from . import plots as P

        made = P.all_plots(root, settings, q, target)
        written += made
    if record_targets and target is not None:
        record_target(runs, Target(q.eval_key, target, q.higher_is_better, source))
    failed = [r for r in runs if not r.ok]
    at = equal_time(settings)
    decisions = decision_rows(settings, q, target)
    link = next((str((r.summary.get("wan") or {}).get("spec") or "") for r in runs if r.ok), "")
    rep = Report(
        root,
        q,
        target,
        source,
        rows,
        table,
        made,
        failed,
        decision_table(decisions, q, at),
        verdict(decisions, q, target, link, at, seed_spread(settings, q, at) or recorded),
    )
    files.write_text(rep.path, _markdown(rep, runs))
    written.append(rep.path)
    return rep


def record_target(runs: Sequence[Run], target: Target) -> None:
    """Write `target` and when each finished run reached it into the run's summary.json (a summary that
    already says so is left untouched)."""
    for r in runs:
        record = target_record(r.evals, target)
        if r.ok and r.summary and r.summary.get("target") != record and add_to_summary(r.dir, {"target": record}):
            r.summary["target"] = record


def _markdown(rep: Report, runs: Sequence[Run]) -> str:
    q = rep.quality
    target = (
        "none (no finished run)"
        if rep.target is None
        else f"{q.name} {'≥' if q.higher_is_better else '≤'} " f"{rep.target:.4g} {q.unit} — {rep.target_source}"
    )
    ok = [r for r in runs if r.ok]
    setting_bits = sorted({f"{k}" for r in runs for k in r.setting})
    lines = [
        f"# wansync report: {rep.root.name or rep.root}",
        "",
        f"{len(runs)} runs ({len(ok)} finished, {len(rep.failed)} failed) in {len({r.label for r in runs})} "
        f"settings; mean ± std over seeds (std shown with 2+ seeds).",
        "",
    ]
    if ok:
        s = ok[0].summary
        lines += [
            f"Model `{s.get('model', '?')}`, data `{s.get('data', '?')}`, {s.get('workers', '?')} workers, "
            f"{s.get('steps', '?')} steps" + (f"; grid keys: {', '.join(setting_bits)}" if setting_bits else "") + ".",
            "",
        ]
    if rep.decision:
        lines += [
            "## What to decide on",
            "",
            rep.verdict,
            "",
            rep.decision,
            "",
            "Quality at equal wall clock: the last evaluation each run had made when the fastest setting "
            "made its last one (mean over seeds). Time to target: the first evaluation reaching the target "
            "below, on the run's clock since training started.",
            "",
            "## All figures",
            "",
        ]
    lines += [
        f"Target: {target}. Steps and time to target are those of the first evaluation that reaches it "
        f"(resolution: the evaluation interval); the time is the evaluation record's clock since training "
        f"started.",
        "",
        *(
            [
                "Bits per byte (bpb) = the validation loss in bits over the UTF-8 bytes of the text it was "
                "measured on: unlike loss and perplexity per token, it compares runs with different "
                "tokenizers.",
                "",
            ]
            if q.kind == "lm"
            else []
        ),
        "Exposed comm % = time the training thread was blocked on collectives (profile.json "
        "`exposed_comm`) / wall clock; of it, waiting for a peer = the time it was blocked beyond the "
        "last-arriving rank's (a straggler's cost, not the link's; docs/profiler.md). Bytes sent = payload "
        "of this worker's collectives.",
        "",
        rep.table,
        "",
    ]
    resid = [abs(number(r.profile.get("residual_pct")) or 0.0) for r in ok if r.profile]
    if resid:
        lines += [f"Profiler: categories add up to the wall clock within {max(resid):.2f}% on every run.", ""]
    diverged = [r for r in runs if r.diverged]
    if diverged:
        lines += [
            "## Diverged runs",
            "",
            f"Finished, but the final {q.name} is worse than at the first evaluation or at chance:",
            "",
        ]
        lines += [
            f"- `{r.label}` seed {r.seed}: first {_f(number(r.evals[0].get(q.eval_key)) if r.evals else None)}, final "
            f"{_f(number(r.summary.get(q.final_key)))}, chance {_f(number(r.summary.get('chance_level')))} "
            f"(`{r.dir}`)"
            for r in diverged
        ]
        lines += [""]
    adapted = [(r, r.decisions()) for r in ok]
    if any(d for _, d in adapted):
        lines += [
            "## What --adapt decided",
            "",
            "Each change of H or the compression, at the boundary it took effect, with the link measured and "
            "the planner's prediction that chose it (`adapt.png` plots them over the run).",
            "",
            "| run | step | change | why |",
            "|---|---|---|---|",
        ]
        for r, ds in adapted:
            for d in ds:
                change = ", ".join(
                    f"{k} {d.get('before', {}).get(k)} → {v}"
                    for k, v in (d.get("after") or {}).items()
                    if d.get("before", {}).get(k) != v
                )
                lines.append(f"| `{r.label}` seed {r.seed} | {d.get('step')} | {change} | {d.get('reason', '')} |")
        lines += [""]
    if rep.failed:
        lines += ["## Failed runs", ""]
        lines += [f"- `{r.label}` seed {r.seed}: {r.status} (`{r.dir}`)" for r in rep.failed]
        lines += [""]
    if rep.plots:
        lines += ["## Plots", ""]
        for p in rep.plots:
            lines += [f"![{p.stem}]({p.name})", ""]
    lines += ["Files: `summary.csv` (one row per setting), `runs.csv` (one row per run).", ""]
    return "\n".join(lines)
