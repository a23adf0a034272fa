"""Links, and the time and rate units a user writes them in.

A :class:`Link` is a path: a round-trip time, a line rate, a jitter scale and an MTU (the rate is
the line's; TCP's payload moves at its framed share). Where links sit (sites, pairs, a worker's own
ranks) is a :class:`~wansync.net.topology.Topology`; the ``--wan`` strings and files that make one
are read by :mod:`wansync.net.wan`.

``parse_time`` takes a time with a unit (``s``, ``ms``, ``us``); ``parse_rate`` a rate in bits per
second (``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit``, or the same with ``bps``: ``mbps`` =
megabits/s; decimal prefixes) or in bytes per second with an upper-case ``B`` and ``/s`` (``B/s``,
``kB/s``, ``MB/s``, ``GB/s``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from wansync.errors import ConfigError

__all__ = ["Link", "LAN_LINK", "NVLINK", "WORKER_LINKS", "parse_time", "parse_rate"]


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
        if not 0 <= self.rtt_s < float("inf"):  # an infinite round trip would hold a collective for ever
            raise ConfigError(f"rtt must be >= 0 and finite, got {self.rtt_s!r} s")
        if not self.bandwidth_bps > 0 or self.bandwidth_bps == float("inf"):
            raise ConfigError(f"bandwidth must be a positive finite rate, got {self.bandwidth_bps!r} bit/s")
        if not 0 <= self.jitter_s < float("inf"):
            raise ConfigError(f"jitter must be >= 0 and finite, got {self.jitter_s!r} s")
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


MIN_MTU, MAX_MTU = 576, 65536  # IPv4's smallest datagram every host takes; loopback's
LAN_LINK = Link(rtt_s=0.2e-3, bandwidth_bps=10e9)
#: The accelerators of one node on an NVLink-class interconnect: 10 µs round trip, 400 GB/s per rank.
NVLINK = Link(rtt_s=10e-6, bandwidth_bps=3.2e12)
#: ``worker=NAME`` of a ``--wan`` spec: the link between the ranks of one worker (None: the site's).
WORKER_LINKS: Mapping[str, Link | None] = MappingProxyType({"site": None, "nvlink": NVLINK})


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
    raise ConfigError(f"{key}={text!r}: expected a rate like 800mbit, 1gbit, 10gbps (bits/s) or 125MB/s (bytes/s)")
