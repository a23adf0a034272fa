r"""How long a collective takes on a :class:`~wansync.net.link.Topology`: the emulator's cost model.

Notation. A link L has a latency step a_L = rtt_L / 2 and a byte rate b_L = bandwidth_L / 8 · the
payload share of its packets (the bandwidth is the line rate): in a ring's phases, where each line
also carries the acknowledgements of the flow the other way, (mtu - 52) / (mtu + 14 + 66)
(``Link.ring_bytes_per_s``, 0.916 at MTU 1500); one way (a broadcast's tree, send/recv),
(mtu - 52) / (mtu + 14) (``Link.bytes_per_s``, 0.956).
B is the size in bytes of the *full* buffer: the tensor of an all-reduce or broadcast, the gathered
output of an all-gather, the (unscattered) input of a reduce-scatter. The group's members fall into
s non-empty sites with at most m members in one site (the largest site sets the pace).

Ring phases over k ranks on link L (k = 1 costs nothing)::

    RS(k, X, L) = (k-1)·a_L + (k-1)/k · X / b_L      reduce-scatter of an X-byte buffer
    AG(k, X, L) = (k-1)·a_L + (k-1)/k · X / b_L      all-gather into an X-byte buffer
    AR(k, X, L) = RS + AG = 2(k-1)·a_L + 2(k-1)/k · X / b_L

Collectives are hierarchical (intra = link inside a site, inter = link between sites). Inside a
site every rank has its own port at b_intra. A group whose ranks all belong to one worker runs on the
topology's link inside a worker instead (``Topology.inside_worker``: the site's link unless
``worker_link`` is set). The inter link is the site's uplink: the ranks of a
site that cross it at the same time share its bandwidth. If c of a group's ranks in one site cross
at once and ``parallel`` = p copies of the group's collective run at the same time on disjoint ranks
of the same sites (the sharded exchange between workers: one group per local rank), each crossing
rank moves bytes at::

    b_up = b_inter / (c·p)        c = m for the ring phases (every rank carries its shard),
                                  c = 1 for broadcast and send/recv (one rank per site crosses)

    all_reduce(B)     = RS(m, B, intra) + AR(s, B/m, up) + AG(m, B, intra)
                      = RS(m, B, intra) + 2(s-1)·a_inter + 2(s-1)/s · p·B/b_inter + AG(m, B, intra)
    reduce_scatter(B) = RS(m, B, intra) + RS(s, B/m, up)
    all_gather(B)     = AG(s, B/m, up) + AG(m, B, intra)
    broadcast(B)      = ceil(log2 s)·(a_inter + p·B/b_inter) + ceil(log2 m)·(a_intra + B/b_intra)
    barrier           = all_reduce(0) = 2(m-1)·a_intra + 2(s-1)·a_inter      (latency only)
    send / recv (B)   = a + B/b on the link between the two ranks (across sites: a_inter + p·B/b_inter)

Consequences. One group (p = 1) with one rank per site (m = 1) is the ring over the inter link, as
a per-rank model would have it. With m ranks of the group per site the site moves B over its uplink
once, not B/m: all_reduce(B) = RS(m, B, intra) + 2(s-1)·a_inter + 2(s-1)/s·B/b_inter + AG(m, B, intra).
R parallel groups across workers (one rank per site each) each carrying B/R cost
2(s-1)·a_inter + 2(s-1)/s·B/b_inter: the bandwidth term of one rank sending the whole model.

With one site this is the plain ring (all_reduce = AR(n, B, intra)). Examples: 2 ranks on
``two-site`` (16.6 ms, 10 Gbit/s), B = 1 MB: AR(2, 1e6, inter) = 2·8.3 ms + 1e6 / (1.25e9 · 0.916) s =
16.6 ms + 0.87 ms = 17.47 ms. ``cross-region`` (a_inter = 50 ms, b_inter = 1.25e8 · 0.916 B/s), 2 sites,
2 ranks per worker, 4 ranks: the groups {0, 2} and {1, 3} (p = 2) each all-reducing 5 MB of a
B = 10 MB model take 100 ms + 2·(1/2)·2·5e6/b_inter s = 100 ms + 87.3 ms = 187.3 ms, as one rank
all-reducing the 10 MB across would; the all-reduce of 10 MB over all 4 ranks takes
4.5 ms + 187.3 ms + 4.5 ms = 196.2 ms (RS(2, 1e7, lan) = 0.1 ms + 4.4 ms).

One exchange between workers of R ranks, its shards across the workers and then the all-gather inside
each worker, is ``exchange_seconds``: the one cost of it, with the formula in its docstring.

Jitter: each collective adds |z|·j seconds, z ~ N(0, 1), j the jitter of the slowest link it uses
(inter when s > 1, else intra); z comes from a generator seeded with (shared seed, group key,
collective sequence number), so every rank of the group draws the same value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from types import MappingProxyType

import numpy as np

from wansync.errors import ConfigError
from wansync.net.link import Link, Topology

__all__ = ["collective_duration", "exchange_seconds", "in_worker_seconds", "jitter_draw", "site_counts", "OPS"]

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "barrier", "send", "recv")
_ALIASES = MappingProxyType({
    "all_reduce": "allreduce", "allreduce_coalesced": "allreduce", "all_gather": "allgather",
    "all_gather_single": "allgather", "all_gather_into_tensor": "allgather",
    "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    # an all-to-all of a B-byte buffer moves what a reduce-scatter of it moves (each rank keeps 1/k,
    # sends the rest in k-1 steps): the same ring phase, its approximation on a hierarchical group
    "alltoall": "reduce_scatter", "all_to_all": "reduce_scatter", "alltoall_base": "reduce_scatter",
})


def _ring_phase(k: int, nbytes: float, link: Link) -> float:
    if k <= 1:
        return 0.0
    return (k - 1) * link.latency_s + (k - 1) / k * nbytes / link.ring_bytes_per_s


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


def _in_one_worker(world_size: int, topology: Topology, ranks: Sequence[int] | None) -> bool:
    members = range(world_size) if ranks is None else ranks
    return len({r // topology.ranks_per_worker for r in members}) <= 1


def _uplink_share(link: Link, crossing: int) -> Link:
    """The inter link as one of ``crossing`` ranks of a site that cross it at once sees it."""
    return replace(link, bandwidth_bps=link.bandwidth_bps / crossing)


def collective_duration(
    op: str,
    nbytes: float,
    world_size: int,
    topology: Topology,
    ranks: Sequence[int] | None = None,
    parallel: int = 1,
) -> float:
    """Modelled seconds for ``op`` over ``nbytes`` (see the module docstring); jitter excluded.

    ``world_size`` is the global number of ranks (it fixes which site each rank is in); ``ranks``
    are the group's global ranks (default: all of them). For ``send``/``recv`` pass the two ranks.
    ``parallel``: how many copies of this group's collective run at the same time on disjoint ranks
    of the same sites, sharing the sites' uplinks (1: this one alone).
    """
    op = _ALIASES.get(op, op)
    if nbytes < 0:
        raise ConfigError(f"nbytes must be >= 0, got {nbytes}")
    if not isinstance(parallel, int) or parallel < 1:
        raise ConfigError(f"parallel must be a positive integer, got {parallel!r}")
    intra, inter = topology.intra_link, topology.inter_link
    s, m = _shape(world_size, topology, ranks)
    if topology.worker_link is not None and _in_one_worker(world_size, topology, ranks):
        intra = topology.worker_link
    ring_up = _uplink_share(inter, m * parallel)  # every rank of the group in a site carries a shard
    one_up = _uplink_share(inter, parallel)  # one rank per site crosses
    if op == "allreduce":
        return _ring_phase(m, nbytes, intra) + 2 * _ring_phase(s, nbytes / m, ring_up) + _ring_phase(m, nbytes, intra)
    if op == "reduce_scatter":
        return _ring_phase(m, nbytes, intra) + _ring_phase(s, nbytes / m, ring_up)
    if op == "allgather":
        return _ring_phase(s, nbytes / m, ring_up) + _ring_phase(m, nbytes, intra)
    if op == "broadcast":
        return _tree(s, nbytes, one_up) + _tree(m, nbytes, intra)
    if op == "barrier":
        return collective_duration("allreduce", 0, world_size, topology, ranks)
    if op in ("send", "recv"):
        link = one_up if s > 1 else intra
        return link.latency_s + nbytes / link.bytes_per_s
    raise ConfigError(f"unknown collective {op!r}; known: {', '.join(OPS)}")


def in_worker_seconds(op: str, nbytes: float, ranks_per_worker: int, topology: Topology) -> float:
    """Modelled seconds for ``op`` over ``nbytes`` among the R ranks of one worker: a ring on the
    topology's link inside a worker (``Topology.inside_worker``)."""
    inside = topology.inside_worker
    return collective_duration(op, nbytes, ranks_per_worker, Topology(sites=1, intra_link=inside, inter_link=inside))


