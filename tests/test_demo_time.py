"""benchmarks/demo_time.py: the README's demo time is the figure that script measured and wrote."""

from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("demo_time", ROOT / "benchmarks" / "demo_time.py")
demo_time = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo_time)


def test_the_readme_holds_the_one_sentence_the_script_rewrites():
    assert len(demo_time.FIGURE.findall((ROOT / "README.md").read_text())) == 1


def test_the_figure_is_rounded_to_the_half_minute_and_dated():
    day = datetime.date(2026, 12, 5)
    assert (
        demo_time.phrase(7 * 60 + 28, 2, day)
        == "The demo (about 7.5 min on a fresh clone with 2 cores, setup included, measured 2026-12-05)"
    )
    assert demo_time.phrase(5 * 60 + 49, 1, day).startswith("The demo (about 6 min on a fresh clone with 1 core,")
    assert demo_time.FIGURE.fullmatch(demo_time.phrase(400, 2, day))


def test_a_readme_without_the_sentence_or_with_two_is_left_as_it_was(tmp_path):
    for text in ("no figure here\n", 2 * (demo_time.phrase(400, 2, datetime.date(2026, 1, 1)) + " runs.\n")):
        readme = tmp_path / "README.md"
        readme.write_text(text)
        with pytest.raises(SystemExit, match="exactly one sentence"):
            demo_time.rewrite(readme, demo_time.phrase(300, 2, datetime.date(2026, 1, 2)))
        assert readme.read_text() == text


def test_a_rewrite_changes_only_the_figure(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("head\n" + demo_time.phrase(400, 2, datetime.date(2026, 1, 1)) + " runs each strategy.\n")
    demo_time.rewrite(readme, demo_time.phrase(300, 2, datetime.date(2026, 1, 2)))
    assert readme.read_text() == (
        "head\nThe demo (about 5 min on a fresh clone with 2 cores, setup included, "
        "measured 2026-01-02) runs each strategy.\n"
    )
