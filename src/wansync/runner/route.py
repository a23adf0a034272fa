"""Which of this host's addresses, and which interface, reach a peer: the kernel's route to it.

A host whose name resolves to a loopback address (the default of many Linux images) makes every
name-based guess wrong: torchrun advertises `localhost` to the other nodes, gloo binds 127.0.0.1,
a fault-tolerant worker tells its peers to fetch a heal from itself at 127.0.0.1. The route does not
guess: the source address the kernel picks for a packet to the peer is an address this host is
reached at from the peer's side, and the interface that holds it is the one gloo must bind
(`GLOO_SOCKET_IFNAME`). Asking costs no packet (a UDP socket's connect only looks the route up).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass

SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address
IF_INET6 = "/proc/net/if_inet6"


@dataclass(frozen=True)
class Route:
    """This host's side of the path to a peer: the address it sends from, the interface holding it."""

    address: str
    interface: str | None

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback


def route_to(host: str) -> Route:
    """The route to `host` (a name or an address); OSError when the name does not resolve or no
    route leads there."""
    last: OSError = OSError(f"no address for {host}")
    for family, _, _, _, addr in socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM):
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(addr)
            except OSError as e:
                last = e
                continue
            source = s.getsockname()[0].split("%")[0]
        return Route(source, interface_of(source))
    raise last


def is_loopback(host: str) -> bool:
    """Does `host` resolve (here) to a loopback address only?"""
    try:
        found = {info[4][0].split("%")[0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(found) and all(ipaddress.ip_address(a).is_loopback for a in found)


def owns(host: str) -> bool:
    """Is one of `host`'s addresses this host's own (a socket can be bound to it)?"""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr[0], 0))
                return True
            except OSError:
                continue
    return False


def interface_of(address: str) -> str | None:
    """The name of the interface holding `address` (None when none does: not Linux, or not local)."""
    ip = ipaddress.ip_address(address)
    if ip.is_loopback:
        return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")
    if ip.version == 6:
        return _ipv6_interface(ip)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def _ipv6_interface(ip: ipaddress.IPv6Address) -> str | None:
    try:
        with open(IF_INET6) as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and ipaddress.IPv6Address(int(fields[0], 16)) == ip:
                    return fields[5]
    except OSError:
        pass
    return None
