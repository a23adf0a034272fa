"""benchmarks/README.md stays a short reference: each section a command, a date and the current figure,
and every command it shows runs (the script exists and declares every flag passed to it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "benchmarks" / "README.md"
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
SCRIPT = re.compile(r"(?:^|[\s/])benchmarks/([A-Za-z0-9_]+)\.py\b(.*)")
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
MAKE = re.compile(r"(?:^|[\s;&|(])make\s+(?:-\S+\s+)*([A-Za-z_][\w.-]*)")
WANSYNC = re.compile(r"(?:^|[\s;&|(/])(?:-m\s+)?wansync\s+([a-z][\w-]*)")


def sections(text: str) -> dict[str, str]:
    """The page's `## ` sections, by heading."""
    out, title = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
            out[title] = ""
        elif title is not None:
            out[title] += line + "\n"
    return out


def commands(text: str) -> list[str]:
    """The lines of the fenced blocks, `\\`-continuations joined and `#` comments dropped."""
    out = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        for line in re.sub(r"\\\n", " ", block).splitlines():
            line = re.split(r"(?:^|\s)#", line, maxsplit=1)[0].strip()
            if line:
                out.append(line)
    return out


def declared_flags(script: Path) -> set[str]:
    """The option strings a script passes to `add_argument` (string literals, any parser)."""
    flags = set()
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "add_argument":
            flags |= {
                a.value
                for a in node.args
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")
            }
    return flags


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z_][\w.-]*)\s*:(?!=)", text, flags=re.M))


def cli_subcommands() -> set[str]:
    text = (ROOT / "src" / "wansync" / "cli.py").read_text(encoding="utf-8")
    return set(re.findall(r"add_parser\(\s*[\"']([\w-]+)[\"']", text))


def problems(text: str) -> list[str]:
    """What is wrong with the commands of a page's fenced blocks."""
    found = []
    targets, subcommands = None, None
    for line in commands(text):
        m = SCRIPT.search(line)
        if m:
            script = ROOT / "benchmarks" / f"{m.group(1)}.py"
            if not script.exists():
                found.append(f"{line}: no benchmarks/{m.group(1)}.py")
                continue
            flags = declared_flags(script)
            for flag in FLAG.findall(m.group(2)):
                if flag.split("=")[0] not in flags:
                    found.append(f"{line}: benchmarks/{m.group(1)}.py declares no {flag}")
            continue
        m = MAKE.search(line)
        if m:
            targets = make_targets() if targets is None else targets
            if m.group(1) not in targets:
                found.append(f"{line}: no Makefile target {m.group(1)}")
            continue
        m = WANSYNC.search(line)
        if m:
            subcommands = cli_subcommands() if subcommands is None else subcommands
            if m.group(1) not in subcommands:
                found.append(f"{line}: no `wansync {m.group(1)}` subcommand")
    return found


def test_the_page_has_at_most_400_lines():
    assert len(PAGE.read_text(encoding="utf-8").splitlines()) <= 400


def test_every_section_has_a_fenced_command_and_a_date():
    secs = sections(PAGE.read_text(encoding="utf-8"))
    assert secs
    missing = [t for t, body in secs.items() if not commands(body) or not DATE.search(body)]
    assert not missing, missing


def test_every_command_names_a_script_or_target_that_exists_with_flags_it_declares():
    found = problems(PAGE.read_text(encoding="utf-8"))
    assert not found, "\n".join(found)


def test_the_check_finds_a_bad_script_flag_target_and_subcommand():
    page = "\n".join(
        [
            "```",
            ".venv/bin/python benchmarks/adapt.py --no-such-flag   # --comment-flag is fine",
            "sudo .venv/bin/python benchmarks/no_such_benchmark.py",
            "make no-such-target",
            "wansync no-such-subcommand --x",
            "```",
        ]
    )
    found = problems(page)
    assert len(found) == 4, found
    assert "--no-such-flag" in found[0] and "--comment-flag" not in found[0]
