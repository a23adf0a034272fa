"""The emulating process group: real collectives, completed when the modelled link says so.

:class:`EmulatedProcessGroup` is a Python ``torch.distributed.ProcessGroup`` registered with
``Backend.register_backend`` (extended API, so it learns its group's global ranks). It replaces the
whole process group, so it implements every collective its callers use; each one

1. issues the real collective at once on a wrapped backend (gloo for CPU tensors, NCCL for CUDA),
2. computes the modelled duration d (:mod:`wansync.net.cost`, jitter shared by all ranks),
3. reserves its :class:`~wansync.net.Emulator`'s link, which is FIFO: start = max(issue, end of
   the previous transfer),
4. issues beside it a MAX all-reduce of that start (8 bytes on the real backend), so that the
   transfer starts when the last member is ready: the straggler's lateness delays everyone's end
   (for a transfer modelled at `emulator.SHORT_S` or more; a shorter one starts at the rank's issue),
5. returns a Work whose Future the emulator's completer thread completes at
   max(real completion, start + d), in issue order.

A group gets its emulator as ``pg_options``; a group created without one (``new_group()``, called
by us or by a library) shares the default group's, so a rank has one network path, whatever the group.
A group that runs as one of several parallel copies on disjoint ranks of the same sites (the sharded
exchange between workers) is created with ``pg_options=shared_uplink(copies)``: its collectives are
modelled with ``parallel=copies``, the copies sharing each site's uplink (:mod:`wansync.net.cost`).
DDP needs ``broadcast`` (initial state), ``allgather`` (constructor checks) and ``allreduce``
(gradient buckets); ``PeriodicModelAverager`` needs ``allreduce``; ``dist.barrier`` needs ``barrier``.
"""

from __future__ import annotations

import socket
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from wansync.errors import ConfigError
from wansync.net.cost import collective_duration, jitter_draw
from wansync.net.emulator import SHORT_S, Arrival, Emulator
from wansync.net.topology import Topology
from wansync.net.records import CollectiveRecord
from wansync.net.work import CallerWork, EmulatedWork

__all__ = [
    "BACKEND_NAME",
    "EmulatedProcessGroup",
    "SharedUplink",
    "emulator_of",
    "install",
    "machine_identity",
    "shared_uplink",
]

BACKEND_NAME = "wansync_emu"
_MAX = dist.AllreduceOptions()
_MAX.reduceOp = dist.ReduceOp.MAX


def machine_identity() -> int:
    """The same number in every process that runs under the same kernel, so reads the same monotonic
    clock and shares the same cores: the kernel's boot id (Linux) or, elsewhere, the host's name."""
    try:
        ident = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        ident = socket.gethostname()
    return zlib.crc32(ident.encode())


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _first_tensor(tensors: Any) -> torch.Tensor | None:
    if isinstance(tensors, torch.Tensor):
        return tensors
    for t in tensors:
        found = _first_tensor(t)
        if found is not None:
            return found
    return None


