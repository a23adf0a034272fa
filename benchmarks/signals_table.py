"""The signals table of docs/reliability.md: what each signal does to a running 2-worker run.

For each case a tiny DDP run of 100000 steps (a checkpoint every 2 steps) is started in a session
of its own and signalled once past its first checkpoint; the row records the launcher's exit
status, what it printed on stderr, how many processes of the run are left 5 s later, and whether
`wansync train --resume` continues from the newest checkpoint.

    .venv/bin/python benchmarks/signals_table.py            # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from wansync.runner.workerproc import live_workers

TINY = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2", "--threads", "1"]
CASES = ("SIGINT to the process group", "SIGTERM to the launcher", "SIGKILL to the launcher", "SIGKILL to a worker")


def run_pids(run: Path) -> dict[int, bytes]:
    """pid -> RANK of every live worker of the run, forked or fresh."""
    return {pid: str(rank).encode() for rank, pid in live_workers(run).items()}


def steps_done(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max([0, *(json.loads(s)["step"] for s in lines[:-1])])  # the last line may be half-written


def measure(case: str, run: Path) -> str:
    cmd = [
        sys.executable,
        "-m",
        "wansync",
        "train",
        "--strategy",
        "ddp",
        "--workers",
        "2",
        "--steps",
        "100000",
        "--checkpoint-every",
        "2",
        "--quiet",
        "--out",
        str(run),
        *TINY,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # as a foreground job
    while steps_done(run) <= 2 and proc.poll() is None:
        time.sleep(0.1)
    workers = {int(rank): pid for pid, rank in run_pids(run).items() if rank}
    started = time.monotonic()
    {
        CASES[0]: lambda: os.killpg(proc.pid, signal.SIGINT),
        CASES[1]: proc.terminate,
        CASES[2]: proc.kill,
        CASES[3]: lambda: os.kill(workers[1], signal.SIGKILL),
    }[case]()
    code = proc.wait(timeout=120)
    ended = time.monotonic() - started
    os.set_blocking(proc.stderr.fileno(), False)
    err = (proc.stderr.read() or b"").decode(errors="replace").strip()
    time.sleep(5)
    left = run_pids(run)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    step = max(int(d.name[4:]) for d in (run / "checkpoints").glob("step*"))
    resumed = subprocess.run(
        [sys.executable, "-m", "wansync", "train", "--resume", str(run), "--steps", str(step + 1)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    resumable = f"yes, from step {step}" if resumed.returncode == 0 else f"no: {resumed.stderr.strip()[:80]}"
    message = " / ".join(f"`{line}`" for line in err.splitlines()) or "none"
    status = f"{128 + signal.SIGKILL} in a shell (killed by SIGKILL)" if code == -signal.SIGKILL else str(code)
    return f"| {case} | {status} | {message} | {len(left)} | {resumable} | {ended:.1f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="rows per case")
    args = parser.parse_args()
    print(
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; command: {' '.join(['benchmarks/signals_table.py', *sys.argv[1:]])}\n"
    )
    print("| signal | exit status | message | processes left after 5 s | resumable | launcher exit s |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            for n, case in enumerate(CASES):
                print(measure(case, Path(tmp) / f"run{i}-{n}"), flush=True)


if __name__ == "__main__":
    main()
