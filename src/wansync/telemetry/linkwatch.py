"""The link a run gets, watched from the records the profiler keeps: every collective the emulator
carried, on any of the run's groups, once it has completed, is a sample of `net.estimate` (its time
on the link: from its start, after what was queued before it, to its end).

Two estimates: the run's (every sample: `summary.json`'s `link_estimate`) and the current one (the
RTT from the fastest recent small collectives, the bandwidth from the newest `NEWEST` large ones: what the
per-step timeline and `--adapt` read; a median of three, so one slow sample moves neither). On real
links the records come from a link model that adds nothing measurable (`--wan lan`: each collective
then completes when the real one does); without the emulator nothing is recorded and nothing is
estimated.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..net.backend import EmulatedProcessGroup
from ..net.estimate import LinkEstimate, LinkSample, estimate_link

NEWEST = 3


class LinkWatch:
    """Samples from the records of the emulator `group` runs under, read as they complete."""

    def __init__(self, group: Any = None):
        if group is None and dist.is_initialized():
            group = dist.distributed_c10d._get_default_group()
        self.emulator = group.emulator if isinstance(group, EmulatedProcessGroup) else None
        self.world = dist.get_world_size() if self.emulator is not None else 1
        self.samples: list[LinkSample] = []
        self._pending: list[Any] = []
        self._cursor = 0
        self._groups: dict[str, tuple[tuple[int, ...], int]] = {}

    @property
    def active(self) -> bool:
        return self.emulator is not None and self.world > 1

    def _group(self, name: str) -> tuple[tuple[int, ...], int] | None:
        """(its global ranks, its parallel copies) of the emulated group called `name`."""
        if name not in self._groups:
            for pg, pg_name in list(dist.distributed_c10d._world.pg_names.items()):
                if isinstance(pg, EmulatedProcessGroup):
                    self._groups[pg_name] = (tuple(dist.get_process_group_ranks(pg)), pg.parallel)
        return self._groups.get(name)

    def update(self) -> None:
        """Take in the records that completed since the last call (the others wait for their end)."""
        if self.emulator is None or self.world < 2:
            return
        new = self.emulator.records_since(self._cursor)
        self._cursor += len(new)
        waiting, self._pending = self._pending + [r for r in new if r.seq >= 0], []
        for rec in waiting:
            if rec.end is None and rec.error is None:
                self._pending.append(rec)
                continue
            group = self._group(rec.group)
            if rec.error is None and group is not None and rec.end > rec.start:
                self.samples.append(
                    LinkSample(rec.op, rec.nbytes, group[0], self.world, rec.end - rec.start, rec.start, group[1])
                )

    def current(self) -> LinkEstimate:
        """The link now: the bandwidth of the newest samples (module docstring)."""
        self.update()
        if self.emulator is None:
            return LinkEstimate(None, None, 0)
        return estimate_link(self.samples, self.emulator.topology, newest=NEWEST)

    def newest(self, rtt_s: float | None) -> LinkEstimate:
        """What the newest large sample alone says of the bandwidth (at `rtt_s`)."""
        self.update()
        if self.emulator is None:
            return LinkEstimate(None, None, 0)
        return estimate_link(self.samples, self.emulator.topology, newest=1, rtt_s=rtt_s)

    def run(self) -> LinkEstimate:
        """The link over the whole run so far."""
        self.update()
        if self.emulator is None:
            return LinkEstimate(None, None, 0)
        return estimate_link(self.samples, self.emulator.topology)


def link_fields(estimate: LinkEstimate) -> dict[str, float]:
    """A step record's view of the link (metrics.jsonl): what is known of it."""
    out = {}
    if estimate.bandwidth_bps is not None:
        out["link_bw_bps"] = round(estimate.bandwidth_bps, 1)
    if estimate.rtt_s is not None:
        out["link_rtt_s"] = round(estimate.rtt_s, 6)
    return out