class EmulatedProcessGroup(dist.ProcessGroup):
    """A process group whose collectives take as long as the modelled link says (and no less)."""

    def __init__(self, opts: Any, pg_options: Any = None):
        rank, size = opts.group_rank, opts.group_size
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._name = str(opts.group_id)
        self._group_key = zlib.crc32(self._name.encode())
        ranks = list(opts.global_ranks_in_group)
        if dist.is_initialized():  # a subgroup: sites are fixed by the global world
            self._world = dist.get_world_size()
            self._ranks = ranks or list(range(self._world))
        else:  # the default group being created
            self._world = size
            self._ranks = ranks or list(range(size))
        self.emulator = _emulator_for(pg_options)
        self.parallel = pg_options.copies if isinstance(pg_options, SharedUplink) else 1
        self._seq = 0
        self._durations: dict[tuple[str, int, float], float] = {}  # the model's, per (op, bytes, links' phase)
        timeout = opts.timeout
        store = dist.PrefixStore("gloo/", opts.store)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._clock_offset = self._shared_clock_offset()
        if not dist.is_initialized() and self.topology.varies:  # the default group: the run's time origin
            self.emulator.agree_origin(self._agreed_now() - self._clock_offset)
        self._nccl = None
        if torch.cuda.is_available() and dist.is_nccl_available():
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = timeout
            self._nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", opts.store), rank, size, nccl_opts)

    def _shared_clock_offset(self) -> float:
        """What to add to perf_counter for a time every member reads alike: 0 when all of them run
        under one kernel (perf_counter is its monotonic clock, exact across processes), else the
        offset to the wall clock (hosts agree to NTP's accuracy: a skew of s delays collectives by up
        to s). Asked once, with one small all-reduce, when the group is made."""
        if self._size == 1:
            return 0.0
        ident = machine_identity()
        seen = torch.tensor([ident, -ident], dtype=torch.int64)
        self._gloo.allreduce([seen], _MAX).wait()
        return 0.0 if seen.tolist() == [ident, -ident] else self.emulator.clock_offset

    def _agreed_now(self) -> float:
        """The latest member's clock now (on the clock the members share): the run's time origin,
        from which link schedules count (one small all-reduce, only for links that change)."""
        now = torch.tensor([time.perf_counter() + self._clock_offset], dtype=torch.float64)
        if self._size > 1:
            self._gloo.allreduce([now], _MAX).wait()
        return float(now[0])

    # -- plumbing ---------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """`destroy_process_group`'s call: the group's own gloo (and NCCL) backend ends here, its threads
        joined (`_end`). torch's base class knows nothing of them, and left to the interpreter's exit a
        gloo thread that still held a tensor aborted the process (SIGABRT, "terminate called without an
        active exception"): twice in the suite's runs on a loaded machine."""
        self._end("shutdown")

    def abort(self) -> None:
        """`_abort_process_group`'s call: as `shutdown`, without waiting for what is in flight."""
        self._end("abort")

    def _end(self, how: str) -> None:
        """`how` ("shutdown" or "abort") each backend, then drop them: their destructors join their threads
        now, while the interpreter is whole (torch's `shutdown` alone leaves them running). The group is
        not used after it is destroyed."""
        for backend in (self._gloo, self._nccl):
            if backend is not None:
                getattr(backend, how)()
        self._gloo = self._nccl = None

    @property
    def group_name(self) -> str:
        """torch keeps a group's name on its backends, and a Python group has none of its own: the
        name it was registered under (`opts.group_id`), which a DeviceMesh built on the group
        (FSDP2's) looks up."""
        return self._name

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        copies = f", 1 of {self.parallel} parallel copies" if self.parallel > 1 else ""
        return (
            f"EmulatedProcessGroup(group={self._name}, rank={self._rank}/{self._size}{copies}, "
            f"{self.topology.describe()})"
        )

    @property
    def topology(self) -> Topology:
        return self.emulator.topology

    def records(self) -> list[CollectiveRecord]:
        """This group's records (its emulator's records of collectives on this group)."""
        return [r for r in self.emulator.records() if r.group == self._name]

    def _issue(
        self,
        op: str,
        nbytes: int,
        tensors: Any,
        real: Callable[[Any], Any],
        value: Any,
        peers: Sequence[int] | None = None,
    ) -> EmulatedWork:
        issue = time.perf_counter()
        t = _first_tensor(tensors)
        cuda = t is not None and t.is_cuda
        if cuda and self._nccl is None:
            raise RuntimeError("wansync emulator: CUDA tensor given but NCCL is not available")
        works = real(self._nccl if cuda else self._gloo)
        works = list(works) if isinstance(works, list) else [works]
        if peers is None:  # a collective: every member issues it, in the same order
            seq = self._seq
            self._seq += 1
        else:  # point-to-point: only two ranks see it, so no shared sequence number and no jitter
            seq = -1
        d = self._modelled(op, nbytes, seq, peers, issue)
        start = self.emulator.reserve(issue, d)
        rec = CollectiveRecord(
            op=op,
            nbytes=nbytes,
            group=self._name,
            seq=seq,
            issue=issue,
            start=start,
            modelled_s=d,
            modelled_end=start + d,
        )
        arrival = None
        if peers is None and self._size > 1 and d >= SHORT_S:  # its start is the latest member's (SHORT_S)
            clock = torch.tensor([start + self._clock_offset], dtype=torch.float64)
            arrival = Arrival(self._gloo.allreduce([clock], _MAX), clock, self._clock_offset)
        if self.emulator.short(works, rec, cuda, arrival):
            self.emulator.complete_in_caller(rec)
            return CallerWork(works[0], rec, value, self.emulator)
        fut = Future(devices=[t.device]) if cuda else Future()
        varies = None if not self.topology.varies else lambda start: self._modelled(op, nbytes, seq, peers, start)
        self.emulator.schedule(works, rec, fut, value, cuda, arrival, varies)
        return EmulatedWork(fut, rec, value)

    def _modelled(self, op: str, nbytes: int, seq: int, peers: Sequence[int] | None, start: float) -> float:
        """The modelled duration of a transfer starting at `start` (perf_counter): the cost model on
        the links as they are then (`Emulator.run_time`), plus the jitter every member draws alike."""
        at_s = self.emulator.run_time(start) if self.topology.varies else 0.0
        if peers is not None:
            return collective_duration(op, nbytes, self._world, self.topology, peers, self.parallel, at_s)
        key = (op, nbytes, self.topology.phase_start(at_s))
        d = self._durations.get(key)
        if d is None:
            if len(self._durations) >= 1024:  # sizes that never repeat: keep it small
                self._durations.clear()
            d = self._durations[key] = collective_duration(
                op, nbytes, self._world, self.topology, self._ranks, self.parallel, at_s
            )
        return d + jitter_draw(self.topology, self._world, self.emulator.seed, self._group_key, seq, self._ranks)

    # -- collectives ------------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._issue("allreduce", _nbytes(tensors), tensors, lambda b: b.allreduce(tensors, opts), tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._issue(
            "allreduce", _nbytes(tensors), tensors, lambda b: b.allreduce_coalesced(tensors, opts), tensors
        )

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._issue("broadcast", _nbytes(tensors), tensors, lambda b: b.broadcast(tensors, opts), tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._issue(
            "allgather",
            _nbytes(output_tensors),
            input_tensors,
            lambda b: b.allgather(output_tensors, input_tensors, opts),
            output_tensors,
        )

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._issue(
            "allgather",
            _nbytes(output_lists),
            input_list,
            lambda b: b.allgather_coalesced(output_lists, input_list, opts),
            output_lists,
        )

    def all_gather_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._issue(
            "allgather", _nbytes(output), input, lambda b: b._allgather_base(output, input, opts), [output]
        )

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._issue(
            "allgather",
            _nbytes(outputs),
            inputs,
            lambda b: [b._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)],
            outputs,
        )

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._issue(
            "reduce_scatter",
            _nbytes(input_lists),
            outputs,
            lambda b: b.reduce_scatter(outputs, input_lists, opts),
            outputs,
        )

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._issue(
            "reduce_scatter", _nbytes(input), input, lambda b: b._reduce_scatter_base(output, input, opts), [output]
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._issue(
            "reduce_scatter",
            _nbytes(inputs),
            inputs,
            lambda b: [b._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)],
            outputs,
        )

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """Every rank's chunk j to rank j (a lossy mean's reduce-scatter, `comm.exchange`)."""
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._issue(
            "alltoall",
            _nbytes(input),
            input,
            lambda b: b.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts),
            [output],
        )

    def gather(self, output_tensors, input_tensors, opts=None):
        """To one rank (torch.distributed.checkpoint's plans): costed as the all-gather of what arrives."""
        opts = opts if opts is not None else dist.GatherOptions()
        nbytes = _nbytes(input_tensors) * self._size
        return self._issue(
            "allgather", nbytes, input_tensors, lambda b: b.gather(output_tensors, input_tensors, opts), output_tensors
        )

    def scatter(self, output_tensors, input_tensors, opts=None):
        """From one rank: costed as the all-gather of what leaves it."""
        opts = opts if opts is not None else dist.ScatterOptions()
        nbytes = _nbytes(output_tensors) * self._size
        return self._issue(
            "allgather",
            nbytes,
            output_tensors,
            lambda b: b.scatter(output_tensors, input_tensors, opts),
            output_tensors,
        )

    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._issue("barrier", 0, [], lambda b: self._gloo.barrier(opts), [])

    def send(self, tensors, dst, tag=0):
        peers = [self._ranks[self._rank], self._ranks[dst]]
        return self._issue("send", _nbytes(tensors), tensors, lambda b: b.send(tensors, dst, tag), tensors, peers)

    def recv(self, tensors, src, tag=0):
        peers = [self._ranks[self._rank], self._ranks[src]]
        return self._issue("recv", _nbytes(tensors), tensors, lambda b: b.recv(tensors, src, tag), tensors, peers)


