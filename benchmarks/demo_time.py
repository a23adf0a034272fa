"""How long `make demo` takes on a fresh clone, and the README's figure rewritten from the measurement.

    python benchmarks/demo_time.py            # clone HEAD into a temporary folder, time `make setup` and
                                              # `make demo` there, print both
    python benchmarks/demo_time.py --write    # and put the measured total into README.md

A fresh clone is what a new user has: the first `make demo` creates the venv (the pinned torch from
the package registry) before it trains, so the README's figure is the sum of the two. The clone is
removed afterwards, whatever happens. Run it on idle cores: the figure is the machine's, not ours.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# the README's sentence this script owns: "The demo (about 7 min on a fresh clone with 2 cores, ...)"
FIGURE = re.compile(
    r"The demo \(about [^()]*? on a fresh clone with \d+ cores?, (?:setup included, )?measured \d{4}-\d{2}-\d{2}\)"
)


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(round(seconds % 60))} s"


def phrase(total_s: float, cores: int, day: datetime.date) -> str:
    """What the README says: the total rounded to the half minute, cores and date."""
    halves = max(1, round(total_s / 30))
    amount = f"{halves // 2}{'.5' if halves % 2 else ''} min"
    return f"The demo (about {amount} on a fresh clone with {cores} core{'s' if cores != 1 else ''}, setup included, measured {day.isoformat()})"


def timed(cmd: list[str], cwd: Path, log: Path) -> float:
    t0 = time.monotonic()
    with open(log, "ab") as out:
        rc = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=_env()).returncode
    if rc != 0:
        raise SystemExit(f"demo_time: `{' '.join(cmd)}` failed with exit {rc}; its output is in {log}")
    return time.monotonic() - t0


def _env() -> dict[str, str]:
    """The caller's environment without this checkout's venv, so the clone builds its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    venv_bin = str(REPO / ".venv" / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    return env


def rewrite(readme: Path, new: str) -> None:
    text = readme.read_text(encoding="utf-8")
    if len(FIGURE.findall(text)) != 1:
        raise SystemExit(
            f"demo_time: {readme} does not hold exactly one sentence this script owns "
            f"({FIGURE.pattern}); nothing written"
        )
    readme.write_text(FIGURE.sub(new, text), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="put the measured figure into README.md")
    ap.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    args = ap.parse_args(argv)
    if shutil.which("make") is None or shutil.which("git") is None:
        raise SystemExit("demo_time: needs git and make")
    work = Path(tempfile.mkdtemp(prefix="wansync-demo-time-"))
    log = work / "demo_time.log"
    try:
        clone = work / "wansync"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        setup = timed(["make", "setup"], clone, log)
        demo = timed(["make", "demo"], clone, log)
        total, cores = setup + demo, os.cpu_count() or 1
        print(
            f"fresh clone of {REPO.name} at {_head()}: make setup {minutes(setup)}, make demo {minutes(demo)}, "
            f"total {minutes(total)} on {cores} cores"
        )
        said = phrase(total, cores, datetime.date.today())
        print(said)
        if args.write:
            rewrite(README, said)
            print(f"written into {README}")
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _head() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
