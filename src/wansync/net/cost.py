r"""How long a collective takes on a :class:`~wansync.net.topology.Topology`: the emulator's cost model.

Notation. A link L has a latency step a_L = rtt_L / 2 and a byte rate b_L = bandwidth_L / 8 · the
payload share of its packets (the bandwidth is the line rate): (mtu - 52) / (mtu + 14)
(``Link.bytes_per_s``, 0.956 at MTU 1500), or, on a line that also carries the acknowledgements of a
flow the other way (a ring of two ranks, whose two hops run over the same pair of lines; a ring that
crosses two sites both ways), (mtu - 52) / (mtu + 14 + 66) (``Link.ring_bytes_per_s``, 0.916). A ring
of three or more hosts sends on each line one way only: the 0.956.
B is the size in bytes of the *full* buffer: the tensor of an all-reduce or broadcast, the gathered
output of an all-gather, the (unscattered) input of a reduce-scatter.

**Every collective runs on the links it crosses, as the communication library runs it: flat.** A
group's k members form a ring in rank order, each sending to the one before it (gloo's ring: rank r
to rank r − 1, rank 0 to the last); each hop runs over the link
between them (`Topology.link`): the link inside a worker for two ranks of one worker, the site's own
link for two ranks of one site (each rank has its own port, unless the site's workers each have one
port their ranks share: `Topology.shared_port`), else the directed link between their
two sites, which the hops of the ring that cross it at once share with each other and with the
``parallel`` copies of the group running at the same time on disjoint ranks (the sharded exchange
between workers: one group per local rank), each then getting b / (flows on it).

A ring phase moves S steps of one chunk c = B/k on every hop: a step's chunk leaves a hop's sender
once it holds the previous step's result and the hop has finished sending the previous chunk, and
arrives a_h + c/b_h later (``ring_phase``; hop h from sender j to receiver i)::

    arrive_i(s) = max(arrive_j(s−1), free_h(s−1)) + a_h + c/b_h,   free_h(s) = that start + c/b_h

    reduce_scatter(B) = all_gather(B) = the phase with S = k − 1
    all_reduce(B)                     = the phase with S = 2(k − 1)
    barrier                           = all_reduce(0)                                  (latency only)

On identical hops this is the textbook ring, S·(a + B/(k·b)): RS(k) = (k−1)·a + (k−1)/k · B/b and
AR(k) = 2(k−1)·a + 2(k−1)/k · B/b. With a slower hop the ring is paced by it: every chunk crosses it
in turn (the bandwidth term is (k−1)/k · B over the slowest hop), and a chain of k − 1 hops pays
each latency on it once.

A broadcast is a binomial tree from the group's first member, ⌈log2 k⌉ rounds with the distance
halving (member i sends to i + d when i is a multiple of 2d); a round lasts as long as its slowest
edge, a + B/b one way, its cross-site edges sharing their pair's link. ``send``/``recv``: a + B/b on
the link between the two ranks.

**Hierarchical.** ``hierarchical_seconds`` is the all-reduce that wansync's exchange can run instead
of the flat one (`comm.site_mean`): inside each site an all-reduce over the site's members (all
sites at once, the slowest counts), then one member per site (the site's first) all-reduces the
site sums over a ring of the sites, then each site's first member broadcasts the total inside its
site. It pays off where sites hold several workers and the links between sites are slow next to the
links inside them: the flat ring crosses the slow links with k − 1 steps of B/k, the sites' ring with
s − 1 steps of B/s. ``allreduce_algorithm`` picks the faster on the model, which is what the exchange
runs and what the planner books (``exchange_seconds``).

Examples: 2 ranks on ``two-site`` (16.6 ms, 10 Gbit/s), B = 1 MB: AR(2, 1e6, inter) = 2·8.3 ms +
1e6 / (1.25e9 · 0.916) s = 16.6 ms + 0.87 ms = 17.47 ms. ``cross-region`` (a = 50 ms, b = 1.25e8 ·
0.916 B/s), 2 workers of 2 ranks: the groups {0, 2} and {1, 3} (p = 2) each all-reducing 5 MB of a
10 MB model take 100 ms + 2·(1/2)·2·5e6/b s = 100 ms + 87.3 ms = 187.3 ms, as one rank all-reducing
the 10 MB across would.

The links are the topology's at run time ``at_s`` (`Topology.link`; a schedule changes them); every
rank of a group evaluates the same time (the emulator: the transfer's agreed start).

One exchange between workers of R ranks, its shards across the workers and then the all-gather inside
each worker, is ``exchange_seconds``: the one cost of it, with the formula in its docstring.

Jitter: each collective adds |z|·j seconds, z ~ N(0, 1), j the largest jitter of the links it uses;
z comes from a generator seeded with (shared seed, group key, collective sequence number), so every
rank of the group draws the same value.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import replace
from types import MappingProxyType

import numpy as np

from wansync.errors import ConfigError
from wansync.net.link import Link
from wansync.net.topology import Topology

__all__ = [
    "ALGORITHMS",
    "OPS",
    "allreduce_algorithm",
    "collective_duration",
    "exchange_seconds",
    "hierarchical_seconds",
    "in_worker_seconds",
    "jitter_draw",
    "ring_phase",
    "site_members",
]

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "barrier", "send", "recv")
ALGORITHMS = ("flat", "hierarchical")
_ALIASES = MappingProxyType(
    {
        "all_reduce": "allreduce",
        "allreduce_coalesced": "allreduce",
        "all_gather": "allgather",
        "all_gather_single": "allgather",
        "all_gather_into_tensor": "allgather",
        "reduce_scatter_single": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
        # an all-to-all of a B-byte buffer moves what a reduce-scatter of it moves (each rank keeps 1/k,
        # sends the rest in k-1 steps): the same ring phase
        "alltoall": "reduce_scatter",
        "all_to_all": "reduce_scatter",
        "alltoall_base": "reduce_scatter",
    }
)


class _Hop:
    """One edge of a ring or tree: its link, how many flows share it, and whether its line also
    carries the acknowledgements of data flowing the other way (`duplex`: the payload moves at
    `Link.ring_bytes_per_s`, else at `Link.bytes_per_s`)."""

    __slots__ = ("link", "flows", "duplex")

    def __init__(self, link: Link, flows: int, duplex: bool = False):
        self.link, self.flows, self.duplex = link, flows, duplex

    @property
    def bytes_per_s(self) -> float:
        return (self.link.ring_bytes_per_s if self.duplex else self.link.bytes_per_s) / self.flows


def _edges(pairs: list[tuple[int, int]], world: int, topology: Topology, parallel: int, at_s: float) -> list[_Hop]:
    """The links of the edges (src rank, dst rank) that carry data at the same time, with the flows
    on each: a cross-site link is shared by the edges on it and by the `parallel` copies. An edge
    whose line also carries the acknowledgements of an edge the other way (two ranks of a ring of
    two; sites the ring crosses both ways) is duplex."""
    r = topology.ranks_per_worker
    where = [(a // r == b // r, topology.site_of(a, world), topology.site_of(b, world)) for a, b in pairs]
    crossing: dict[tuple[int, int], int] = {}
    for same_worker, sa, sb in where:
        if not same_worker and sa != sb:
            crossing[(sa, sb)] = crossing.get((sa, sb), 0) + 1
    between = set(pairs)
    hops = []
    for (a, b), (same_worker, sa, sb) in zip(pairs, where):
        if same_worker:
            hops.append(_Hop(topology.inside_worker, 1, (b, a) in between))
        elif sa == sb:
            flows = parallel if topology.shared_port(sa) else 1
            hops.append(_Hop(topology.link(sa, sa, at_s), flows, (b, a) in between))
        else:
            hops.append(_Hop(topology.link(sa, sb, at_s), crossing[(sa, sb)] * parallel, (sb, sa) in crossing))
    return hops


def ring_phase(steps: int, chunk: float, hops: list[_Hop]) -> float:
    """Seconds for `steps` steps of a ring moving `chunk` bytes per step on each hop (module
    docstring): hop i carries the chunk of the member before it in the list to member i. Identical
    hops are the closed form steps·(a + c/b); others, the recurrence, every hop at once per step."""
    if steps <= 0 or len(hops) <= 1:
        return 0.0
    latency = np.array([h.link.latency_s for h in hops])
    send = np.array([chunk / h.bytes_per_s for h in hops])
    if np.all(latency == latency[0]) and np.all(send == send[0]):
        return steps * float(latency[0] + send[0])
    arrive = np.zeros(len(hops))
    free = np.full(len(hops), -np.inf)
    for _ in range(steps):
        start = np.maximum(np.roll(arrive, 1), free)  # the sender holds the last result, the hop is free
        free = start + send
        arrive = free + latency
    return float(arrive.max())


def _ring(members: Sequence[int]) -> list[tuple[int, int]]:
    """The ring's hops (sender, receiver), each hop's sender the one before it in the list: as gloo
    runs it, every member sends to the member before it in the group (rank r to rank r − 1)."""
    order = list(members)[::-1]
    return [(order[i - 1], order[i]) for i in range(len(order))]


def _tree(members: Sequence[int], nbytes: float, world: int, topology: Topology, parallel: int, at_s: float) -> float:
    k = len(members)
    if k <= 1:
        return 0.0
    rounds = math.ceil(math.log2(k))
    total = 0.0
    for level in range(rounds):
        d = 2 ** (rounds - 1 - level)
        pairs = [(members[i], members[i + d]) for i in range(0, k, 2 * d) if i + d < k]
        hops = _edges(pairs, world, topology, parallel, at_s)
        total += max(h.link.latency_s + nbytes / h.bytes_per_s for h in hops)
    return total


def _members(world_size: int, ranks: Sequence[int] | None) -> list[int]:
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    return list(range(world_size)) if ranks is None else list(ranks)


def collective_duration(
    op: str,
    nbytes: float,
    world_size: int,
    topology: Topology,
    ranks: Sequence[int] | None = None,
    parallel: int = 1,
    at_s: float = 0.0,
) -> float:
    """Modelled seconds for ``op`` over ``nbytes`` (see the module docstring); jitter excluded.

    ``world_size`` is the global number of ranks (it fixes which site each rank is in); ``ranks``
    are the group's global ranks in the group's order (default: all of them). For ``send``/``recv``
    pass the two ranks. ``parallel``: how many copies of this group's collective run at the same time
    on disjoint ranks of the same sites, sharing the links between sites (1: this one alone).
    ``at_s``: the run time at which the links are read (their schedules).
    """
    op = _ALIASES.get(op, op)
    if nbytes < 0:
        raise ConfigError(f"nbytes must be >= 0, got {nbytes}")
    if not isinstance(parallel, int) or parallel < 1:
        raise ConfigError(f"parallel must be a positive integer, got {parallel!r}")
    members = tuple(_members(world_size, ranks))
    return _duration(op, float(nbytes), world_size, topology, members, parallel, topology.phase_start(at_s))


@functools.lru_cache(maxsize=4096)
def _duration(
    op: str, nbytes: float, world_size: int, topology: Topology, members: tuple[int, ...], parallel: int, at_s: float
) -> float:
    """`collective_duration`, remembered: `at_s` is the start of the links' phase (`Topology.phase_start`:
    every run time in it gives the same links)."""
    k = len(members)
    if op in ("allreduce", "reduce_scatter", "allgather", "barrier"):
        if k <= 1:
            return 0.0
        steps = k - 1 if op in ("reduce_scatter", "allgather") else 2 * (k - 1)
        hops = _edges(_ring(members), world_size, topology, parallel, at_s)
        return ring_phase(steps, 0.0 if op == "barrier" else nbytes / k, hops)
    if op == "broadcast":
        return _tree(members, nbytes, world_size, topology, parallel, at_s)
    if op in ("send", "recv"):
        if k < 2:
            return 0.0
        (hop,) = _edges([(members[0], members[1])], world_size, topology, parallel, at_s)
        return hop.link.latency_s + nbytes / hop.bytes_per_s
    raise ConfigError(f"unknown collective {op!r}; known: {', '.join(OPS)}")


def site_members(world_size: int, topology: Topology, ranks: Sequence[int] | None = None) -> list[list[int]]:
    """The group's members (default: every rank) by site, in site order, each site's in rank order."""
    by_site: dict[int, list[int]] = {}
    for r in _members(world_size, ranks):
        by_site.setdefault(topology.site_of(r, world_size), []).append(r)
    return [by_site[s] for s in sorted(by_site)]


def hierarchical_seconds(
    nbytes: float,
    world_size: int,
    topology: Topology,
    ranks: Sequence[int] | None = None,
    parallel: int = 1,
    at_s: float = 0.0,
) -> float:
    """Modelled seconds of the hierarchical all-reduce (module docstring): the sites' own all-reduces
    (at once: the slowest), the sites' first members' all-reduce, each site's broadcast."""
    sites = site_members(world_size, topology, ranks)
    inside = max(collective_duration("allreduce", nbytes, world_size, topology, m, parallel, at_s) for m in sites)
    across = collective_duration("allreduce", nbytes, world_size, topology, [m[0] for m in sites], parallel, at_s)
    back = max(collective_duration("broadcast", nbytes, world_size, topology, m, parallel, at_s) for m in sites)
    return inside + across + back


