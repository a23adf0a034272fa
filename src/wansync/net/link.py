"""Links, topologies, named presets and the ``--wan`` spec string.

A :class:`Link` is a path: a round-trip time, a line rate, a jitter scale and an MTU (the rate
is the line's; TCP's payload moves at its framed share). A :class:`Topology`
puts whole workers into ``sites``: with R ranks per worker (``ranks_per_worker``), ranks
``w*R .. w*R+R-1`` form worker w, and worker w of W lives in site ``w * sites // W``. Ranks in the
same site talk over ``intra_link`` (each rank has its own port at that rate); ranks in different
sites over ``inter_link``, which is the site's uplink: the ranks of a site that cross it at the same
time share its bandwidth (see :mod:`wansync.net.cost`). The ranks of one worker talk over
``Topology.inside_worker``: ``worker_link`` when given (``worker=nvlink``), else the site's own link,
which is what an emulated run has (a worker's ranks are in one site). The emulator, the exchange's
cost (CoCoDC's T_s, the trainer's link line) and the planner all read it there.

Spec strings (``--wan``), comma-separated, case-insensitive except for byte units::

    lan | two-site | cross-region | cross-continent        a preset
    rtt=16.6ms,bw=1gbit,sites=2,jitter=1ms                 a link
    two-site,bw=1gbit                                      a preset with overrides
    cross-region,worker=nvlink                             the ranks of a worker on NVLink

Keys: ``rtt`` and ``jitter`` take a time with a unit (``s``, ``ms``, ``us``); ``bw`` (or
``bandwidth``) takes a rate in bits per second (``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit``, or
the same with ``bps``: ``mbps`` = megabits/s; decimal prefixes) or in bytes per second with an
upper-case ``B`` and ``/s`` (``B/s``, ``kB/s``, ``MB/s``, ``GB/s``); ``sites`` is a positive integer;
``mtu`` a number of bytes (default 1500); ``worker`` the link between the ranks of one worker: ``site``
(the default: the link inside a site), ``nvlink`` (10 µs, 3.2 Tbit/s: 400 GB/s per rank) or
``RTT/BW`` (``worker=50us/100gbit``).
With ``sites=1`` (the default for a bare link) the link joins every pair of ranks. With
``sites>1`` it is the link *between* sites, and ranks inside a site share the ``lan`` link.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from wansync.errors import ConfigError

__all__ = ["Link", "Topology", "PRESETS", "NVLINK", "WORKER_LINKS", "parse_wan", "parse_time", "parse_rate"]


# TCP over IPv4 over Ethernet. A packet of at most `mtu` bytes carries 52 bytes of IP and TCP headers
# (20 + 20 + the 12 of the timestamps option Linux sends), and its frame adds 14 bytes of Ethernet
# header on the line, as a shaper (tc) and a switch port count it (a physical wire adds 24 more:
# preamble, frame check, inter-frame gap). An acknowledgement is headers alone: a 66-byte frame.
TCP_IP_HEADER_BYTES = 52
FRAME_HEADER_BYTES = 14
ACK_FRAME_BYTES = TCP_IP_HEADER_BYTES + FRAME_HEADER_BYTES


@dataclass(frozen=True)
class Link:
    """A path: round-trip time (s), line rate (bit/s), jitter scale (s), MTU (bytes).

    The bandwidth is the line's rate, as a link is sold and shaped; what TCP delivers of it is the
    payload share of every packet (`payload_share`): 95.6 % at an MTU of 1500, measured through a
    `tbf` shaper between two network namespaces at 953 of 1000 and 95.7 of 100 Mbit/s. A ring's
    links carry a flow each way, so each line also carries the acknowledgements of the flow coming
    back, one 66-byte frame per segment (`ring_payload_share`: 91.6 %; a 7.28 MB all-reduce between
    two namespaces moves at 92.3 % of the line at 100 Mbit/s; at 1 Gbit/s, on an idle machine, at
    95.2 %: the receiver's GRO merges segments, and with them their acknowledgements, so there the
    model is ~5 % slow; benchmarks/README.md, `hosts_fidelity.py`).
    """

    rtt_s: float
    bandwidth_bps: float
    jitter_s: float = 0.0
    mtu: int = 1500

    def __post_init__(self) -> None:
        if not self.rtt_s >= 0:
            raise ConfigError(f"rtt must be >= 0, got {self.rtt_s!r} s")
        if not self.bandwidth_bps > 0 or self.bandwidth_bps == float("inf"):
            raise ConfigError(f"bandwidth must be a positive finite rate, got {self.bandwidth_bps!r} bit/s")
        if not self.jitter_s >= 0:
            raise ConfigError(f"jitter must be >= 0, got {self.jitter_s!r} s")
        if not isinstance(self.mtu, int) or not MIN_MTU <= self.mtu <= MAX_MTU:
            raise ConfigError(f"mtu must be an integer in [{MIN_MTU}, {MAX_MTU}] bytes, got {self.mtu!r}")

    @property
    def latency_s(self) -> float:
        """One latency step of a collective algorithm: half a round trip."""
        return self.rtt_s / 2

    @property
    def payload_share(self) -> float:
        """The share of the line rate that is payload: (mtu - 52) / (mtu + 14)."""
        return (self.mtu - TCP_IP_HEADER_BYTES) / (self.mtu + FRAME_HEADER_BYTES)

    @property
    def ring_payload_share(self) -> float:
        """The payload share of a line that also carries the acknowledgements of an equal flow the
        other way (a ring's): (mtu - 52) / (mtu + 14 + 66)."""
        return (self.mtu - TCP_IP_HEADER_BYTES) / (self.mtu + FRAME_HEADER_BYTES + ACK_FRAME_BYTES)

    @property
    def bytes_per_s(self) -> float:
        """Payload bytes per second one way (a broadcast's tree, a send): the line rate / 8, framed."""
        return self.bandwidth_bps / 8 * self.payload_share

    @property
    def ring_bytes_per_s(self) -> float:
        """Payload bytes per second of a ring's phase, every rank sending and receiving at once."""
        return self.bandwidth_bps / 8 * self.ring_payload_share


MIN_MTU, MAX_MTU = 576, 65536             # IPv4's smallest datagram every host takes; loopback's
LAN_LINK = Link(rtt_s=0.2e-3, bandwidth_bps=10e9)
#: The accelerators of one node on an NVLink-class interconnect: 10 µs round trip, 400 GB/s per rank.
NVLINK = Link(rtt_s=10e-6, bandwidth_bps=3.2e12)
#: ``worker=NAME`` of a ``--wan`` spec: the link between the ranks of one worker (None: the site's).
WORKER_LINKS: Mapping[str, Link | None] = MappingProxyType({"site": None, "nvlink": NVLINK})


@dataclass(frozen=True)
class Topology:
    """Whole workers spread evenly over ``sites``; links inside a site and between sites (the uplink),
    and between the ranks of one worker (``worker_link``; None: the site's, see `inside_worker`)."""

    sites: int = 1
    intra_link: Link = LAN_LINK
    inter_link: Link = field(default=LAN_LINK)
    name: str = ""
    ranks_per_worker: int = 1
    worker_link: Link | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sites, int) or self.sites < 1:
            raise ConfigError(f"sites must be a positive integer, got {self.sites!r}")
        if not isinstance(self.ranks_per_worker, int) or self.ranks_per_worker < 1:
            raise ConfigError(f"ranks_per_worker must be a positive integer, got {self.ranks_per_worker!r}")

    @property
    def inside_worker(self) -> Link:
        """The link between the R ranks of one worker, the one definition every caller reads:
        ``worker_link``, else the site's own link (``intra_link``), where an emulated worker's ranks are."""
        return self.intra_link if self.worker_link is None else self.worker_link

    def site_of(self, rank: int, world_size: int) -> int:
        """The site of global rank ``rank`` among ``world_size`` ranks: its worker's site."""
        r = self.ranks_per_worker
        if world_size % r:
            raise ConfigError(f"world size {world_size} is not a multiple of ranks_per_worker {r}")
        return (rank // r) * self.sites // (world_size // r)

    def describe(self) -> str:
        """A one-line human description (used by logs and reports)."""
        def fmt(link: Link) -> str:
            j = f", jitter {link.jitter_s * 1e3:g} ms" if link.jitter_s else ""
            mtu = f", MTU {link.mtu}" if link.mtu != 1500 else ""
            return f"RTT {link.rtt_s * 1e3:g} ms, {link.bandwidth_bps / 1e9:g} Gbit/s{j}{mtu}"

        head = f"{self.name}: " if self.name else ""
        tail = f"; {self.ranks_per_worker} ranks per worker" if self.ranks_per_worker > 1 else ""
        if self.worker_link is not None:
            tail += f"; inside a worker {fmt(self.worker_link)}"
        if self.sites == 1:
            return f"{head}1 site, {fmt(self.intra_link)}{tail}"
        return (f"{head}{self.sites} sites, between sites {fmt(self.inter_link)}; "
                f"inside {fmt(self.intra_link)}{tail}")


def _sites(inter: Link, name: str, sites: int = 2) -> Topology:
    return Topology(sites=sites, intra_link=LAN_LINK, inter_link=inter, name=name)


#: Named settings. ``two-site`` is the CPDP paper's Grid'5000 Nancy–Sophia deployment: the paper
#: gives its 16.6 ms RTT but no bandwidth; we use 10 Gbit/s, the RENATER backbone between Grid'5000
#: sites, because the paper attributes its result to the *number* of synchronization events
#: (latency-bound), not to volume. For a bandwidth-starved variant pass ``two-site,bw=1gbit``.
PRESETS: Mapping[str, Topology] = MappingProxyType({
    "lan": Topology(sites=1, intra_link=LAN_LINK, inter_link=LAN_LINK, name="lan"),
    "two-site": _sites(Link(16.6e-3, 10e9), "two-site"),
    "cross-region": _sites(Link(100e-3, 1e9), "cross-region"),
    "cross-continent": _sites(Link(200e-3, 200e6), "cross-continent"),
})

_TIME_UNITS = MappingProxyType({"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6})
_BIT_PREFIX = MappingProxyType({"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12})
_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def parse_time(text: str, key: str = "time") -> float:
    """``'16.6ms'`` -> 0.0166. A unit is required, so ``rtt=16`` cannot be misread."""
    m = re.fullmatch(_NUM + r"\s*(s|ms|us|µs)", text.strip().lower())
    if not m:
        raise ConfigError(f"{key}={text!r}: expected a number with a unit s, ms or us (e.g. 16.6ms)")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def parse_rate(text: str, key: str = "bw") -> float:
    """``'1gbit'``/``'1gbps'`` -> 1e9 bit/s; ``'125MB/s'`` -> 1e9 bit/s."""
    s = text.strip()
    m = re.fullmatch(_NUM + r"\s*([kMGT]?)B/s", s)
    if m:
        return float(m.group(1)) * _BIT_PREFIX[m.group(2).lower()] * 8
    m = re.fullmatch(_NUM + r"\s*([kmgt]?)(bit|bps|bit/s)", s.lower())
    if m:
        return float(m.group(1)) * _BIT_PREFIX[m.group(2)]
    raise ConfigError(
        f"{key}={text!r}: expected a rate like 800mbit, 1gbit, 10gbps (bits/s) or 125MB/s (bytes/s)"
    )


_KEYS = ("rtt", "bw", "bandwidth", "jitter", "sites", "mtu", "worker")


def parse_wan(text: str) -> Topology:
    """A preset name or a spec string (see the module docstring) -> :class:`Topology`."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("--wan: empty; give a preset (" + ", ".join(PRESETS) + ") or e.g. rtt=16.6ms,bw=1gbit")
    items = [p.strip() for p in text.split(",")]
    if any(not p for p in items):
        raise ConfigError(f"--wan {text!r}: empty item between commas")
    base: Topology | None = None
    if "=" not in items[0]:
        name = items.pop(0).lower()
        if name not in PRESETS:
            raise ConfigError(f"--wan: unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
        base = PRESETS[name]
        if not items:
            return base
    values = _values(items)
    worker = _parse_worker(values.pop("worker")) if "worker" in values else None
    if base is not None and not values:
        return replace(base, worker_link=worker, name=text.strip())
    topology = _link_topology(text, base, values)
    return topology if worker is None else replace(topology, worker_link=worker)


def _values(items: list[str]) -> dict[str, str]:
    values: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or not value.strip():
            raise ConfigError(f"--wan: malformed item {item!r}; expected key=value")
        if key not in _KEYS:
            raise ConfigError(f"--wan: unknown key {key!r}; known keys: rtt, bw, jitter, sites, mtu, worker")
        key = "bw" if key == "bandwidth" else key
        if key in values:
            raise ConfigError(f"--wan: key {key!r} given twice")
        values[key] = value.strip()
    return values


def _link_topology(text: str, base: Topology | None, values: dict[str, str]) -> Topology:
    if base is None:
        missing = [k for k in ("rtt", "bw") if k not in values]
        if missing:
            raise ConfigError(f"--wan {text!r}: missing {' and '.join(missing)} (e.g. rtt=16.6ms,bw=1gbit)")
    sites = base.sites if base else 1
    if "sites" in values:
        if not re.fullmatch(r"[0-9]+", values["sites"]) or int(values["sites"]) < 1:
            raise ConfigError(f"--wan: sites={values['sites']!r}: expected a positive integer")
        sites = int(values["sites"])
    link = base.inter_link if base else Link(0.0, 1.0)
    link = replace(
        link,
        rtt_s=parse_time(values["rtt"], "rtt") if "rtt" in values else link.rtt_s,
        bandwidth_bps=parse_rate(values["bw"], "bw") if "bw" in values else link.bandwidth_bps,
        jitter_s=parse_time(values["jitter"], "jitter") if "jitter" in values else link.jitter_s,
        mtu=_parse_mtu(values["mtu"]) if "mtu" in values else link.mtu,
    )
    if sites == 1:
        return Topology(sites=1, intra_link=link, inter_link=link, name=text.strip())
    intra = base.intra_link if base else LAN_LINK
    return Topology(sites=sites, intra_link=intra, inter_link=link, name=text.strip())


def _parse_worker(text: str) -> Link | None:
    """``worker=``: a name of `WORKER_LINKS` or ``RTT/BW`` (``50us/100gbit``)."""
    name = text.strip().lower()
    if name in WORKER_LINKS:
        return WORKER_LINKS[name]
    rtt, sep, bw = text.partition("/")
    if not sep:
        raise ConfigError(f"--wan: worker={text!r}: expected {', '.join(WORKER_LINKS)} or RTT/BW (e.g. 50us/100gbit)")
    return Link(rtt_s=parse_time(rtt, "worker rtt"), bandwidth_bps=parse_rate(bw, "worker bw"))


def _parse_mtu(text: str) -> int:
    if not re.fullmatch(r"[0-9]+", text):
        raise ConfigError(f"--wan: mtu={text!r}: expected a whole number of bytes (e.g. mtu=9000)")
    return int(text)
