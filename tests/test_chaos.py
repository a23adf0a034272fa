"""The chaos benchmark's short version (benchmarks/chaos.py): three hosts of the namespace bed, each a
torchrun node of one fault-tolerant worker of two FSDP ranks with its own run directory, the run under a
seeded schedule of a whole host killed and started again and a rank killed; every check of the benchmark
must hold, and nothing may be left behind. Its processes are forks of tests/forked_python.py's stand-in
(`--python`); the benchmark's own default, a fresh interpreter each, is what benchmarks/README.md reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import netns

WHY = netns.unavailable()
pytestmark = [pytest.mark.timeout(400), pytest.mark.skipif(WHY is not None, reason=WHY or "")]
CHAOS = Path(__file__).resolve().parents[1] / "benchmarks" / "chaos.py"


def test_a_host_restarted_whole_and_a_killed_rank_leave_the_run_whole(tmp_path, forked_python):
    out = tmp_path / "chaos.json"
    # the fault-free run is the benchmark's reference (benchmarks/README.md); here the run's own start is
    flags = ["--kinds", "host,kill", "--faults", "2", "--steps", "60", "--timeout", "150", "--no-fault-free"]
    flags += ["--json", str(out), "--python", forked_python.executable]  # forked: no torch import per process
    env = dict(os.environ, **forked_python.env)
    r = subprocess.run([sys.executable, str(CHAOS), *flags], capture_output=True, text=True, timeout=380, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["processes_left"], result["namespaces_left"]) == (0, 0), result
    (chaos,) = result["runs"]
    shown = json.dumps(result, indent=1)[:4000]
    assert chaos["chaos"] and chaos["codes"] == [0, 0, 0] and chaos["finished"], shown  # no agent hung, none failed
    assert sorted(f["kind"] for f in chaos["faults"]) == ["host", "kill"] and all(
        f["done"] for f in chaos["faults"]
    ), shown
    assert chaos["same_anchors"].startswith("yes"), shown  # every worker's anchors equal at every step compared
    assert chaos["forward"] and chaos["bad_checkpoints"] == [] and chaos["checkpoints"] > 0, shown
    assert chaos["processes_left"] == 0 and chaos["longest_wait_s"] < 4 * 4.0, shown
    # the restarted host took its place again and healed; the killed rank's worker restarted and healed
    assert chaos["summary"]["rejoins"] >= 2 and chaos["summary"]["heals"] >= 2, shown
    # it learned through both faults: the fault-free run ends near 3.36 from about 4.2 at its first step
    assert chaos["fault_free_loss"] is None and chaos["loss"] < chaos["first_loss"] - 0.5, shown


def test_the_benchmark_refuses_a_python_that_is_not_an_executable_file(tmp_path):
    plain = tmp_path / "python"
    plain.write_text("not a program")
    for given in (tmp_path / "missing", plain, tmp_path):
        r = subprocess.run([sys.executable, str(CHAOS), "--python", str(given)], capture_output=True, text=True)
        assert r.returncode != 0 and r.stderr.strip().splitlines() == [
            f"chaos: --python {given}: not an executable file"
        ], r.stderr
