"""Where wansync listens: the address every listener binds (`--bind`) and the ports it takes
(`--ports LOW-HIGH`).

A run across sites is joined by a network the user chose (a WireGuard tunnel's interface, a private
link); every listener wansync or torchrun creates binds there, never on every interface, and takes
its port from one range, so that a site's firewall opens that range to its peers and nothing else.
Both are read from the command's flags, which the command passes on to the processes it starts as
`WANSYNC_BIND` and `WANSYNC_PORTS` (torchrun's agents read them there too). gloo's pair connections
take ports the kernel chooses: that is the one listener the range cannot pin (docs/security.md says
what to do).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import subprocess
from dataclasses import dataclass

from ..errors import ConfigError

BIND_ENV = "WANSYNC_BIND"
PORTS_ENV = "WANSYNC_PORTS"
WILDCARDS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class Listen:
    """Where this process's listeners go: `address` (None: each listener's own default, as without
    --bind), the interface that holds it (gloo's GLOO_SOCKET_IFNAME), and the port range (None: any)."""

    address: str | None = None
    interface: str | None = None
    ports: tuple[int, int] | None = None

    def socket(self, what: str, default_host: str = "127.0.0.1") -> socket.socket:
        """A listening TCP socket for `what` at this address (or `default_host`) on a port of the range
        (any port without one); one line naming the range when every port of it is taken."""
        host = self.address or default_host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        candidates = range(self.ports[0], self.ports[1] + 1) if self.ports else (0,)
        for port in candidates:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError as e:
                sock.close()
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    continue
                raise ConfigError(f"{what}: cannot listen on {host}:{port} ({e.strerror or e})") from None
            sock.listen(128)
            return sock
        assert self.ports is not None
        raise ConfigError(
            f"{what}: every port of --ports {self.ports[0]}-{self.ports[1]} on {host} is taken; " f"give a wider range"
        )

    def port(self, what: str) -> int:
        """A free port of the range for a server that binds it itself (torchft's lighthouse and
        managers): 0 without a range. The socket is closed at once, so a race is possible; the
        server's own bind then fails and says so."""
        if self.ports is None:
            return 0
        sock = self.socket(what)
        port = int(sock.getsockname()[1])
        sock.close()
        return port

    def env(self) -> dict[str, str]:
        """The variables that pass this on to a process this one starts."""
        out = {}
        if self.address:
            out[BIND_ENV] = self.interface or self.address
        if self.ports:
            out[PORTS_ENV] = f"{self.ports[0]}-{self.ports[1]}"
        return out


def address_of(host: str, what: str) -> str:
    """The address `host` (an address, or a name this host resolves) stands for: what a listener
    that serves peers at `host` binds, never a wildcard; one line naming `what` otherwise."""
    try:
        found = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"{what}: cannot resolve {host} ({exc.strerror})") from None
    address = str(found[0][4][0])
    if address in WILDCARDS:
        raise ConfigError(f"{what}: {host} is a wildcard; name the one address peers reach this host at")
    return address


def parse_ports(text: str, source: str = "--ports") -> tuple[int, int]:
    """`LOW-HIGH`, both between 1024 and 65535 (a port below 1024 needs root, and a run must not)."""
    low, sep, high = str(text).strip().partition("-")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        raise ConfigError(f"{source} {text!r}: expected LOW-HIGH, e.g. 29400-29499") from None
    if not 1024 <= lo <= hi <= 65535:
        raise ConfigError(f"{source} {text!r}: expected 1024 <= LOW <= HIGH <= 65535")
    return lo, hi


def interfaces() -> dict[str, list[str]]:
    """This host's interfaces and their addresses (`ip -o addr`)."""
    try:
        out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    found: dict[str, list[str]] = {name: [] for _, name in socket.if_nameindex()}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("inet", "inet6"):
            found.setdefault(parts[1].split("@")[0], []).append(parts[3].split("/")[0])
    return found


def resolve_bind(text: str, source: str = "--bind") -> tuple[str, str]:
    """(address, interface) for `--bind ADDRESS|INTERFACE`: an address this host holds, or an
    interface of this host with an address (its IPv4 one first). A wildcard is refused: binding every
    interface is what --bind is there to prevent."""
    value = str(text).strip()
    if value in WILDCARDS or value in ("[::]", "*"):
        raise ConfigError(f"{source} {text!r}: a wildcard binds every interface; name one address or interface")
    ifs = interfaces()
    if value in ifs:
        addrs = sorted(ifs[value], key=lambda a: ":" in a)
        if not addrs:
            raise ConfigError(f"{source} {value}: the interface has no address (is it up?)")
        return addrs[0], value
    try:
        address = str(ipaddress.ip_address(value.strip("[]")))
    except ValueError:
        known = ", ".join(sorted(ifs)) or "none"
        raise ConfigError(
            f"{source} {value}: neither an address nor an interface of this host (interfaces: {known})"
        ) from None
    holder = next((name for name, addrs in ifs.items() if address in addrs), None)
    if holder is None:
        raise ConfigError(f"{source} {value}: this host has no such address")
    return address, holder


def from_env(environ: dict[str, str] | None = None) -> Listen:
    """The Listen a command passed on (WANSYNC_BIND, WANSYNC_PORTS); the default one without them."""
    env = os.environ if environ is None else environ
    bind, ports = env.get(BIND_ENV, ""), env.get(PORTS_ENV, "")
    address, interface = resolve_bind(bind, BIND_ENV) if bind else (None, None)
    return Listen(address, interface, parse_ports(ports, PORTS_ENV) if ports else None)
