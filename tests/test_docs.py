"""The documentation stays a short front door with pages that point inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# References to material outside the repository: the spec and design notes beside the checkout, and the
# seed documents (named like 000_71e0e618b1d6bb8f.txt). Cite papers by arXiv id instead.
OUTSIDE = re.compile(r"\.\./shared|spec\s*§|ALGORITHMS\.md|\b\d{3}_[0-9a-f]{8,}\b")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces turned into hyphens."""
    out = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_the_readme_is_a_front_door_of_at_most_150_lines():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 150


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert not missing, missing


@pytest.mark.parametrize("page", LINKED, ids=[p.relative_to(ROOT).as_posix() for p in LINKED])
def test_every_relative_link_resolves_inside_the_repository(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, broken


def outside_references(files: list[Path]) -> list[str]:
    hits = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        hits += [
            f"{f.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
            for m in OUTSIDE.finditer(text)
        ]
    return hits


def test_no_page_or_benchmark_cites_files_outside_the_repository():
    hits = outside_references(
        [*PAGES, *sorted((ROOT / "benchmarks").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.py"))]
    )
    assert not hits, "\n".join(hits)


def test_no_docstring_cites_files_outside_the_repository():
    hits = outside_references(sorted((ROOT / "src").rglob("*.py")))
    assert not hits, "\n".join(hits)


ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "src" / "wansync"


def named_modules(text: str) -> set[str]:
    """The modules and packages a page names in backticks: `runner/launch.py`, `ft/`,
    `wansync.comm.exchange`; a bare `base.py` on a line that names a package first (`strategies/`, a
    table row) is that package's."""
    names = set()
    for line in text.splitlines():
        package = ""
        for token in re.findall(r"`([^`\s]+)`", line):
            token = token.rstrip(",.;:")
            if token.startswith("wansync."):
                names.add(token.removeprefix("wansync.").replace(".", "/") + ".py")
            elif re.fullmatch(r"[a-z_]+/", token):
                names.add(package + token)
                package = package or token
            elif re.fullmatch(r"[a-z_]+(/[a-z_]+)*\.py", token) and not token.startswith(
                ("docs/", "tests/", "benchmarks/")
            ):
                names.add(token if "/" in token else package + token)
    return names


def test_every_module_the_architecture_page_names_exists():
    missing = [
        n
        for n in sorted(named_modules(ARCHITECTURE.read_text(encoding="utf-8")))
        if not (
            (PACKAGE / n).exists()
            or (PACKAGE / n.removesuffix(".py")).is_dir()
            or (PACKAGE / n.removesuffix(".py") / "__init__.py").exists()
        )
    ]
    assert not missing, missing


def test_the_architecture_page_names_every_package():
    named = {n.split("/")[0].removesuffix(".py") for n in named_modules(ARCHITECTURE.read_text(encoding="utf-8"))}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages - named == set()


def test_the_page_check_finds_a_module_that_does_not_exist():
    assert named_modules("see `runner/nowhere.py` and `wansync.comm.exchange`, not `docs/x.md`") == {
        "runner/nowhere.py",
        "comm/exchange.py",
    }
    assert named_modules("| `ft/` | the quorum (`quorum.py`), `trainer/loop.py` |") == {
        "ft/",
        "ft/quorum.py",
        "trainer/loop.py",
    }