def exchange_seconds(op: str, nbytes: float, topology: Topology, workers: int, ranks_per_worker: int = 1, *,
                     assembled_bytes: float | None = None, reduce_inside: bool = False,
                     assemble: bool = True) -> float:
    r"""Modelled seconds of one exchange between ``workers`` workers of R = ``ranks_per_worker`` ranks:
    the one cost of it, which the exchange (CoCoDC's T_s), the trainer's link line and the planner use.

    ``op`` is the collective between workers and B = ``nbytes`` its full buffer: ``allreduce`` for an
    fp32 mean (B: the values), ``allgather`` for a lossy codec's mean (B: every worker's encoded
    payload), ``broadcast``. ``topology`` is placed with whole workers in its sites::

        R = 1:  T = op(B) over the M workers
        R > 1:  T = RS_R(B, inside)          with ``reduce_inside`` only: the ranks hold different values
                                             (DDP's gradients: a hierarchical all-reduce over every rank)
                  + op(B/R) between workers  local rank r of every worker carries shard r; the R groups
                                             run at once, sharing each site's uplink (``parallel`` = R)
                  + AG_R(A, inside)          the worker's ranks put the result together: A =
                                             ``assembled_bytes`` (a lossy mean's decoded values), else B;
                                             none without ``assemble`` (FSDP inside: each rank keeps
                                             its shard, local rank r of every worker the same one)

    RS_R and AG_R are rings over the worker's R ranks on ``topology.inside_worker``
    (``in_worker_seconds``): the one link inside a worker, which the emulator charges the worker's
    own groups too, so the exchange (CoCoDC's T_s), the trainer's link line and the planner agree by
    construction. It is the site's link unless the topology names one (``--wan ...,worker=nvlink``).
    """
    r = ranks_per_worker
    placed = replace(topology, ranks_per_worker=r)
    if r == 1:
        return collective_duration(op, nbytes, workers, placed)
    world = workers * r
    across = collective_duration(op, nbytes / r, world, placed, range(0, world, r), parallel=r)
    if not assemble:
        return across
    gather = in_worker_seconds("allgather", nbytes if assembled_bytes is None else assembled_bytes, r, topology)
    if not reduce_inside:
        return across + gather
    return in_worker_seconds("reduce_scatter", nbytes, r, topology) + across + gather


def jitter_draw(
    topology: Topology, world_size: int, seed: int, group_key: int, seq: int, ranks: Sequence[int] | None = None
) -> float:
    """Extra seconds for collective ``seq`` of a group; identical on every rank that asks."""
    if not (topology.inter_link.jitter_s or topology.intra_link.jitter_s):
        return 0.0                              # no jitter: no placement to look up (every collective asks)
    s, _ = _shape(world_size, topology, ranks)
    j = (topology.inter_link if s > 1 else topology.intra_link).jitter_s
    if j == 0:
        return 0.0
    rng = np.random.default_rng([seed & 0xFFFFFFFF, group_key & 0xFFFFFFFF, seq])
    return abs(float(rng.standard_normal())) * j
