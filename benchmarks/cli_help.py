"""How long `wansync --help` takes, beside a bare interpreter, measured side by side in one run.

Each command runs `--runs` times as a fresh process, the commands interleaved (python -c pass,
wansync --help, wansync train --help, wansync plan --help, then again), so machine noise hits every
side alike; the median wall clock per command is reported, and each one's difference from the bare
interpreter: what the command itself costs. Issue 60's target: every `--help` within 1 s.

    .venv/bin/python benchmarks/cli_help.py [--runs 21]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def commands() -> dict[str, list[str]]:
    """label -> argv: the bare interpreter, and the `wansync` entry point beside this Python."""
    script = Path(sys.executable).with_name("wansync")
    wansync = [str(script)] if script.exists() else [shutil.which("wansync") or "wansync"]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "wansync --help": [*wansync, "--help"],
        "wansync train --help": [*wansync, "train", "--help"],
        "wansync plan --help": [*wansync, "plan", "--help"],
    }


def once(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=21, help="runs of each command (default 21)")
    args = ap.parse_args()
    cmds = commands()
    for argv in cmds.values():  # warm: byte-compiled files and the page cache, as a user's second call
        once(argv)
    times: dict[str, list[float]] = {label: [] for label in cmds}
    for _ in range(args.runs):
        for label, argv in cmds.items():
            times[label].append(once(argv))
    median = {label: statistics.median(t) for label, t in times.items()}
    bare = median["python -c pass"]
    print(
        f"# cli_help  {datetime.date.today()}  {platform.machine()}  {os.cpu_count()} cores  "
        f"Python {platform.python_version()}  median of {args.runs} runs each, interleaved"
    )
    print(f"{'command':<24} {'median s':>9} {'min s':>7} {'over python -c pass':>20}")
    for label, m in median.items():
        extra = "" if label == "python -c pass" else f"{m - bare:+.3f} s"
        print(f"{label:<24} {m:>9.3f} {min(times[label]):>7.3f} {extra:>20}")
    print(f"reproduce: .venv/bin/python benchmarks/cli_help.py --runs {args.runs}")


if __name__ == "__main__":
    main()
