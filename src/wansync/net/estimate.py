r"""The link a run actually gets, estimated from its own collectives' timings.

Each completed collective is a sample: its op, its bytes (the cost model's B), the group's ranks
and how long it held the link (from its start on the link, after whatever was queued before it, to
its completion). The unknown is one link, the one between sites (in a world of one site: the
site's own), put into the run's topology in place of every link between sites (`on_link`); the
cost model (`net.cost`, the emulator's and the planner's own) then says how long each sample would
have taken on it, and the estimate is the link under which the samples take the time they took:

* the **bandwidth** solves `duration(sample, rtt, bw) = seconds` for each of the newest samples
  that move many bytes, and takes their median;
* the **RTT** solves the same for the small collectives (where latency is most of the time: the
  evaluation's means, a controller's agreement), given that bandwidth: one solve per kind of small
  collective on the fastest of its newest `RTT_WINDOW` times, and the median over the kinds.

Which samples are small is decided by the collective, not its measured time (the ratio of its
bytes to its latency on the model), so one slow sample stays in its class and a median of three
ignores it. A small collective's time is mostly waiting for its peers to be scheduled, so a busy
machine only ever adds to it (the emulator never completes a transfer before its modelled end): the
fastest recent one is the link's, where a median of them measured 2x the RTT beside two busy loops,
and the bandwidth solved beside that RTT came out without bound (the latency alone explained the
large samples). Without small collectives the RTT is not known (None) and the bandwidth is solved at
the topology's own RTT; a collective that crosses no link between sites (inside a site, inside a
worker) says nothing of it and is left out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from wansync.errors import ConfigError
from wansync.net.cost import collective_duration
from wansync.net.link import Link
from wansync.net.topology import Topology

__all__ = ["LinkEstimate", "LinkSample", "estimate_link", "on_link"]

SPAN = 100  # sizes (bytes per latency) this far apart tell latency and bandwidth apart
RTT_WINDOW = 5  # the newest times of a kind of small collective whose fastest tells the RTT
_BW = (1e3, 1e13)  # the bandwidths searched (bit/s)
_RTT = (0.0, 30.0)  # the round trips searched (s)
_FAST = 1e15  # a rate at which bytes take no time


@dataclass(frozen=True)
class LinkSample:
    """One collective as the link carried it."""

    op: str
    nbytes: float
    members: tuple[int, ...]  # the group's global ranks, in its order
    world: int  # the run's ranks (they place each rank in its site)
    seconds: float
    at_s: float = 0.0  # when it started (any clock: the estimate keeps the newest)
    parallel: int = 1  # copies running at once on the same links (one per local rank)


@dataclass(frozen=True)
class LinkEstimate:
    rtt_s: float | None  # None: no small collective told it
    bandwidth_bps: float | None  # None: no sample moved bytes over the link
    samples: int
    newest_at: float | None = None  # when the newest sample the bandwidth rests on started

    def link(self, default_rtt_s: float = 0.0) -> Link | None:
        """The estimate as a `Link` (None without a bandwidth)."""
        if self.bandwidth_bps is None:
            return None
        return Link(rtt_s=self.rtt_s if self.rtt_s is not None else default_rtt_s, bandwidth_bps=self.bandwidth_bps)

    def as_dict(self) -> dict[str, float | int | None]:
        return {"rtt_s": self.rtt_s, "bandwidth_bps": self.bandwidth_bps, "samples": self.samples}


def on_link(topology: Topology, link: Link) -> Topology:
    """`topology` with `link` between every pair of sites (one site: inside it), nothing changing."""
    if topology.sites > 1:
        return replace(topology, inter_link=link, pair_links=(), schedules=())
    return replace(topology, intra_link=link, site_links=(), schedules=())


def wan_link(topology: Topology) -> Link:
    """The link `on_link` replaces, as the topology has it (its first pair's, when they differ)."""
    if topology.sites > 1:
        return topology.base_link(0, 1)
    return topology.base_link(0, 0)


def duration(sample: LinkSample, topology: Topology, rtt_s: float, bandwidth_bps: float) -> float:
    """The sample's modelled seconds with the link between sites at (rtt, bandwidth)."""
    link = Link(rtt_s=rtt_s, bandwidth_bps=bandwidth_bps)
    return collective_duration(
        sample.op, sample.nbytes, sample.world, on_link(topology, link), ranks=sample.members, parallel=sample.parallel
    )


def _crosses(sample: LinkSample, topology: Topology) -> tuple[float, float] | None:
    """(latency seconds per second of RTT, byte seconds at 1 bit/s) of the sample on the link, or None
    when the link does not change its time (it crosses no site boundary, or an op the model lacks)."""
    try:
        base = duration(sample, topology, 0.0, _FAST)
        alpha = duration(sample, topology, 1.0, _FAST) - base
        beta = duration(sample, topology, 0.0, 1.0) - base
    except ConfigError:
        return None
    return (alpha, beta) if alpha > 1e-12 or beta > 1e-12 else None


def _solve(f, lo: float, hi: float, target: float, tol: float = 1e-7) -> float:
    """x in [lo, hi] with f(x) = target for a rising f, clamped at the ends: regula falsi with the
    Illinois step (a few evaluations where f is nearly linear, as a link's time is in its RTT and in
    the inverse of its rate)."""
    f_lo, f_hi = f(lo) - target, f(hi) - target
    if f_lo >= 0:
        return lo
    if f_hi <= 0:
        return hi
    side = 0
    for _ in range(100):
        x = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        fx = f(x) - target
        if abs(fx) <= tol * target or hi - lo <= tol * max(abs(x), 1e-12):
            return x
        if fx > 0:
            hi, f_hi = x, fx
            if side == 1:
                f_lo /= 2
            side = 1
        else:
            lo, f_lo = x, fx
            if side == -1:
                f_hi /= 2
            side = -1
    return x


def split_by_size(
    samples: Sequence[LinkSample], shape: dict[int, tuple[float, float]]
) -> tuple[list[LinkSample], list[LinkSample]]:
    """The small collectives (they tell the RTT) and the large ones (the bandwidth), by the collective's
    own ratio of byte time to latency, not by its measured time. Only where the ratios span `SPAN` or
    more; else ([], all)."""
    ratio = {id(s): shape[id(s)][1] / shape[id(s)][0] if shape[id(s)][0] > 0 else math.inf for s in samples}
    finite = [r for r in ratio.values() if math.isfinite(r) and r > 0]
    if not finite:
        return [], list(samples)
    lo, hi = min(finite), max(ratio.values())
    if not hi >= SPAN * lo:
        return [s for s in samples if ratio[id(s)] == 0], [s for s in samples if ratio[id(s)] > 0]
    cut = math.sqrt(lo * hi) if math.isfinite(hi) else lo * math.sqrt(SPAN)
    return [s for s in samples if ratio[id(s)] < cut], [s for s in samples if ratio[id(s)] >= cut]


def _class_fastest(samples: Sequence[LinkSample]) -> list[LinkSample]:
    """One sample per kind of collective (op, bytes, group): the fastest of its newest `RTT_WINDOW`
    (`samples` in the order they started)."""
    kinds: dict[tuple, list[LinkSample]] = {}
    for s in samples:
        kinds.setdefault((s.op, s.nbytes, s.members, s.world, s.parallel), []).append(s)
    return [min(group[-RTT_WINDOW:], key=lambda s: s.seconds) for group in kinds.values()]


def estimate_link(
    samples: Sequence[LinkSample],
    topology: Topology,
    newest: int | None = None,
    rtt_s: float | None = None,
    keep: int = 200,
) -> LinkEstimate:
    """The link between sites behind `samples` on `topology`'s shape (module docstring). `newest`: the
    bandwidth from that many of the newest large samples (a link that changes); `rtt_s`: a round trip
    known already; `keep`: the newest samples looked at."""
    shape: dict[int, tuple[float, float]] = {}
    by_class: dict[tuple, tuple[float, float] | None] = {}
    usable = []
    for s in sorted(samples, key=lambda s: s.at_s)[-keep:]:
        key = (s.op, s.nbytes, s.members, s.world, s.parallel)
        if key not in by_class:
            by_class[key] = _crosses(s, topology)
        crossing = by_class[key]
        if crossing is not None:
            shape[id(s)] = crossing
            usable.append(s)
    small, large = split_by_size(usable, shape)
    small = _class_fastest(small)  # the RTT: one solve per kind of small collective
    large = [s for s in large if shape[id(s)][1] > 0]
    rtt = rtt_s if rtt_s is not None else wan_link(topology).rtt_s
    bw = None
    newest_at = large[-1].at_s if large else None
    for _ in range(3 if small and rtt_s is None else 1):
        rates = [
            1 / _solve(lambda inv, s=s: duration(s, topology, rtt, 1 / inv), 1 / _BW[1], 1 / _BW[0], s.seconds)
            for s in large[-newest if newest else 0 :]
        ]
        bw = statistics.median(rates) if rates else None
        if small and rtt_s is None:
            at = bw if bw is not None else _FAST
            rtt = statistics.median(
                _solve(lambda r, s=s: duration(s, topology, r, at), *_RTT, s.seconds) for s in small
            )
    known = rtt_s is not None or bool(small)
    return LinkEstimate(rtt if known else None, bw, len(usable), newest_at)
