"""`make results` (`wansync results`): every table of docs/results.md from one resumable command.

Each table is a small experiment (cells x seeds) in `runs/results/<table>/`, run with the experiment
runner (`experiments.py`: a finished run is skipped, so an interrupted `make results` resumes). A cell
that two tables share (the same resolved config) is trained once and copied. Then the page's generated
part is rewritten: per table the command that regenerates it, mean ± 95% interval over seeds
(`stats.py`), verdicts decided by Welch's t-test over the seeds (p-value beside each), and the paragraph a reader needs: what the paper
claimed, what its review objected, what this run shows (computed), what it cannot show at this scale.
The tables answer the questions raised about CPDP (arXiv:2607.21224) and CoCoDC (arXiv:2504.17672).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..errors import WansyncError, path_kind
from ..rules import at_least, in_range, not_blank
from ..runner.experiments import MAX_SEEDS
from .measures import METRICS, longest_repeat, sync_events
from .page import BEGIN, END, answer, check_page, document, figures_dir, write_page
from .runs import list_tables, table_runs, run_tables
from .catalog import SEEDS, TABLES, Question, Table, get, label

__all__ = [
    "BEGIN",
    "END",
    "METRICS",
    "SEEDS",
    "TABLES",
    "Question",
    "Table",
    "answer",
    "document",
    "get",
    "label",
    "longest_repeat",
    "table_runs",
    "run_results",
    "sync_events",
    "write_page",
]


DOC = "docs/results.md"  # the page the full tables rewrite
SMOKE_PAGE = "results.md"  # a smoke run's page, in its own --out


def check_root(out: Path) -> None:
    """The results root holds the tables' directories (and a smoke run's page) and nothing else: a
    directory of the user's is refused in one line before anything is listed or written."""
    try:
        if out.exists() and not out.is_dir():  # a file, a FIFO: no table's directory can be made below it
            raise WansyncError(f"results: --out {out} is {path_kind(out)}, not a directory; choose another --out")
        if not out.is_dir():  # new: the tables' own checks say what else is wrong, in their words
            return
        entries = [p.name for p in out.iterdir()]
    except OSError:  # a name too long, a path through a file: as above
        return
    known = {t.name for t in TABLES} | {SMOKE_PAGE, SMOKE_PAGE + ".tmp", figures_dir(Path(SMOKE_PAGE)).name}
    foreign = sorted(name for name in entries if name not in known)
    if foreign:
        raise WansyncError(
            f"results: refusing to write into {out}: it holds {foreign[0]!r}, which is not a results "
            f"table's; choose another --out (an empty or new directory)"
        )


def run_results(
    names: Sequence[str],
    root: str,
    doc: str | None,
    seeds: int = SEEDS,
    steps: int | None = None,
    force: bool = False,
    dry: bool = False,
) -> int:
    """`wansync results`: run the tables (or list them with `dry`), then rewrite the page (`doc`; None:
    docs/results.md, or for a smoke run, shortened by `steps` or fewer `seeds`, a page in `root`). The
    root, the page and every table's directory are checked before the first run (`check_root`,
    `check_page`, `run_tables`)."""
    in_range(1, MAX_SEEDS, high_included=True)("--seeds", seeds)
    if steps is not None:
        at_least(1)("--steps", steps)
    tables, out = get(names), Path(root)
    if names:  # a table that reads another needs that one run too
        tables = get([*names, *(t.reads for t in tables if t.reads)])
    check_root(out)
    smoke = steps is not None or seeds != SEEDS
    if dry:
        return list_tables(tables, out, seeds, steps)
    if doc is None:  # the real page only from full runs: a smoke run's goes to its own --out
        doc = str(out / SMOKE_PAGE) if smoke else DOC
        if smoke:
            out.mkdir(parents=True, exist_ok=True)
    not_blank("the page to rewrite")("--doc", doc)  # Path("") is "."
    page = Path(doc)
    check_page(page)
    outcomes = run_tables(tables, out, seeds, steps, force)
    write_page(page, document(TABLES, out, seeds, steps, check_page(page), figures_dir(page)))
    failed = [o for o in outcomes if o.status == "failed"]
    print(f"{sum(o.status == 'ok' for o in outcomes)} runs trained, {len(failed)} failed; page: {doc}")
    if failed:
        raise WansyncError(
            f"{len(failed)} runs failed; first: {failed[0].spec.label} seed {failed[0].spec.seed}: "
            f"{failed[0].message}"
        )
    return 0
