"""The world a run's workers live in: sites, the links inside and between them, how fast each worker
computes, and how the links change over the run. One object, read by the emulator, the cost model
(`net.cost`) and the planner alike.

A :class:`Topology` puts whole workers into sites. With R ranks per worker (``ranks_per_worker``),
ranks ``w*R .. w*R+R-1`` form worker w. Two forms:

- **even** (a ``--wan`` spec or preset): ``sites`` identical sites, worker w of W in site
  ``w * sites // W``, whatever W the run has; ``intra_link`` inside every site, ``inter_link``
  between every pair.
- **laid out** (a topology file, `net.topology_file`): named sites with their own worker counts
  (``site_workers``: the run must have exactly that many workers, site by site in file order), their
  own inside links (``site_links``), a link per directed pair of sites (``pair_links``), per-worker
  compute speeds (``speeds``), optionally the step time of a full-speed worker (``step_s``: an
  emulated run pads every step to it, divided by the worker's relative speed, so that workers of
  different speeds keep their ratio on a machine whose cores they share) and link schedules
  (``schedules``, `net.schedule`).

Ranks in one worker talk over ``inside_worker`` (``worker_link`` when given, else their site's
link); ranks in one site over the site's link (each rank has its own port at that rate, or with
``site_ports`` "worker" one per worker, which its ranks share); ranks in two
sites over the directed pair's link, which the transfers crossing it at the same time share
(`net.cost`). ``link(a, b, at_s)`` is the one place a link is looked up, at run time ``at_s``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from wansync.errors import ConfigError
from wansync.net.link import LAN_LINK, Link
from wansync.net.schedule import LinkSchedule

__all__ = ["PORTS", "Topology"]

#: How ranks reach their site's network: a port each (a data centre: a NIC per accelerator), or one
#: per worker that its ranks share (nodes behind their own uplinks).
PORTS = ("rank", "worker")


@dataclass(frozen=True)
class Topology:
    """Sites, their links, worker speeds and link schedules (module docstring)."""

    sites: int = 1
    intra_link: Link = LAN_LINK
    inter_link: Link = field(default=LAN_LINK)
    name: str = ""
    ranks_per_worker: int = 1
    worker_link: Link | None = None
    site_names: tuple[str, ...] = ()  # empty: site0, site1, ...
    site_workers: tuple[int, ...] = ()  # workers per site; empty: an even spread
    site_links: tuple[Link, ...] = ()  # inside each site; empty: intra_link
    pair_links: tuple[tuple[int, int, Link], ...] = ()  # directed (src, dst, link); else inter_link
    site_ports: tuple[str, ...] = ()  # per site: "rank" (own port) or "worker"; empty: rank
    speeds: tuple[float, ...] = ()  # per worker, relative; empty: all equal
    step_s: float = 0.0  # a full-speed worker's step, emulated (0: as it runs)
    schedules: tuple[LinkSchedule, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.sites, int) or isinstance(self.sites, bool) or self.sites < 1:
            raise ConfigError(f"sites must be a positive integer, got {self.sites!r}")
        if not isinstance(self.ranks_per_worker, int) or self.ranks_per_worker < 1:
            raise ConfigError(f"ranks_per_worker must be a positive integer, got {self.ranks_per_worker!r}")
        for what, values in (
            ("site_names", self.site_names),
            ("site_workers", self.site_workers),
            ("site_links", self.site_links),
            ("site_ports", self.site_ports),
        ):
            if values and len(values) != self.sites:
                raise ConfigError(f"{what} has {len(values)} entries for {self.sites} sites")
        for ports in self.site_ports:
            if ports not in PORTS:
                raise ConfigError(f"a site's ports are {' or '.join(PORTS)}, got {ports!r}")
        for i, n in enumerate(self.site_workers):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ConfigError(f"site {self.site_name(i)} has no workers (got {n!r}); every site needs at least one")
        if self.speeds:
            if not self.site_workers:
                raise ConfigError("per-worker speeds need a topology with worker counts per site")
            if len(self.speeds) != sum(self.site_workers):
                raise ConfigError(f"{len(self.speeds)} speeds for {sum(self.site_workers)} workers")
            bad = [s for s in self.speeds if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0)]
            if bad:
                raise ConfigError(f"a worker's speed must be a positive number, got {bad[0]!r}")
        if not (isinstance(self.step_s, (int, float)) and math.isfinite(self.step_s) and self.step_s >= 0):
            raise ConfigError(f"the emulated step time must be >= 0 s, got {self.step_s!r}")
        for src, dst, _ in self.pair_links:
            if not (0 <= src < self.sites and 0 <= dst < self.sites) or src == dst:
                raise ConfigError(f"a link between sites {src} and {dst} of {self.sites}")

    # ---- placement ------------------------------------------------------------------------
    @property
    def workers(self) -> int | None:
        """The workers a laid-out topology holds (None: an even one takes any number)."""
        return sum(self.site_workers) if self.site_workers else None

    def check_workers(self, workers: int) -> None:
        """A ConfigError unless a run of `workers` workers fits this topology."""
        if self.workers is not None and workers != self.workers:
            counts = ", ".join(f"{self.site_name(i)} {n}" for i, n in enumerate(self.site_workers))
            raise ConfigError(
                f"the topology {self.label} has {self.workers} workers ({counts}) but the run has "
                f"{workers}: launch {self.workers} workers (--workers {self.workers}, or as many "
                f"torchrun nodes)"
            )
        if self.workers is None and self.sites > workers:
            raise ConfigError(
                f"--wan {self.name} has {self.sites} sites but the run has {workers} workers "
                f"(at least one worker per site: --workers {self.sites} or more)"
            )

    def worker_site(self, worker: int, workers: int) -> int:
        """The site of worker `worker` of `workers`."""
        if not self.site_workers:
            return worker * self.sites // workers
        if workers != self.workers:
            self.check_workers(workers)
        return self._worker_sites[worker]

    @functools.cached_property
    def _worker_sites(self) -> tuple[int, ...]:
        return tuple(s for s, n in enumerate(self.site_workers) for _ in range(n))

    def site_of(self, rank: int, world_size: int) -> int:
        """The site of global rank ``rank`` among ``world_size`` ranks: its worker's site."""
        r = self.ranks_per_worker
        if world_size % r:
            raise ConfigError(f"world size {world_size} is not a multiple of ranks_per_worker {r}")
        return self.worker_site(rank // r, world_size // r)

    def site_name(self, site: int) -> str:
        return self.site_names[site] if self.site_names else f"site{site}"

    @property
    def label(self) -> str:
        return repr(self.name) if self.name else f"of {self.sites} sites"

    # ---- links ----------------------------------------------------------------------------
    @property
    def inside_worker(self) -> Link:
        """The link between the R ranks of one worker, the one definition every caller reads:
        ``worker_link``, else the site's own link (``intra_link``), where an emulated worker's ranks are."""
        return self.intra_link if self.worker_link is None else self.worker_link

    @functools.cached_property
    def _pairs(self) -> dict[tuple[int, int], Link]:
        return {(a, b): link for a, b, link in self.pair_links}

    def base_link(self, src: int, dst: int) -> Link:
        """The link from site `src` to site `dst` (a site's own when they are one), before schedules."""
        if src == dst:
            return self.site_links[src] if self.site_links else self.intra_link
        return self._pairs.get((src, dst), self.inter_link)

    def link(self, src: int, dst: int, at_s: float = 0.0) -> Link:
        """The link from site `src` to site `dst` at run time `at_s` (its schedules applied)."""
        link = self.base_link(src, dst)
        for schedule in self.schedules:
            if schedule.covers((src, dst)):
                link = schedule.apply((src, dst), link, at_s)
        return link

    def shared_port(self, site: int) -> bool:
        """Do a worker's ranks share one port into `site`'s network (nodes each behind their own
        uplink, as over the internet), rather than each rank having its own (a data centre's NICs)?"""
        return bool(self.site_ports) and self.site_ports[site] == "worker"

    @property
    def varies(self) -> bool:
        """Do the links change over the run?"""
        return bool(self.schedules)

    def phase_start(self, at_s: float) -> float:
        """A run time at which the links are as at `at_s`, the same for every time until they next
        change (0 for constant links): the latest of the schedules' own phase starts."""
        return max((s.phase_start(at_s) for s in self.schedules), default=0.0)

    @property
    def uniform(self) -> bool:
        """Every pair of sites on one link, every site on one: a ``--wan`` spec's topology."""
        return not (self.pair_links or self.site_links or self.schedules)

    @property
    def jitter_s(self) -> float:
        """The largest jitter scale of any link."""
        links = [self.intra_link, self.inter_link, *self.site_links, *(link for _, _, link in self.pair_links)]
        return max(link.jitter_s for link in links)

    # ---- workers' speeds -------------------------------------------------------------------
    def slowdown(self, worker: int) -> float:
        """How many times longer worker `worker`'s steps take than the fastest worker's (1: full speed)."""
        if not self.speeds:
            return 1.0
        return max(self.speeds) / self.speeds[worker]

    def emulated_step_s(self, worker: int) -> float:
        """How long a step of worker `worker` lasts in an emulated run (0: as long as it takes here):
        `step_s`, times its slowdown."""
        return self.step_s * self.slowdown(worker)

    def digest(self) -> str:
        """A short digest of everything this topology says (its name aside): what nodes compare, and a
        resumed run against its checkpoint, whatever path its file was read from."""
        import hashlib

        return hashlib.sha256(repr(dataclasses.replace(self, name="")).encode()).hexdigest()[:16]

    # ---- words -----------------------------------------------------------------------------
    def describe(self) -> str:
        """A one-line human description (used by logs and reports)."""
        head = f"{self.name}: " if self.name else ""
        tail = f"; {self.ranks_per_worker} ranks per worker" if self.ranks_per_worker > 1 else ""
        if self.worker_link is not None:
            tail += f"; inside a worker {_fmt(self.worker_link)}"
        if self.speeds and len(set(self.speeds)) > 1:
            tail += "; worker speeds " + ", ".join(f"{s:g}" for s in self.speeds)
        if self.step_s:
            tail += f"; steps of {self.step_s:g} s at full speed"
        if self.schedules:
            tail += f"; {len(self.schedules)} link schedule{'s' if len(self.schedules) > 1 else ''}"
        if self.site_workers:
            sites = ", ".join(
                f"{self.site_name(i)} ({n} worker{'s' if n > 1 else ''}, {_fmt(self.base_link(i, i))})"
                for i, n in enumerate(self.site_workers)
            )
            pairs = "; ".join(self._pair_words())
            plural = "s" if self.sites > 1 else ""
            return f"{head}{self.sites} site{plural}: {sites}" + (f"; {pairs}" if pairs else "") + tail
        if self.sites == 1:
            return f"{head}1 site, {_fmt(self.intra_link)}{tail}"
        return (
            f"{head}{self.sites} sites, between sites {_fmt(self.inter_link)}; " f"inside {_fmt(self.intra_link)}{tail}"
        )

    def _pair_words(self) -> list[str]:
        words = []
        for a in range(self.sites):
            for b in range(a + 1, self.sites):
                there, back = self.base_link(a, b), self.base_link(b, a)
                names = f"{self.site_name(a)}-{self.site_name(b)}"
                words.append(
                    f"{names} {_fmt(there)}" if there == back else f"{names} {_fmt(there)} (back {_fmt(back)})"
                )
        return words


def _fmt(link: Link) -> str:
    j = f", jitter {link.jitter_s * 1e3:g} ms" if link.jitter_s else ""
    mtu = f", MTU {link.mtu}" if link.mtu != 1500 else ""
    return f"RTT {link.rtt_s * 1e3:.4g} ms, {link.bandwidth_bps / 1e9:.4g} Gbit/s{j}{mtu}"