@dataclass(frozen=True)
class SharedUplink:
    """``pg_options`` for a group that runs as one of ``copies`` parallel copies under ``emulator``."""

    emulator: Emulator
    copies: int

    def __post_init__(self) -> None:
        if not isinstance(self.copies, int) or self.copies < 1:
            raise ConfigError(f"copies must be a positive integer, got {self.copies!r}")


def shared_uplink(copies: int, group: Any = None) -> SharedUplink | None:
    """The ``pg_options`` for ``dist.new_group(ranks, pg_options=...)`` of a group that runs as one of
    ``copies`` parallel copies on disjoint ranks of the same sites, sharing their uplinks (e.g. one
    group per local rank of the sharded exchange between workers). None when ``group`` (default:
    the default group) is not emulated, so a plain gloo or NCCL group gets no options."""
    emulator = emulator_of(group)
    return None if emulator is None else SharedUplink(emulator, copies)


def _emulator_for(pg_options: Any) -> Emulator:
    """The group's Emulator: the one it was created with (alone or in a :class:`SharedUplink`), else
    the default group's (a group a library creates with ``new_group()`` runs on the same link)."""
    if isinstance(pg_options, Emulator):
        return pg_options
    if isinstance(pg_options, SharedUplink):
        return pg_options.emulator
    if pg_options is not None:
        raise TypeError(
            f"the {BACKEND_NAME} backend takes an Emulator or net.shared_uplink(...) as pg_options, "
            f"got {type(pg_options).__name__}"
        )
    inherited = emulator_of()
    if inherited is None:
        raise ConfigError(
            f"the {BACKEND_NAME} backend needs an emulator: dist.init_process_group(net.install(), "
            f"pg_options=net.Emulator(topology, seed))"
        )
    return inherited


def _create(opts: Any, pg_options: Any = None) -> EmulatedProcessGroup:
    return EmulatedProcessGroup(opts, pg_options)


def install() -> str:
    """Register the emulating backend with torch (once per process); pass the result as ``backend=``
    and an :class:`~wansync.net.Emulator` as ``pg_options=``."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and dist.is_nccl_available() else [])
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=devices)
    return BACKEND_NAME


def emulator_of(group: Any = None) -> Emulator | None:
    """The Emulator ``group`` (default: the default group) runs under; None when it is not emulated."""
    if group is None:
        if not dist.is_initialized():
            return None
        group = dist.distributed_c10d._get_default_group()
    return group.emulator if isinstance(group, EmulatedProcessGroup) else None
