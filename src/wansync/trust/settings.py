"""A run's trust settings, read in one place: the secret, the bind address and the port range.

A command takes them from its flags (`--secret-file`, `--bind`, `--ports`) or, unsaid, from the
environment (`WANSYNC_SECRET_FILE`, `WANSYNC_BIND`, `WANSYNC_PORTS`); a flag that contradicts the
variable is refused. `settle` then writes them to the environment, so that every process the command
starts (workers, the lighthouse, torchrun's agents when a launcher starts torchrun) reads the same
(`current`), and points gloo (and NCCL) at the bound interface. torchrun's agents run before any
wansync flag is parsed: on a torchrun command the variables are the way to give them, and a worker
refuses, in one line, a run whose agents met with other settings than its own (`check_agents`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..errors import ConfigError
from . import listen, secret
from .listen import Listen
from .secret import Secret

AGENTS_ENV = "WANSYNC_RDZV_TRUST"  # what the wansync rendezvous met with, for its workers to compare
IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class Trust:
    secret: Secret | None
    listen: Listen

    def describe(self) -> dict[str, str | None]:
        """What peers must hold alike, without the secret itself."""
        ports = self.listen.ports
        return {
            "secret": self.secret.fingerprint() if self.secret else None,
            "bind": self.listen.address,
            "ports": f"{ports[0]}-{ports[1]}" if ports else None,
        }


def current(environ: dict[str, str] | None = None) -> Trust:
    """The settings this process was given (by the environment its command set)."""
    return Trust(secret.from_env(environ), listen.from_env(environ))


def _given(flag: str, value: str, env: str) -> str:
    """The flag's value, or the variable's; both given and different: one line."""
    have = os.environ.get(env, "")
    if value and have and os.path.expanduser(value) != os.path.expanduser(have):
        raise ConfigError(f"{flag} {value} contradicts {env}={have}: give one of them")
    return value or have


def settle(secret_file: str = "", bind: str = "", ports: str = "") -> Trust:
    """The command's settings (flags over the environment), checked, and written to the environment
    for the processes it starts; gloo's and NCCL's interface follow --bind unless already set."""
    path = _given(secret.FLAG, secret_file, secret.ENV)
    where = _given("--bind", bind, listen.BIND_ENV)
    span = _given("--ports", ports, listen.PORTS_ENV)
    found = Trust(
        secret.load(path, secret.FLAG if secret_file else secret.ENV) if path else None,
        Listen(*listen.resolve_bind(where), None) if where else Listen(),
    )
    if span:
        found = Trust(found.secret, Listen(found.listen.address, found.listen.interface, listen.parse_ports(span)))
    if path:
        os.environ[secret.ENV] = os.path.abspath(os.path.expanduser(path))
    os.environ.update(found.listen.env())
    if found.listen.interface:
        for name in IFNAME_ENVS:
            os.environ.setdefault(name, found.listen.interface)
    return found


def check_agents(trust: Trust, across_hosts: bool) -> None:
    """Under torchrun: the agents' rendezvous met with these same settings (`AGENTS_ENV`, set by the
    wansync rendezvous); one line naming what differs. A secret across hosts needs the wansync
    rendezvous (c10d's store admits anyone) and --bind (nothing may listen on every interface)."""
    if not across_hosts or trust.secret is None:
        if across_hosts and os.environ.get(AGENTS_ENV):
            agents = json.loads(os.environ[AGENTS_ENV])
            if agents.get("secret"):
                raise ConfigError(
                    f"torchrun's agents met with a run secret ({secret.ENV}) but this worker has none: "
                    f"give the same {secret.FLAG} to wansync or drop it from torchrun's environment"
                )
        return
    if trust.listen.address is None:
        raise ConfigError(
            f"a run secret across hosts needs --bind ADDRESS|INTERFACE (or {listen.BIND_ENV}): the network "
            f"the hosts reach each other on; nothing listens on every interface"
        )
    raw = os.environ.get(AGENTS_ENV)
    if not raw:
        raise ConfigError(
            f"a run secret across hosts needs torchrun --rdzv-backend wansync started with {secret.ENV} "
            f"(and {listen.BIND_ENV}, {listen.PORTS_ENV}) in its environment: c10d's own store admits anyone"
        )
    agents, mine = json.loads(raw), trust.describe()
    differ = [k for k in mine if agents.get(k) != mine[k]]
    if differ:
        raise ConfigError(
            "torchrun's agents met with other settings than this worker's: "
            + ", ".join(f"{k} {agents.get(k)} there, {mine[k]} here" for k in differ)
            + f" (give torchrun the same {secret.ENV}, {listen.BIND_ENV} and {listen.PORTS_ENV})"
        )


def listeners_needed(workers_here: int, fault_tolerant: bool, rendezvous: bool, lighthouse: bool) -> int:
    """Ports of the range one host's processes take: the rendezvous, the lighthouse, and per worker
    its manager's server, its store and its heal server (fault tolerant) or nothing (lock-step runs
    listen only through gloo and torchrun's store)."""
    return int(rendezvous) + int(lighthouse) + (3 * workers_here if fault_tolerant else 0)


def check_range(trust: Trust, needed: int) -> None:
    """A port range smaller than what this host's listeners need: one line, before anything starts."""
    ports = trust.listen.ports
    if ports is not None and ports[1] - ports[0] + 1 < needed:
        raise ConfigError(
            f"--ports {ports[0]}-{ports[1]} holds {ports[1] - ports[0] + 1} port(s); this host's listeners "
            f"need {needed} (docs/security.md#ports)"
        )
