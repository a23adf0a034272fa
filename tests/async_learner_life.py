"""One life of an asynchronous learner that joins a running run (`async_diloco`'s JOIN_ENV): run as
`python async_learner_life.py LEARNER OUT`, with the syncer's address in the environment. It trains on
in a process group of its own until the syncer stops the run, then writes its events to OUT. A test
kills one such life mid-round and starts another (tests/test_async_diloco.py: `main` in processes forked
from the ranks' forkserver)."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import wansync as ws
from strategy_harness import rank_batch, tiny_model

OPTIONS = {"sync_every": 5, "merge_quorum": 2, "grace": 0.3, "max_staleness": 2}
RUN_STEPS, STEP_S = 60, 0.02


def padded_step(sync, learner: int, step_s: float) -> None:
    """One training step of learner `learner` on its batch, padded to `step_s` seconds: an emulated speed."""
    t0 = time.perf_counter()
    x, y = rank_batch(learner, sync.t)
    nn.functional.mse_loss(sync.model(x), y).backward()
    sync.step()
    sync.zero_grad()
    time.sleep(max(0.0, step_s - (time.perf_counter() - t0)))


def main(learner: int, out: str) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = tiny_model(learner + 100)  # not the run's initial model: the welcome's version replaces it
    sync = ws.strategy("async_diloco", model, torch.optim.AdamW(model.parameters(), lr=0.01), **OPTIONS)
    events: list[dict] = []
    sync.on_event(events.append)
    sync.on_event(lambda e: e["type"] == "sync" and open(out + ".synced", "a").close())  # a test waits for it
    while sync.continues(RUN_STEPS):
        padded_step(sync, learner, STEP_S)
    sync.finish()
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    with open(out, "w") as f:
        json.dump({"events": events, "steps": sync.t, "final_sum": float(final.double().sum())}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
