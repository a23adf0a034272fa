"""`wansync train --wan ...` is checked in the launching process: one line, non-zero exit, no worker.

Each invocation runs the command line's `main` in-process, as test_bad_inputs.py does: it fails
in the launcher before any worker is spawned. A successful `--wan` run and its run files are
covered in test_profiler.py.
"""

from __future__ import annotations

import pytest

from wansync.cli import main

pytestmark = pytest.mark.timeout(120)

CASES = {
    "rtt=16.6ms,bw=0gbit": "bandwidth must be a positive finite rate",
    "rtt=16.6ms,bw=-1gbit": "bw='-1gbit': expected a rate",
    "moon-base": "unknown preset 'moon-base'",
    "rtt=16.6,bw=1gbit": "rtt='16.6': expected a number with a unit",
    "rtt=16.6ms": "missing bw",
    "two-site,,bw=1gbit": "empty item between commas",
}


@pytest.mark.parametrize("spec", list(CASES))
def test_bad_wan_is_one_line_and_nonzero(tmp_path, capsys, spec):
    run_dir = tmp_path / "run"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["train", "--workers", "2", "--steps", "2", "--wan", spec, "--out", str(run_dir)])
    code, stderr = int(e.value.code or 0), capsys.readouterr().err
    assert code != 0
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("wansync: error: ") and CASES[spec] in lines[0], lines[0]
    assert "Traceback" not in stderr
    assert not (run_dir / "logs").exists()  # rejected before any worker started
