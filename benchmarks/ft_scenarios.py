"""Fault scenarios × strategies under --fault-tolerant: participants per exchange, time to recover,
final validation loss against the fault-free run of the same seed (a markdown table on stdout).

Scenarios (worker 1 or 2 of W; tiny LM, gloo on 127.0.0.1):
  fault-free          no fault (the reference)
  kill                worker 2 SIGKILLed after step 12, not restarted
  stop                worker 2 SIGSTOPped after step 12; SIGCONT once the others left it out
  kill in exchange    worker 2 SIGKILLed inside its first exchange at or after step 12
  kill + restart      worker 2 killed after step 12, restarted (--max-restarts 1), healed from a peer
  two failures        worker 1 killed after step 12, worker 2 after step 17, both restarted

Columns: participants per exchange (rank 0's quorums, run-length: "3×2 2×5" = 3 for two slots, then
2 for five), the longest quorum rank 0 waited (the stall a failure costs the survivors, s), the
step the missing worker was back at (heal), steps lost per worker, final loss and its difference
from the fault-free run.

    PYTHONPATH=src python benchmarks/ft_scenarios.py [--workers 3 --steps 100 --strategies diloco,streaming,...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from wansync.runner.workerproc import live_workers

TINY = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "4", "--threads", "1"]
FRAGMENTS = ["--sync-every", "8", "--fragments", "2", "--overlap", "2"]
STRATEGY_ARGS = {
    "local_sgd": ["--sync-every", "5"],
    "slowmo": ["--sync-every", "5"],
    "diloco": ["--sync-every", "5"],
    "streaming": FRAGMENTS,
    "cocodc": FRAGMENTS,
}
SCENARIOS = {
    "fault-free": ("", []),
    "kill": ("rank=2,step=12,action=kill", []),
    "stop": ("rank=2,step=12,action=stop", []),
    "kill in exchange": ("rank=2,step=12,action=kill_in_exchange", []),
    "kill + restart": ("rank=2,step=12,action=kill", ["--max-restarts", "1"]),
    "two failures": ("rank=1,step=12,action=kill;rank=2,step=17,action=kill", ["--max-restarts", "1"]),
}


def quorums(out: Path, rank: int) -> list[dict]:
    path = out / "logs" / f"quorum_rank{rank}.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(x) for x in lines if x.strip().endswith("}")]  # a line being written is left for later


def continue_when_left_out(proc: subprocess.Popen, out: Path, workers: int) -> None:
    """The stop scenario: once a quorum of rank 0 after start-up has a worker missing, SIGCONT the
    stopped worker (start-up quorums grow one worker at a time)."""
    while proc.poll() is None and not any(q["participants"] < workers and q["step"] > 0 for q in quorums(out, 0)):
        time.sleep(0.5)
    for pid in live_workers(out).values():
        try:
            stopped = Path(f"/proc/{pid}/stat").read_text().split()[2] == "T"
        except OSError:
            continue
        if stopped:
            os.kill(pid, signal.SIGCONT)


def run(out: Path, strategy: str, scenario: str, workers: int, steps: int) -> dict:
    fault, extra = SCENARIOS[scenario]
    cmd = [
        sys.executable,
        "-m",
        "wansync",
        "train",
        "--strategy",
        strategy,
        *STRATEGY_ARGS[strategy],
        "--workers",
        str(workers),
        "--steps",
        str(steps),
        "--eval-every",
        "1000",
        "--fault-tolerant",
        "--peer-timeout",
        "10",
        "--quiet",
        "--out",
        str(out),
        *TINY,
        *extra,
    ]
    env = dict(os.environ, **({"WANSYNC_FAULT": fault} if fault else {}))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if "stop" in fault:
        continue_when_left_out(proc, out, workers)
    _, err = proc.communicate(timeout=600)
    wall = time.perf_counter() - t0
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    last: dict[int, dict] = {}
    for q in quorums(out, 0):
        last[q["step"]] = q
    seq = [last[s]["participants"] for s in sorted(last)]
    runs: list[list[int]] = []
    for p in seq:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    heals = (
        [json.loads(x) for x in (out / "logs" / "heals.jsonl").read_text().splitlines()]
        if (out / "logs" / "heals.jsonl").is_file()
        else []
    )
    return {
        "rc": proc.returncode,
        "error": err.strip().splitlines()[-1] if proc.returncode else "",
        "participants": " ".join(f"{p}×{n}" for p, n in runs),
        "stall_s": max((q["seconds"] for q in quorums(out, 0)[1:]), default=0.0),
        "back_at": ",".join(str(h["step"]) for h in heals) or "-",
        "steps_lost": summary.get("steps_lost"),
        "loss": summary.get("final_val_loss"),
        "wall_s": wall,
        "same": same_parameters(out),
    }


def same_parameters(out: Path) -> str:
    """Whether the workers that saved the final checkpoint hold bitwise the same parameters: "yes (N)"
    for N workers, "NO", or "-" without a checkpoint."""
    import torch

    final = sorted((out / "checkpoints").glob("step*"))
    files = sorted(final[-1].glob("rank*.pt")) if final else []
    if not files:
        return "-"
    models = [torch.load(f, weights_only=False)["model"] for f in files]
    same = all(torch.equal(models[0][k], m[k]) for m in models[1:] for k in models[0])
    return f"yes ({len(models)})" if same else "NO"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--strategies", default=",".join(STRATEGY_ARGS))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = ap.parse_args()
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    load = os.getloadavg()[0]
    print(
        f"command: PYTHONPATH=src python benchmarks/ft_scenarios.py --workers {args.workers} --steps {args.steps} "
        f"--strategies {args.strategies} --scenarios '{args.scenarios}'"
    )
    print(f"date: {started}; machine: {platform.machine()}, {os.cpu_count()} cores; load average at start {load:.1f}\n")
    print(
        "| strategy | scenario | exit | participants per exchange | longest quorum s | healed at | steps lost "
        "| same parameters at the end | final val loss | vs fault-free | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            clean = None
            for scenario in args.scenarios.split(","):
                r = run(
                    Path(tmp) / f"{strategy}-{scenario.replace(' ', '_')}", strategy, scenario, args.workers, args.steps
                )
                clean = r["loss"] if scenario == "fault-free" else clean
                delta = f"{r['loss'] - clean:+.4f}" if r["loss"] is not None and clean is not None else "-"
                loss = f"{r['loss']:.4f}" if r["loss"] is not None else "-"
                print(
                    f"| {strategy} | {scenario} | {r['rc']}{' ' + r['error'] if r['error'] else ''} | "
                    f"{r['participants']} | {r['stall_s']:.2f} | {r['back_at']} | {r['steps_lost']} | {r['same']} | {loss} | "
                    f"{delta} | {r['wall_s']:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
