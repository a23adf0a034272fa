"""What ``--wan`` names, made into a :class:`~wansync.net.topology.Topology` once: a preset, a spec
string, or a topology file (`net.topology_file`).

Spec strings, comma-separated, case-insensitive except for byte units::

    lan | two-site | cross-region | cross-continent        a preset
    intellect-1-usa | intellect-1-usa-europe | ...          a preset shipped as a topology file
    rtt=16.6ms,bw=1gbit,sites=2,jitter=1ms                 a link
    two-site,bw=1gbit                                      a preset with overrides
    cross-region,worker=nvlink                             the ranks of a worker on NVLink
    sites.toml                                             a topology file (.toml, .yaml, .yml)

Keys: ``rtt`` and ``jitter`` take a time with a unit; ``bw`` (or ``bandwidth``) a rate
(`net.link.parse_rate`); ``sites`` is a positive integer; ``mtu`` a number of bytes (default 1500);
``worker`` the link between the ranks of one worker: ``site`` (the default: the link inside a site),
``nvlink`` (10 µs, 3.2 Tbit/s: 400 GB/s per rank) or ``RTT/BW`` (``worker=50us/100gbit``).
With ``sites=1`` (the default for a bare link) the link joins every pair of ranks. With
``sites>1`` it is the link *between* sites, and ranks inside a site share the ``lan`` link.
A spec's sites take an even share of whatever number of workers the run has; a file's sites hold the
workers it says.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

from wansync.errors import ConfigError
from wansync.net import topology_file
from wansync.net.link import LAN_LINK, WORKER_LINKS, Link, parse_rate, parse_time
from wansync.net.topology import Topology

__all__ = ["PRESETS", "FILE_PRESETS", "parse_wan", "is_file_spec", "preset_names"]


def _sites(inter: Link, name: str, sites: int = 2) -> Topology:
    return Topology(sites=sites, intra_link=LAN_LINK, inter_link=inter, name=name)


#: Named settings. ``two-site`` is the CPDP paper's Grid'5000 Nancy–Sophia deployment: the paper
#: gives its 16.6 ms RTT but no bandwidth; we use 10 Gbit/s, the RENATER backbone between Grid'5000
#: sites, because the paper attributes its result to the *number* of synchronization events
#: (latency-bound), not to volume. For a bandwidth-starved variant pass ``two-site,bw=1gbit``.
PRESETS: Mapping[str, Topology] = MappingProxyType(
    {
        "lan": Topology(sites=1, intra_link=LAN_LINK, inter_link=LAN_LINK, name="lan"),
        "two-site": _sites(Link(16.6e-3, 10e9), "two-site"),
        "cross-region": _sites(Link(100e-3, 1e9), "cross-region"),
        "cross-continent": _sites(Link(200e-3, 200e6), "cross-continent"),
    }
)

#: Presets shipped as topology files (`net/topologies/`), read when named.
TOPOLOGIES = Path(__file__).resolve().parent / "topologies"
FILE_PRESETS: tuple[str, ...] = tuple(sorted(p.stem for p in TOPOLOGIES.glob("*.toml")))


def preset_names() -> list[str]:
    return [*PRESETS, *FILE_PRESETS]


def is_file_spec(text: str) -> bool:
    """Does `text` name a topology file (rather than a preset or a spec string)?"""
    t = text.strip()
    if t.lower() in PRESETS or t.lower() in FILE_PRESETS:
        return False
    return t.lower().endswith(topology_file.SUFFIXES) or ("=" not in t and (os.sep in t or os.path.isfile(t)))


_KEYS = ("rtt", "bw", "bandwidth", "jitter", "sites", "mtu", "worker")


def parse_wan(text: str) -> Topology:
    """A preset name or a spec string (see the module docstring) -> :class:`Topology`."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(
            "--wan: empty; give a preset (" + ", ".join(preset_names()) + "), a topology file, "
            "or e.g. rtt=16.6ms,bw=1gbit"
        )
    if is_file_spec(text):
        return topology_file.load(text.strip())
    if text.strip().lower() in FILE_PRESETS:
        return topology_file.load(TOPOLOGIES / f"{text.strip().lower()}.toml")
    items = [p.strip() for p in text.split(",")]
    if any(not p for p in items):
        raise ConfigError(f"--wan {text!r}: empty item between commas")
    base: Topology | None = None
    if "=" not in items[0]:
        name = items.pop(0).lower()
        if name in FILE_PRESETS:
            raise ConfigError(
                f"--wan {text!r}: the preset {name!r} is a topology file and takes no overrides; "
                f"copy {TOPOLOGIES / (name + '.toml')} and edit it"
            )
        if name not in PRESETS:
            raise ConfigError(
                f"--wan: unknown preset {name!r}; choose one of: {', '.join(preset_names())}, or "
                f"name a topology file (.toml, .yaml)"
            )
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
