"""Your own training loop with the tools of `wansync train`: `ws.Run` around it gives the profiler whose
categories add up to the wall clock (DDP's exposed communication included), metrics.jsonl,
profile.json and summary.json in a run directory `wansync report` reads, TensorBoard scalars and
the progress bar; `ws.strategy` warns of settings known to go wrong (docs/guards.md).

    python examples/own_loop.py --out runs/own_loop/ddp                          # one process
    torchrun --nproc-per-node 2 examples/own_loop.py --strategy diloco --sync-every 5 \\
        --wan lan --tensorboard --out runs/own_loop/diloco                        # two ranks, emulated link
    wansync report runs/own_loop                                                  # both runs, side by side
    tensorboard --logdir runs/own_loop

The model and data are a stand-in (a small classifier on synthetic data, different on every rank):
put yours in their place. docs/your_model.md says what each line does.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import wansync as ws


def batch(rank: int, step: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch of step `step`: 16 features, 4 classes a small network can learn."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 16, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()


def validate(model: nn.Module) -> dict[str, float]:
    x, y = batch(rank=-1, step=0, n=512)  # the same held-out batch on every rank
    with torch.no_grad():
        return {"val_loss": F.cross_entropy(model(x), y).item()}


def train(
    out: str,
    strategy: str = "ddp",
    steps: int = 30,
    eval_every: int = 10,
    tensorboard: bool = False,
    group: Any = None,
    **options: Any,
) -> dict[str, Any]:
    """Train on the current process group (or `group`); returns the run's summary."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = ws.strategy(strategy, model, optimizer, group=group, **options)
    rank = dist.get_rank()
    with ws.Run(sync, out=out, steps=steps, tensorboard=tensorboard) as run:
        for step in range(steps):
            x, y = batch(rank, step)
            loss = F.cross_entropy(sync.model(x), y)
            loss.backward()
            sync.step()
            sync.zero_grad()
            run.log(loss, items=len(x))
            if sync.t % eval_every == 0 and sync.t < steps:
                run.evaluate(validate(model))  # on every rank: the mean over ranks is kept
        sync.finish()  # every rank holds the same model
        run.evaluate(validate(model))  # the final evaluation, at the last step
    return run.summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/own_loop/run")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--sync-every", type=int, help="the strategy's sync_every (not for ddp)")
    p.add_argument("--wan", help="an emulated link: lan, two-site, cross-region, ... (docs/emulator.md)")
    p.add_argument("--tensorboard", action="store_true")
    a = p.parse_args()
    ws.init(wan=a.wan)
    options = {} if a.sync_every is None else {"sync_every": a.sync_every}
    summary = train(a.out, a.strategy, a.steps, tensorboard=a.tensorboard, **options)
    if dist.get_rank() == 0:
        print(
            f"final val_loss {summary['final_val_loss']:.4f}, exposed communication "
            f"{summary['exposed_comm_pct']:.1f} % of {summary['wall_clock_s']:.2f} s: {a.out}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
