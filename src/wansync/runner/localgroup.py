"""Process groups on one machine: a loopback rendezvous store and a runner for M ranks.

Used by `wansync.init()` outside torchrun, by the tests and by the benchmarks. The store is
held by the calling process on a socket bound to 127.0.0.1 (no port race, loopback only).

Ranks are forked from a forkserver that has imported torch once (multiprocessing's
"forkserver" context): a rank starts in ~0.05 s instead of the ~2 s a fresh interpreter spends
importing torch, and the server is a clean process (no threads, no torch op run), so forking
it is safe. Each rank gets the caller's environment as it is at the call, as spawn would give it.
A rank's result comes back sealed (`trust.sealed`: tensors and plain data, nothing unpickled) under
a key drawn for the call.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..trust.sealed import seal, unseal


class LoopbackStore:
    """A TCPStore server on 127.0.0.1 that lives as long as this object."""

    def __init__(self, timeout_s: float = 60.0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(512)
        self.port = self.sock.getsockname()[1]
        self.store = dist.TCPStore(
            "127.0.0.1",
            self.port,
            None,
            True,
            datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=self.sock.fileno(),
        )
        self.sock.detach()  # the store owns the listening socket now

    def close(self) -> None:
        self.store = None


def join_group(port: int, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 60.0) -> None:
    """Join the group whose store the parent holds on 127.0.0.1:port."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=timeout_s))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )


# _dynamo: the first optimizer imports it; wansync.cli and what its train imports: the tests' CLI
# processes (tests/cli_harness.py) fork from this server too
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "wansync.runner.localgroup",
    "wansync.cli",
    "wansync.runner.run",
)


def rank_context() -> mp.context.BaseContext:
    """The forkserver context every local rank starts from (torch preloaded in the server)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    args: tuple,
    out: Any,
    threads: int,
    environ: dict[str, str],
    key: bytes,
) -> None:
    os.environ.clear()  # the caller's environment now, not the server's at its start
    os.environ.update(environ)
    torch.set_num_threads(threads)
    try:
        join_group(port, rank, world_size, backend)
    except BaseException:  # noqa: BLE001 - reported to the parent, which may start the ranks again
        out.put((rank, "join", traceback.format_exc()))
        return
    try:
        result = fn(rank, world_size, *args)
        # plain bytes: tensors must not live in the child's shared memory
        out.put((rank, "ok", seal(result, key)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _JoinFailed(RuntimeError):
    """The ranks' group did not form (gloo's full mesh, before `fn` ran): they may start again."""


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout: float = 120.0, threads: int = 1
) -> list[Any]:
    """Run fn(rank, world_size, *args) in `world_size` processes; return results by rank.

    fn must be importable (module level). Any rank's exception is re-raised here with its
    traceback; a hang past `timeout` kills every child. No process outlives this call. A group
    that fails to form (gloo's full mesh closed by a peer, seen on a loaded machine) is formed
    once more, from fresh processes and a fresh store, the first ones killed: `fn` must not
    depend on what a killed rank may have begun before its first collective.
    """
    try:
        return _run_once(fn, world_size, args, backend, timeout, threads)
    except _JoinFailed:
        return _run_once(fn, world_size, args, backend, timeout, threads)


def _run_once(
    fn: Callable[..., Any], world_size: int, args: tuple, backend: str, timeout: float, threads: int
) -> list[Any]:
    ctx = rank_context()
    store = LoopbackStore(timeout)
    out = ctx.Queue()
    environ = dict(os.environ)
    key = os.urandom(32)
    procs = [
        ctx.Process(
            target=_child, args=(fn, r, world_size, store.port, backend, args, out, threads, environ, key), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(results) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(results))} did not finish in {timeout}s"
                )
            try:
                rank, status, value = out.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if status == "join":
                raise _JoinFailed(f"rank {rank} could not join its group:\n{value}")
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = unseal(value, key, f"rank {rank}'s result")
        for p in procs:
            p.join(timeout=10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        store.close()
    return [results[r] for r in range(world_size)]
