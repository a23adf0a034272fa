"""The hierarchical all-reduce between workers: inside each site, then between sites, then back.

A flat ring over every worker crosses the slow links between sites on every one of its 2(M − 1)
steps; where a site holds several workers, summing inside the site first (on its fast link), then
over one member per site (a ring of the sites), then broadcasting the total back inside each site
crosses them on 2(s − 1) steps instead (`net.cost.hierarchical_seconds`). The exchange runs it where
the cost model says it is faster (`net.cost.allreduce_algorithm`, every rank deciding alike from the
same topology and buffer size), and books which one ran (`CommLedger`).

The sum is the same sum in another order: every rank ends with the same bits (the site's first member
sums the sites in the sites' ring order and broadcasts), which is what the strategies need; it is not
bitwise the flat ring's sum.

    sites = SiteMean(emulator, group, workers, replicas)           # an exchange's: `Exchange.sites`
    sites.algorithm(nbytes)                                        # "flat" or "hierarchical", alike everywhere
    work = sites.sum(buf, purpose, ledger)                         # a Work: wait() raises what failed

With several ranks per worker (the sharded exchange, one group per local rank across the workers),
`make` builds the site and leader groups of every local rank on every rank (`dist.new_group` must be
called by all, in the same order) and keeps this rank's.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..net import shared_uplink
from ..net.cost import allreduce_algorithm, site_members
from ..net.work import WAITS_ATTR, blocked_on


class SiteMean:
    """Flat or by sites, for one exchange's fp32 means between its workers: the choice per buffer size
    (`net.cost.allreduce_algorithm` on the emulated link's topology, as the topology gives its links:
    every rank decides alike) and, once chosen, the groups that run it (made at their first use: every
    rank reaches it at the same exchange)."""

    def __init__(self, emulator: Any, group: Any, workers: int, replicas: Any):
        self.emulator = emulator if emulator is not None and emulator.topology.sites > 1 else None
        self.group, self.workers, self.replicas = group, workers, replicas
        self._chosen: dict[int, str] = {}
        self._groups: SiteGroups | None = None

    @property
    def modelled(self) -> bool:
        """Is there a topology of several sites to choose on (an emulated fixed group)?"""
        return self.emulator is not None

    def algorithm(self, nbytes: int) -> str:
        """`flat` or `hierarchical` for a mean of `nbytes` between the workers (flat when nothing is modelled)."""
        if self.emulator is None:
            return "flat"
        if nbytes not in self._chosen:
            members, world = self.members()
            self._chosen[nbytes] = allreduce_algorithm(
                nbytes, world, self.placed(), members, self.replicas.ranks_per_worker
            )
        return self._chosen[nbytes]

    def sum(self, buf: torch.Tensor, purpose: str, ledger: Any) -> Any:
        """Start the SUM all-reduce of `buf` between the workers, flat or by sites as the model says is
        faster (booked on `ledger` under `purpose` when there is a choice): a Work."""
        if self.modelled:
            algorithm = self.algorithm(buf.numel() * buf.element_size())
            ledger.ran(purpose, algorithm)
            if algorithm == "hierarchical":
                return self.all_reduce(buf)
        return dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def all_reduce(self, buf: torch.Tensor) -> Any:
        """The SUM of `buf` by sites, in the background (a Work)."""
        if self._groups is None:
            r = self.replicas.ranks_per_worker if self.replicas.between_workers else 1
            self._groups = SiteGroups.make(
                [self.members(i)[0] for i in range(r)], self.placed(), dist.get_world_size(), r
            )
        return self._groups.all_reduce(buf, async_op=True)

    def members(self, local: int | None = None) -> tuple[list[int], int]:
        """The global ranks of the exchange's group (local rank `local`'s, default this rank's), and the world."""
        world = dist.get_world_size()
        r = self.replicas.ranks_per_worker
        if not self.replicas.between_workers:
            return (
                [dist.get_global_rank(self.group, i) for i in range(self.workers)]
                if self.group is not None
                else list(range(world))
            ), world
        local = self.replicas.local_rank if local is None else local
        return [w * r + local for w in range(self.replicas.workers)], world

    def placed(self) -> Any:
        """The emulated topology with the exchange's workers of R ranks placed in it."""
        return dataclasses.replace(self.emulator.topology, ranks_per_worker=self.replicas.ranks_per_worker)


@dataclass
class SiteGroups:
    """This rank's groups for the hierarchical all-reduce: the members of its site (None when it is
    alone there), and, on a site's first member, the first members of every site."""

    site: Any
    leaders: Any
    leader_rank: int  # the global rank of this rank's site's first member (the broadcast's source)

    @classmethod
    def make(cls, groups: Sequence[Sequence[int]], topology: Any, world: int, parallel: int = 1) -> "SiteGroups":
        """The groups for every exchange group in `groups` (global ranks; one per local rank of a
        worker, or one), made on every rank in the same order; this rank's are kept."""
        rank = dist.get_rank()
        uplink = shared_uplink(parallel)
        mine: SiteGroups | None = None
        for members in groups:
            sites = site_members(world, topology, members)
            site_groups = []
            for site in sites:
                g = dist.new_group(list(site), pg_options=uplink) if len(site) > 1 else None
                site_groups.append(g)
            leaders = dist.new_group([s[0] for s in sites], pg_options=uplink)
            for site, g in zip(sites, site_groups):
                if rank in site:
                    mine = cls(g, leaders if rank == site[0] else None, site[0])
        if mine is None:
            raise ValueError(f"rank {rank} is in none of the exchange's groups")
        return mine

    def all_reduce(self, buf: torch.Tensor, async_op: bool = False) -> Any:
        """SUM of `buf` over the exchange's group, in place: the three phases in order, in a thread
        of their own when `async_op` (the caller overlaps them with its steps)."""
        if not async_op:
            self._run(buf)
            return None
        work = _ThreadWork(lambda: self._run(buf))
        work.start()
        return work

    def _run(self, buf: torch.Tensor) -> None:
        if self.site is not None:
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.site)
        if self.leaders is not None:
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.leaders)
        if self.site is not None:
            dist.broadcast(buf, src=self.leader_rank, group=self.site)


class _ThreadWork:
    """The three phases run in a thread; `wait()` joins it and raises what it raised (a dead peer).
    The thread's own waits are not the caller's blocking: under the emulator the caller's join is
    booked on the phases' records instead (`net.work.blocked_on`), so the profiler sees an overlapped
    mean as hidden and a waited one as exposed."""

    def __init__(self, fn: Any):
        self._error: BaseException | None = None
        self._records: list[Any] = []
        self._thread = threading.Thread(target=self._target, args=(fn,), name="wansync-site-mean", daemon=True)
        setattr(self._thread, WAITS_ATTR, self._records)

    def _target(self, fn: Any) -> None:
        try:
            fn()
        except BaseException as exc:  # re-raised in the waiting thread
            self._error = exc

    def start(self) -> None:
        self._thread.start()

    def wait(self, timeout: Any = None) -> bool:
        t0 = time.perf_counter()
        self._thread.join()
        blocked_on(self._records, t0, time.perf_counter())
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return not self._thread.is_alive()
