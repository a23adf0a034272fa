"""`wansync train --wan ...` is checked in the launching process: one line, non-zero exit, no worker.

All invocations start side by side (each fails in the launcher before any worker is spawned).
A successful `--wan` run and its run files are covered in test_profiler.py.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

CASES = {
    "rtt=16.6ms,bw=0gbit": "bandwidth must be a positive finite rate",
    "rtt=16.6ms,bw=-1gbit": "bw='-1gbit': expected a rate",
    "moon-base": "unknown preset 'moon-base'",
    "rtt=16.6,bw=1gbit": "rtt='16.6': expected a number with a unit",
    "rtt=16.6ms": "missing bw",
    "two-site,,bw=1gbit": "empty item between commas",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    procs = {}
    for i, spec in enumerate(CASES):
        cmd = [sys.executable, "-m", "wansync", "train", "--workers", "2", "--steps", "2",
               "--wan", spec, "--out", str(root / f"run{i}")]
        procs[spec] = (root / f"run{i}", subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                          text=True))
    out = {}
    try:
        for spec, (run_dir, p) in procs.items():
            stdout, stderr = p.communicate(timeout=100)
            out[spec] = (p.returncode, stdout, stderr, run_dir)
    finally:
        for _, p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.mark.parametrize("spec", list(CASES))
def test_bad_wan_is_one_line_and_nonzero(results, spec):
    code, stdout, stderr, run_dir = results[spec]
    assert code != 0
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("wansync: error: ") and CASES[spec] in lines[0], lines[0]
    assert "Traceback" not in stderr
    assert not (run_dir / "logs").exists()  # rejected before any worker started
