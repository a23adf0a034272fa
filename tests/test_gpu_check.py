"""benchmarks/gpu_check.py (`make gpu-check`) where CI runs: without CUDA it says so in one line, exits 0 and
writes nothing; its table, rendered from a recorded JSON (a made-up fixture), shows each part's figures and
a failed part or row as failed with its reason."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
from cli_harness import forked_script
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SAMPLE = Path(__file__).parent / "data" / "gpu_check_sample.json"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _module()


def _script(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return forked_script(SCRIPT, args, cwd=cwd or ROOT)


def _cells(table: str, first: str) -> list[str]:
    """The cells of the table row whose first cell is `first`."""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in:\n{table}")


def _section(table: str, name: str) -> str:
    """The lines of the part's own table (after its `## name` heading, up to the next heading)."""
    text = table.split(f"\n## {name}\n", 1)[1]
    return text.split("\n## ", 1)[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour where there is no CUDA")
def test_without_cuda_it_prints_one_line_exits_0_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    r = _script(["--out", str(out)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("gpu-check: no CUDA device here (torch ")
        and lines[0].endswith("nothing to check")
    )
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_render_shows_the_parts_and_their_figures():
    import json

    table = gpu_check.render(json.loads(SAMPLE.read_text()))
    assert table.startswith("# gpu-check: NVIDIA H100 80GB HBM3 x1")
    assert "torch 2.13.0+cu128, CUDA 12.8, NCCL 2.27.3" in table
    assert _cells(table, "kernels")[:3] == ["kernels", "ok", "2.1"]
    assert _cells(table, "codec int8 encode")[:4] == ["codec int8 encode", "ok", "1.25", "214.75"]
    memory = _section(table, "memory")
    cell = dict(zip(_cells(memory, "name"), _cells(memory, "diloco")))
    assert cell["planner_MB"] == "466.25" and cell["measured_MB"] == "470.1" and cell["planner-measured_%"] == "-0.82"


def test_a_failed_part_and_a_failed_row_render_as_failed_with_their_reason():
    import json

    table = gpu_check.render(json.loads(SAMPLE.read_text()))
    assert _cells(table, "throughput") == [
        "throughput",
        "failed",
        "14.8",
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    ]
    assert _cells(table, "strategies")[1:] == ["failed", "101.3", "1 of 2 failed: sparseloco"]
    row = _cells(table, "sparseloco")
    assert row[1] == "failed" and row[-1] == "RuntimeError: exit 1: wansync: error: NCCL all_gather timed out"


def test_render_from_the_command_line_prints_the_same_table():
    import json

    r = _script(["--render", str(SAMPLE)])
    assert r.returncode == 0, r.stderr
    assert r.stdout == gpu_check.render(json.loads(SAMPLE.read_text()))


def test_a_part_that_raises_is_recorded_failed_and_the_check_goes_on():
    def broken():
        raise ValueError("no such kernel\nsecond line")

    part = gpu_check.guarded(broken)
    assert part["status"] == "failed" and part["reason"] == "ValueError: no such kernel | second line"
    budget = gpu_check.Budget(0)
    r = gpu_check.row("late", lambda: {"x": 1}, budget)
    assert r["status"] == "failed" and "budget" in r["reason"]


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda d: d / "missing.json", "--render file not found"),
        (lambda d: d, "is a directory, not a regular file"),
        (lambda d: (d / "g.json").write_text("not json") and d / "g.json", "is not JSON"),
        (lambda d: (d / "l.json").write_text("[1, 2]") and d / "l.json", "is not a gpu-check record"),
    ],
    ids=["missing", "directory", "garbage", "not-a-record"],
)
def test_render_of_a_file_that_is_no_record_is_one_line(tmp_path, capsys, make, says):
    assert gpu_check.main(["--render", str(make(tmp_path))]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("gpu_check: error: ") and says in err, err