def allreduce_algorithm(
    nbytes: float,
    world_size: int,
    topology: Topology,
    ranks: Sequence[int] | None = None,
    parallel: int = 1,
    at_s: float = 0.0,
) -> str:
    """``hierarchical`` where the model says it beats the flat ring (sites of several members), else
    ``flat``: what the exchange runs and the planner books. Every rank decides alike (same inputs)."""
    sites = site_members(world_size, topology, ranks)
    if len(sites) < 2 or all(len(m) == 1 for m in sites):
        return "flat"
    flat = collective_duration("allreduce", nbytes, world_size, topology, ranks, parallel, at_s)
    return (
        "hierarchical" if hierarchical_seconds(nbytes, world_size, topology, ranks, parallel, at_s) < flat else "flat"
    )


def in_worker_seconds(op: str, nbytes: float, ranks_per_worker: int, topology: Topology) -> float:
    """Modelled seconds for ``op`` over ``nbytes`` among the R ranks of one worker: a ring on the
    topology's link inside a worker (``Topology.inside_worker``)."""
    inside = topology.inside_worker
    return collective_duration(op, nbytes, ranks_per_worker, Topology(sites=1, intra_link=inside, inter_link=inside))


def exchange_seconds(
    op: str,
    nbytes: float,
    topology: Topology,
    workers: int,
    ranks_per_worker: int = 1,
    *,
    assembled_bytes: float | None = None,
    reduce_inside: bool = False,
    assemble: bool = True,
    algorithm: str | None = None,
    at_s: float = 0.0,
) -> float:
    r"""Modelled seconds of one exchange between ``workers`` workers of R = ``ranks_per_worker`` ranks:
    the one cost of it, which the exchange (CoCoDC's T_s), the trainer's link line and the planner use.

    ``op`` is the collective between workers and B = ``nbytes`` its full buffer: ``allreduce`` for an
    fp32 mean (B: the values), ``allgather`` for a lossy codec's mean (B: every worker's encoded
    payload), ``broadcast``. ``topology`` is placed with whole workers in its sites::

        R = 1:  T = op(B) over the M workers
        R > 1:  T = op(B/R) between workers  local rank r of every worker carries shard r; the R groups
                                             run at once, sharing the links between sites (``parallel`` = R)
                  + AG_R(A, inside)          the worker's ranks put the result together: A =
                                             ``assembled_bytes`` (a lossy mean's decoded values), else B;
                                             none without ``assemble`` (FSDP inside: each rank keeps
                                             its shard, local rank r of every worker the same one)
        ``reduce_inside`` (DDP's gradients over every rank, each holding its own): with R > 1, first
        RS_R(B, inside) so that local rank r holds shard r of its worker's sum, then the above: the
        hierarchical all-reduce NCCL runs over nodes of accelerators (its rings cross between nodes
        once per node and channel). The emulator runs gloo's one flat ring over every rank instead
        (`collective_duration`): for DDP with R > 1 the two differ (docs/planner.md).

    An ``allreduce`` between workers runs as ``algorithm`` says: ``flat``, ``hierarchical``
    (``hierarchical_seconds``), or None for the faster of the two (``allreduce_algorithm``), as the
    exchange chooses. AG_R is a ring over the worker's R ranks on ``topology.inside_worker``
    (``in_worker_seconds``), which the emulator charges the worker's own groups too, so the exchange,
    the trainer's link line and the planner agree by construction.
    """
    r = ranks_per_worker
    placed = replace(topology, ranks_per_worker=r)
    world = workers * r
    if reduce_inside and r > 1:
        return in_worker_seconds("reduce_scatter", nbytes, r, topology) + exchange_seconds(
            op, nbytes, topology, workers, r, assembled_bytes=assembled_bytes, algorithm=algorithm, at_s=at_s
        )
    members = range(0, world, r)
    parallel = r
    shard = nbytes / r
    if op == "allreduce" and algorithm != "flat":
        chosen = algorithm or allreduce_algorithm(shard, world, placed, members, parallel, at_s)
        across = (
            hierarchical_seconds(shard, world, placed, members, parallel, at_s)
            if chosen == "hierarchical"
            else collective_duration(op, shard, world, placed, members, parallel, at_s)
        )
    else:
        across = collective_duration(op, shard, world, placed, members, parallel, at_s)
    if r == 1 or not assemble:
        return across
    return across + in_worker_seconds("allgather", nbytes if assembled_bytes is None else assembled_bytes, r, topology)


def jitter_draw(
    topology: Topology, world_size: int, seed: int, group_key: int, seq: int, ranks: Sequence[int] | None = None
) -> float:
    """Extra seconds for collective ``seq`` of a group; identical on every rank that asks."""
    if not topology.jitter_s:
        return 0.0  # no jitter: no placement to look up (every collective asks)
    members = _members(world_size, ranks)
    if len(members) < 2:
        return 0.0
    j = max(h.link.jitter_s for h in _edges(_ring(members), world_size, topology, 1, 0.0))
    if j == 0:
        return 0.0
    rng = np.random.default_rng([seed & 0xFFFFFFFF, group_key & 0xFFFFFFFF, seq])
    return abs(float(rng.standard_normal())) * j
