"""A fault-tolerant training loop of your own: one process per worker, each its own process group;
the exchanges average over torchft's quorum of the workers alive. A worker that dies is restarted by
your process supervisor (below: a shell loop), rejoins the others at their next synchronization and
heals from a live peer (model, inner optimizer, strategy state, its step); no checkpoint is read.

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 --heartbeat_timeout_ms 2000 --bind 127.0.0.1:29510 &
    python examples/ft_loop.py --worker 0 --workers 2 --lighthouse 127.0.0.1:29510 --out runs/ft_loop &
    for life in 0 1 2; do                          # worker 1 dies at step 6; its supervisor restarts it
        WANSYNC_RESTARTED=$((life > 0)) python examples/ft_loop.py --worker 1 --workers 2 \\
            --lighthouse 127.0.0.1:29510 --out runs/ft_loop --die-at 6 && break
    done
    wansync report runs/ft_loop                    # each worker's run directory

The model and data are a stand-in (as in examples/own_loop.py): put yours in their place, built from
the same seed on every worker. docs/fault_tolerance.md ("In your own loop") says what each line does.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import wansync as ws
from wansync.errors import WansyncError


def batch(worker: int, step: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker `worker`'s batch of step `step` (a restarted worker reads on from its healed step)."""
    g = torch.Generator().manual_seed(1000 * step + worker)
    x = torch.randn(n, 16, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()


def validate(model: nn.Module) -> dict[str, float]:
    x, y = batch(worker=-1, step=0, n=512)
    with torch.no_grad():
        return {"val_loss": F.cross_entropy(model(x), y).item()}


def train(a: argparse.Namespace) -> None:
    out = Path(a.out) / f"worker{a.worker if a.worker is not None else os.environ.get('RANK', 0)}"
    ws.init(fault_tolerant=True)  # this worker is a process group of its own
    ft = ws.FaultTolerance(
        lighthouse=a.lighthouse, worker=a.worker, workers=a.workers, peer_timeout=a.peer_timeout, log_dir=out / "logs"
    )
    torch.manual_seed(0)  # the same initial model on every worker
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # joins the others; a restarted worker heals here from a live peer, sync.t is then their step
    sync = ws.strategy("diloco", model, optimizer, sync_every=a.sync_every, fault_tolerant=ft)
    with ws.Run(sync, out=out, steps=a.steps, append=sync.t > 0, quiet=True) as run:
        while sync.t < a.steps:
            x, y = batch(a.worker, sync.t)
            loss = F.cross_entropy(sync.model(x), y)
            loss.backward()
            sync.step()  # at a boundary: the quorum's mean
            sync.zero_grad()
            run.log(loss, items=len(x))
            if sync.t == a.die_at and not ft.restarted:  # the fault: this process dies, as a crash would
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(a.step_time)  # a stand-in for a real step's compute
        sync.finish()  # the final quorum, then the last outer step if due
        run.evaluate(validate(model))
    torch.save(model.state_dict(), out / "final.pt")
    print(
        f"worker {ft.worker}{' (restarted)' if ft.restarted else ''}: {sync.t} steps, final val_loss "
        f"{run.evals[-1]['val_loss']:.4f}: {out}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", type=int, help="this worker's index (default: $RANK)")
    p.add_argument("--workers", type=int, help="the run's workers (default: $WORLD_SIZE)")
    p.add_argument("--lighthouse", help="HOST:PORT of torchft's lighthouse (default: $WANSYNC_LIGHTHOUSE)")
    p.add_argument("--out", default="runs/ft_loop")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--peer-timeout", type=float, default=10.0)
    p.add_argument("--step-time", type=float, default=0.1, help="seconds each step sleeps (a stand-in for compute)")
    p.add_argument("--die-at", type=int, help="this worker kills itself after this step (not once restarted)")
    a = p.parse_args()
    try:
        train(a)
    except WansyncError as e:  # a bad option, no lighthouse, no peer: one line
        sys.exit(f"ft_loop: error: {e}")


if __name__ == "__main__":
    main()
