r"""How long a collective takes on a :class:`~wansync.net.link.Topology`: the emulator's cost model.

Notation. A link L has a latency step a_L = rtt_L / 2 and a byte rate b_L = bandwidth_L / 8.
B is the size in bytes of the *full* buffer: the tensor of an all-reduce or broadcast, the gathered
output of an all-gather, the (unscattered) input of a reduce-scatter. The group's members fall into
s non-empty sites with at most m members in one site (the largest site sets the pace).

Ring phases over k ranks on link L (k = 1 costs nothing)::

    RS(k, X, L) = (k-1)·a_L + (k-1)/k · X / b_L      reduce-scatter of an X-byte buffer
    AG(k, X, L) = (k-1)·a_L + (k-1)/k · X / b_L      all-gather into an X-byte buffer
    AR(k, X, L) = RS + AG = 2(k-1)·a_L + 2(k-1)/k · X / b_L

Collectives are hierarchical (intra = link inside a site, inter = link between sites); every rank
of a site carries its own shard across in parallel, since bandwidth is per rank::

    all_reduce(B)     = RS(m, B, intra) + AR(s, B/m, inter) + AG(m, B, intra)
    reduce_scatter(B) = RS(m, B, intra) + RS(s, B/m, inter)
    all_gather(B)     = AG(s, B/m, inter) + AG(m, B, intra)
    broadcast(B)      = ceil(log2 s)·(a_inter + B/b_inter) + ceil(log2 m)·(a_intra + B/b_intra)
    barrier           = all_reduce(0) = 2(m-1)·a_intra + 2(s-1)·a_inter      (latency only)
    send / recv (B)   = a + B/b on the link between the two ranks

With one site this is the plain ring (all_reduce = AR(n, B, intra)); with one rank per site it is
the ring over the inter link. Example, 2 ranks on ``two-site`` (16.6 ms, 10 Gbit/s), B = 1 MB:
AR(2, 1e6, inter) = 2·8.3 ms + 1e6 / 1.25e9 s = 16.6 ms + 0.8 ms = 17.4 ms.

Jitter: each collective adds |z|·j seconds, z ~ N(0, 1), j the jitter of the slowest link it uses
(inter when s > 1, else intra); z comes from a generator seeded with (shared seed, group key,
collective sequence number), so every rank of the group draws the same value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import MappingProxyType

import numpy as np

from wansync.errors import ConfigError
from wansync.net.link import Link, Topology

__all__ = ["collective_duration", "jitter_draw", "site_counts", "OPS"]

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "barrier", "send", "recv")
_ALIASES = MappingProxyType({
    "all_reduce": "allreduce", "allreduce_coalesced": "allreduce", "all_gather": "allgather",
    "all_gather_single": "allgather", "all_gather_into_tensor": "allgather",
    "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
})


def _ring_phase(k: int, nbytes: float, link: Link) -> float:
    if k <= 1:
        return 0.0
    return (k - 1) * link.latency_s + (k - 1) / k * nbytes / link.bytes_per_s


def _tree(k: int, nbytes: float, link: Link) -> float:
    if k <= 1:
        return 0.0
    return math.ceil(math.log2(k)) * (link.latency_s + nbytes / link.bytes_per_s)


def site_counts(world_size: int, topology: Topology, ranks: Sequence[int] | None = None) -> list[int]:
    """Members per non-empty site for the group ``ranks`` (default: all) of ``world_size`` ranks."""
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    members = range(world_size) if ranks is None else ranks
    counts: dict[int, int] = {}
    for r in members:
        site = topology.site_of(r, world_size)
        counts[site] = counts.get(site, 0) + 1
    return [counts[k] for k in sorted(counts)]


def _shape(world_size: int, topology: Topology, ranks: Sequence[int] | None) -> tuple[int, int]:
    counts = site_counts(world_size, topology, ranks)
    return len(counts), max(counts, default=1)


def collective_duration(
    op: str,
    nbytes: float,
    world_size: int,
    topology: Topology,
    ranks: Sequence[int] | None = None,
) -> float:
    """Modelled seconds for ``op`` over ``nbytes`` (see the module docstring); jitter excluded.

    ``world_size`` is the global number of ranks (it fixes which site each rank is in); ``ranks``
    are the group's global ranks (default: all of them). For ``send``/``recv`` pass the two ranks.
    """
    op = _ALIASES.get(op, op)
    if nbytes < 0:
        raise ConfigError(f"nbytes must be >= 0, got {nbytes}")
    intra, inter = topology.intra_link, topology.inter_link
    s, m = _shape(world_size, topology, ranks)
    if op == "allreduce":
        return _ring_phase(m, nbytes, intra) + 2 * _ring_phase(s, nbytes / m, inter) + _ring_phase(m, nbytes, intra)
    if op == "reduce_scatter":
        return _ring_phase(m, nbytes, intra) + _ring_phase(s, nbytes / m, inter)
    if op == "allgather":
        return _ring_phase(s, nbytes / m, inter) + _ring_phase(m, nbytes, intra)
    if op == "broadcast":
        return _tree(s, nbytes, inter) + _tree(m, nbytes, intra)
    if op == "barrier":
        return collective_duration("allreduce", 0, world_size, topology, ranks)
    if op in ("send", "recv"):
        link = inter if s > 1 else intra
        return link.latency_s + nbytes / link.bytes_per_s
    raise ConfigError(f"unknown collective {op!r}; known: {', '.join(OPS)}")


def jitter_draw(
    topology: Topology, world_size: int, seed: int, group_key: int, seq: int, ranks: Sequence[int] | None = None
) -> float:
    """Extra seconds for collective ``seq`` of a group; identical on every rank that asks."""
    s, _ = _shape(world_size, topology, ranks)
    j = (topology.inter_link if s > 1 else topology.intra_link).jitter_s
    if j == 0:
        return 0.0
    rng = np.random.default_rng([seed & 0xFFFFFFFF, group_key & 0xFFFFFFFF, seq])
    return abs(float(rng.standard_normal())) * j
