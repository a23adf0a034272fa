"""The results page as a person reads it: short human labels in place of run keys, one claim per
sentence and none over 60 words, and a figure beside each table (issue 50)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from wansync import results
from wansync.analysis.labels import human_label, label_of_key
from wansync.analysis.runs import Run, SettingRuns
from wansync.results import page as page_module
from wansync.results import measures

MAX_WORDS = 60


def sentences(markdown: str) -> list[str]:
    """The prose of a page: its sentences, tables, code, figures and headings left out."""
    prose, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith(("|", "![", "#", "<!--")) or not line.strip():
            continue
        prose.append(line.lstrip("- "))  # a generated line is a paragraph or an item: never wrapped
    return [s for line in prose for s in re.split(r"(?<=[.?!*])\s+(?=[*A-Z(β])", line) if s.strip()]


def _cells(t: results.Table) -> list[tuple[str, dict]]:
    return [(c["strategy"], {k: v for k, v in c.items() if k != "strategy"}) for c in t.cells]


def _runs(t: results.Table, tmp: Path, rng: random.Random) -> list[SettingRuns]:
    """Three made-up seeds per cell of `t`, with every figure the page reads."""
    out = []
    for strategy, setting in _cells(t):
        key = results.label(strategy, **setting)
        runs = []
        for seed in range(3):
            wall = 60 + 20 * rng.random()
            evals = [
                {"step": 25 * i, "time": wall * i / 8, "val_loss": 3.0 - 0.1 * i - 0.05 * rng.random()}
                for i in range(1, 9)
            ]
            profile = {
                "wall_clock_s": wall,
                "sum_s": wall,
                "residual_pct": 0.1,
                "categories_s": {"compute": 0.7 * wall, "exposed_comm": 0.1 * wall, "data": 0.2 * wall},
                "derived": {"sync_events": 4, "sync_events_per_epoch": 4, "peer_wait_pct": 1.0},
            }
            summary = {
                "peak_test_acc": 85 + 3 * rng.random(),
                "wall_clock_s": wall,
                "bytes_sent": 4e7,
                "final_val_loss": evals[-1]["val_loss"],
            }
            runs.append(Run(tmp / key / f"seed{seed}", key, strategy, seed, setting, "ok", summary, profile, evals))
        out.append(SettingRuns(key, strategy, setting, runs))
    return out


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> tuple[str, Path]:
    """The whole generated part, every table with made-up runs, and its figures."""
    tmp = tmp_path_factory.mktemp("page")
    rng = random.Random(0)
    made = {t.name: _runs(t, tmp, rng) for t in results.TABLES if not t.reads}
    mp = pytest.MonkeyPatch()
    fake = lambda root, name: made.get(name, [])  # noqa: E731
    mp.setattr(page_module, "load", fake)
    mp.setattr(measures, "load", fake)
    try:
        figures = tmp / "results_figures"
        return results.document(results.TABLES, tmp / "runs", figures=figures), figures
    finally:
        mp.undo()


def test_every_cell_has_a_short_label_of_words_not_keys():
    for t in results.TABLES:
        names = [human_label(s, setting) for s, setting in _cells(t)]
        assert len(set(names)) == len(names), t.name
        for name in names:
            assert "_" not in name and "=" not in name.replace(" = ", ""), name


def test_a_label_reads_as_the_literature_writes_it():
    assert human_label("cocodc", {"syncs_per_period": 8, "compensation": "alpha"}) == "CoCoDC, N = 8, α-merge"
    assert human_label("cpdp", {"sync_every": 4}) == "CPDP, K = 4"
    assert human_label("diloco", {"sync_every": 50, "codec": "int8"}) == "DiLoCo, H = 50, int8"
    assert label_of_key("streaming__sync_every=50__fragments=2__overlap=5") == "Streaming DiLoCo, H = 50, P = 2, τ = 5"
    assert human_label("nova", {"odd_knob": 3}) == "nova, odd knob 3"  # unknown: shown, never dropped


def test_no_sentence_of_the_page_is_longer_than_60_words(page):
    text, _ = page
    long = [s for s in sentences(text) if len(s.split()) > MAX_WORDS]
    assert not long, f"{len(long)} sentences over {MAX_WORDS} words; first: {long[0]}"


def test_no_run_key_appears_in_the_prose(page):
    text, _ = page
    keys = {k for t in results.TABLES for s, setting in _cells(t) if "=" in (k := results.label(s, **setting))}
    prose = "\n".join(
        line for line in text.splitlines() if not line.startswith(("|", "```", "wansync ", "The same runs as"))
    )
    assert not [k for k in keys if k in prose]


def test_every_table_has_its_figure_beside_it(page):
    text, figures = page
    for t in results.TABLES:
        section = text[text.index(f"### {t.name}:") :]
        section = section[: section.index("\n### ", 1)] if "\n### " in section[1:] else section
        assert f"![{t.name}: mean and 95 % interval per setting](results_figures/{t.name}.png)" in section
        assert (figures / f"{t.name}.png").read_bytes()[:4] == b"\x89PNG"


def test_each_answer_is_an_item_of_its_own(page):
    text, _ = page
    shows = text.split("**This run shows**")[1].split("**It cannot show**")[0]
    items = [line for line in shows.splitlines() if line.startswith("- ")]
    assert len(items) == len(results.TABLES[0].questions)


def test_a_figure_is_drawn_in_place_of_a_link_never_through_it(tmp_path):
    from wansync.analysis.interval_plot import interval_figure
    from wansync.analysis.stats import interval

    outside = tmp_path / "mine.png"
    outside.write_text("the user's")
    (tmp_path / "figs").mkdir()
    link = tmp_path / "figs" / "t.png"
    link.symlink_to(outside)
    interval_figure(link, "t", ["a", "b"], [("loss", [interval([1.0, 2.0, 3.0]), None])])
    assert outside.read_text() == "the user's" and not link.is_symlink()


def test_a_linked_figures_directory_is_refused_before_anything_runs(tmp_path):
    from wansync.errors import ConfigError

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "results_figures").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="results_figures: it is a link, not a directory"):
        page_module.check_page(tmp_path / "results.md")


def test_the_committed_page_reads_so_throughout():
    """docs/results.md as committed: every table's section was written by the current generator (its
    figure beside it, and there); no sentence of the whole page is over 60 words, and no run key
    stands in its prose (the hand-written parts above and below the generated one included)."""
    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "results.md").read_text()
    body = text[text.index(results.BEGIN) : text.index("<!-- results:end")]
    sections = {s[: s.index(":")]: s for s in body.split("\n### ")[1:]}
    assert sorted(sections) == sorted(t.name for t in results.TABLES)
    for name, s in sections.items():
        assert f"](results_figures/{name}.png)" in s, f"{name}: its section predates the figures"
        assert (root / "docs" / "results_figures" / f"{name}.png").is_file()
    long = [x for x in sentences(text) if len(x.split()) > MAX_WORDS]
    assert not long, f"{len(long)} sentences over {MAX_WORDS} words; first: {long[0]}"
    prose = "\n".join(line for line in text.splitlines() if not line.startswith(("|", "wansync ", "The same runs as")))
    keys = re.findall(r"\b[a-z_]+__[a-z_]+=[\w.]+", prose)
    assert not keys, f"run keys in the prose: {sorted(set(keys))[:3]}"
