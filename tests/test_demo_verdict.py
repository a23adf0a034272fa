"""The demo's verdict: one plain sentence that names a winner only where the gap is wider than seeds
alone move one run (its spread recorded from the results page's seeds), issue 50."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from wansync.analysis import report as R
from wansync.runner import demo, experiments

from test_report import fake_run


def t_quantile(df: int) -> float:
    """Student's t at 97.5 % (scipy, a second to import: when the test runs, not while pytest collects)."""
    from scipy import stats

    return float(stats.t.ppf(0.975, df))


PAGE = Path(__file__).resolve().parents[1] / "docs" / "results.md"


def page_spread(table: str = "sparse-demo", column: str = "val loss at equal wall clock") -> tuple[float, int]:
    """The pooled standard deviation over seeds behind a results table's 95 % intervals, and its cells."""
    text = PAGE.read_text()
    section = text[text.index(f"### {table}:") :]
    section = section[: section.index("\n### ", 1)]
    lines = section.splitlines()
    head = [c.strip() for c in next(line for line in lines if line.startswith("| setting")).split("|")]
    sds = []
    for line in lines:
        cells = [c.strip() for c in line.split("|")]
        if line.startswith("| ") and len(cells) == len(head) and "±" in cells[head.index(column)]:
            seeds = int(cells[head.index("seeds")].split("/")[0])
            half = float(cells[head.index(column)].split("±")[1])
            sds.append(half * math.sqrt(seeds) / t_quantile(seeds - 1))
    return math.sqrt(sum(s * s for s in sds) / len(sds)), len(sds)


def test_the_recorded_spread_is_the_one_the_results_page_measured():
    sd, cells = page_spread()
    assert cells >= 5
    assert (
        abs(demo.SPREAD["sd"] - sd) / sd < 0.03
    ), f"docs/results.md's sparse-demo seeds now give {sd:.4f}: set runner/demo.py SPREAD to it"


def _single_seed_demo(root: Path, spread: dict | None) -> Path:
    fake_run(root / "cocodc" / "seed0", "cocodc", 0, [3.0, 2.5, 2.1592], wall=10)
    fake_run(root / "local_sgd" / "seed0", "local_sgd", 0, [3.0, 2.5, 2.1173], wall=10)
    runs = [{"label": s, "strategy": s, "setting": {}, "seed": 0, "dir": f"{s}/seed0"} for s in ("cocodc", "local_sgd")]
    (root / "experiment.json").write_text(json.dumps({"runs": runs, **({"spread": spread} if spread else {})}))
    return root


def test_a_demo_whose_leaders_are_within_the_spread_names_no_winner(tmp_path):
    rep = R.report(_single_seed_demo(tmp_path / "exp", dict(demo.SPREAD)), plots=False)
    assert "CoCoDC" in rep.verdict and "LocalSGD" in rep.verdict and "too close to call" in rep.verdict
    assert len(re.split(r"(?<=[.?!])\s+(?=[A-Z])", rep.verdict)) == 1 and rep.verdict.endswith(".")  # one sentence
    assert "too close to call" in (tmp_path / "exp" / "report.md").read_text()


def test_without_a_spread_the_winner_is_named_with_its_single_seed_said(tmp_path):
    rep = R.report(_single_seed_demo(tmp_path / "exp", None), plots=False)
    assert "LocalSGD had the best validation loss" in rep.verdict and "(one seed each)" in rep.verdict


def test_the_demo_records_its_spread_for_the_report(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(experiments, "run_and_report", lambda *a, **k: seen.update(k) or 0)
    assert demo.run_demo(str(tmp_path / "demo"), 2, False) == 0
    assert seen["extra"] == {"spread": dict(demo.SPREAD)} and seen["target_rule"] == "common"
