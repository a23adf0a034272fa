"""The torchrun environment of this process, read once: a run under torchrun adopts its ranks
instead of launching its own.

It is adopted only when it is complete and consistent: a stale or partial one must not silently
turn `--workers 2` into one worker. The command (`wansync train`, `compare`, `sweep`) reads it
before any work and hands the `TorchrunEnv` on; nothing reads the variables a second time.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ..errors import ConfigError, PeerError, first_line
from .rendezvous import REJOINED_ENV
from .route import route_to

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int = 0
    local_world_size: int = 1  # this node's ranks (torchrun's --nproc-per-node)
    run_id: str = ""  # TORCHELASTIC_RUN_ID
    attempt: int = 0  # TORCHELASTIC_RESTART_COUNT: torchrun's restarts of this node
    agent_store: bool = False  # torchrun's agents serve a store at MASTER_ADDR:MASTER_PORT
    round: int = 0  # which of this launch's runs (a grid's) the store's keys are for
    rejoined: bool = False  # this node took the place of one that was gone (runner.rendezvous.LateJoin)

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size}, rendezvous {self.master_addr}:{self.master_port}"

    @property
    def nodes(self) -> bool:
        """Does the world span more than this node (other torchrun agents)?"""
        return self.world_size > self.local_world_size

    def store(self, timeout_s: float):
        """A client of the store torchrun's agents serve to their workers at MASTER_ADDR:MASTER_PORT,
        with keys of this launch's and this run's own (run id, torchrun's restart, the round): where
        ranks that share no process group (a fault-tolerant run's) meet. Opening it starts no thread."""
        import datetime

        import torch.distributed as dist

        try:
            store = dist.TCPStore(
                self.master_addr, self.master_port, None, False, datetime.timedelta(seconds=timeout_s)
            )
        except (RuntimeError, ValueError) as e:
            raise PeerError(
                f"cannot reach torchrun's store at {self.master_addr}:{self.master_port} within "
                f"{timeout_s:g} s: {first_line(e)[:200]}"
            ) from None
        return dist.PrefixStore(f"wansync/{self.run_id}/{self.attempt}/{self.round}", store)


def join_network(env: TorchrunEnv) -> None:
    """Make this rank reachable where torchrun told it to meet the others: gloo binds the interface
    of the route to MASTER_ADDR (`GLOO_SOCKET_IFNAME`, unless set), not whatever this host's name
    resolves to. A loopback MASTER_ADDR on a run of several nodes that does not answer here (node
    0's name resolves to a loopback address, and plain c10d advertised it) is refused in one line
    at once, not after a timeout."""
    try:
        route = route_to(env.master_addr)
    except OSError as e:
        raise ConfigError(
            f"torchrun's rendezvous address {env.master_addr} does not resolve or route from this "
            f"host ({e.strerror or e}): start torchrun with --rdzv-backend wansync, or pass "
            f"--local-addr on node 0"
        ) from None
    if env.nodes and route.loopback and not answers(env.master_addr, env.master_port):
        raise ConfigError(
            f"torchrun told this rank to meet the others at {env.master_addr}:{env.master_port}, a "
            f"loopback address where nothing answers on this host (node 0's host name resolves to a "
            f"loopback address): start torchrun with --rdzv-backend wansync on every node, or pass "
            f"--local-addr ADDRESS (node 0's address on the others' side) to torchrun on node 0"
        )
    if not os.environ.get(GLOO_IFNAME):
        if route.interface is None:
            raise ConfigError(
                f"cannot tell which interface reaches torchrun's rendezvous at {env.master_addr}: set "
                f"{GLOO_IFNAME} to it (the interface the other nodes reach this one on)"
            )
        os.environ[GLOO_IFNAME] = route.interface


def interface_hint() -> str:
    """What to check when the nodes' process group never formed: the interface gloo listened on."""
    return (
        f" (gloo listened on {GLOO_IFNAME}={os.environ.get(GLOO_IFNAME, '(unset)')}: set it to the interface "
        f"the other nodes reach this one on)"
    )


def answers(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Does something accept a TCP connection at host:port?"""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def torchrun_env(workers: int | None = None, ranks_per_worker: int = 1) -> TorchrunEnv | None:
    """The torchrun environment of this process, None when there is none. A partial, malformed
    or inconsistent one is refused in one line, as is a contradiction with `workers` (an explicit
    --workers, or the worker count of the run being resumed) or a world that workers of
    `ranks_per_worker` ranks cannot fill."""
    present = [v for v in TORCHRUN_VARS if os.environ.get(v)]
    if not present:
        return None
    missing = [v for v in TORCHRUN_VARS if v not in present]
    if missing:
        raise ConfigError(
            f"incomplete torchrun environment: {', '.join(present)} set but {', '.join(missing)} not "
            f"(unset {', '.join(present)} to launch local workers, or start under torchrun)"
        )
    world = _env_int("WORLD_SIZE", 1, None)
    local_world = _env_int("LOCAL_WORLD_SIZE", 1, world) if os.environ.get("LOCAL_WORLD_SIZE") else world
    local_rank = _env_int("LOCAL_RANK", 0, local_world - 1) if os.environ.get("LOCAL_RANK") else 0
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0, None) if os.environ.get("TORCHELASTIC_RESTART_COUNT") else 0
    env = TorchrunEnv(
        _env_int("RANK", 0, world - 1),
        world,
        os.environ["MASTER_ADDR"],
        _env_int("MASTER_PORT", 1, 65535),
        local_rank,
        local_world,
        os.environ.get("TORCHELASTIC_RUN_ID", ""),
        attempt,
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        rejoined=os.environ.get(REJOINED_ENV) == "1",
    )
    if world % ranks_per_worker:
        raise ConfigError(
            f"the torchrun environment says WORLD_SIZE={world}, which workers of --ranks-per-worker "
            f"{ranks_per_worker} cannot fill (under torchrun --nnodes N --nproc-per-node R, pass "
            f"--ranks-per-worker R)"
        )
    if workers is not None and workers * ranks_per_worker != world:
        per = f" x --ranks-per-worker {ranks_per_worker}" if ranks_per_worker > 1 else ""
        raise ConfigError(
            f"the torchrun environment says WORLD_SIZE={world} (RANK, WORLD_SIZE, MASTER_ADDR, "
            f"MASTER_PORT are set) but this run has --workers {workers}{per}: drop --workers under "
            f"torchrun, or unset those variables to launch {workers} local workers"
        )
    return env


def _env_int(name: str, low: int, high: int | None) -> int:
    text = os.environ[name]
    try:
        value = int(text)
        fits = value >= low and (high is None or value <= high)
    except ValueError:
        fits = False
    if not fits:
        bound = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise ConfigError(f"torchrun environment: {name} must be {bound}, got {text!r}")
    return value
