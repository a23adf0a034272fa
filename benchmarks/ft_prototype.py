"""Prototype: which torchft calls keep a LocalSGD-style run going on CPU when a replica dies.

Starts torchft's lighthouse in this process on 127.0.0.1, runs 3 replica processes (each its own
TCPStore and torchft Manager over a reconfigurable gloo group, min_replica_size=1), averages a tiny
model's parameters every few steps through `start_quorum` / `allreduce` / `should_commit`, kills
replica 1 mid-run, restarts it, and prints the participants of every sync. The restarted replica
heals from a live peer through the Manager's state_dict callbacks (torchft's HTTP checkpoint
transport), not from disk.

    PYTHONPATH=src python benchmarks/ft_prototype.py
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
import time
from datetime import timedelta


def replica(index: int, lighthouse: str, steps: int, sync_every: int) -> None:
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = {"step": 0}

    def save():  # clones: the HTTP transport serves CPU tensors by reference, after we move on
        return {
            "model": copy.deepcopy(model.state_dict()),
            "opt": copy.deepcopy(opt.state_dict()),
            "step": state["step"],
        }

    def load(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        state["step"] = sd["step"]
        print(f"replica {index}: healed from a peer at step {sd['step']}", flush=True)

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=load,
        state_dict=save,
        min_replica_size=1,
        use_async_quorum=False,
        replica_id=f"replica_{index}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=5),
        quorum_timeout=timedelta(seconds=30),
        init_sync=False,
    )
    gen = torch.Generator().manual_seed(100 + index)
    while state["step"] < steps:
        x = torch.randn(8, 4, generator=gen)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["step"] += 1
        time.sleep(0.05)
        if state["step"] % sync_every:
            continue
        while True:  # an exchange that failed (a peer died in it) is retried under the next quorum
            manager.start_quorum()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            participants = manager.num_participants()
            manager.allreduce(flat).wait()
            if manager.should_commit():
                break
            print(f"replica {index}: exchange at step {state['step']} failed, retrying", flush=True)
        torch.nn.utils.vector_to_parameters(flat, model.parameters())
        print(
            f"replica {index}: step {state['step']} participants {participants} " f"param0 {flat[0].item():.6f}",
            flush=True,
        )
    manager.shutdown(wait=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", type=int)
    ap.add_argument("--lighthouse")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sync-every", type=int, default=5)
    args = ap.parse_args()
    if args.replica is not None:
        return replica(args.replica, args.lighthouse, args.steps, args.sync_every)
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=1000)
    addr = lighthouse.address()
    print("lighthouse at", addr, flush=True)

    def spawn(i):
        return subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--replica",
                str(i),
                "--lighthouse",
                addr,
                "--steps",
                str(args.steps),
                "--sync-every",
                str(args.sync_every),
            ]
        )

    procs = [spawn(i) for i in range(3)]
    time.sleep(6.0)  # the replicas start in ~3 s, then sync every 0.25 s
    procs[1].kill()
    procs[1].wait()
    print("killed replica 1", flush=True)
    time.sleep(1.0)
    procs[1] = spawn(1)
    print("restarted replica 1", flush=True)
    codes = [p.wait() for p in procs]
    lighthouse.shutdown()
    print("exit codes", codes)


if __name__ == "__main__":
    main()
