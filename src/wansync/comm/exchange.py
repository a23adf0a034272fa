"""The one exchange path for model state: every average of parameters, pseudo-gradients or
optimizer state, and the initial broadcast, goes through an `Exchange`.

One place owns what each such exchange needs, so that replica groups and fault tolerance can
plug in here and nowhere else:

- **Codec.** `fp32` sends the buffer as it is (any float dtype) through a SUM all-reduce of every
  worker's values divided by their number (gloo has no AVG; dividing before the collective, as
  torch's DDP and model averager do, needs no pass after it and writes the mean out of place for
  free). A lossy codec (bf16, int8, fp4) cannot be summed on the wire (each rank has its own
  scales): its mean is an all-gather of every rank's payload or a reduce-scatter of encoded
  chunks (`comm.lossy_mean`, chosen by `lossy_collective`), decoded and accumulated in FP32 in
  rank order: the same bytes summed in the same order give the same bits on every rank, which
  the strategies rely on (their anchors must not drift apart).
- **Non-finite guard** (`nonfinite`, for model state: the purposes in `GUARDED`). None: no check
  before sending; "abort": raise NonFiniteError before a NaN/Inf leaves this worker; "skip": send a
  zero contribution with weight 0 and divide by the number of valid contributors, so every rank
  leaves out the same workers the same way (fp32: the weight is one extra element of the
  all-reduced buffer; lossy: one flag byte after each payload). Whatever the policy, a non-finite
  mean of model state raises rather than reach the model; that check is the mean's L2 norm, which
  the handle keeps (`norm`), or with `mean_sq` its float64 square (below).
- **Where the mean lands**: a new tensor, or `buf` itself (`inplace`). With `mean_sq` the handle
  also reports ‖mean‖₂² accumulated in float64 (`exact_sq_norm`), which is then the non-finite
  check: the drift telemetry's parallel-axis identity needs it to ~1e-9, where a float32 dot's
  long accumulation is off by ~1e-6.
- **Side-band scalars** (`extra=k`): the last `k` elements of the buffer are not model state but
  telemetry riding on an exchange that happens anyway (the drift of the previous boundary), so it
  costs no collective of its own. They are summed and divided like the values (over the same
  valid contributors), sent raw as float32 after a lossy payload, left out of the non-finite guard,
  and booked as `telemetry` bytes without a call.
- **Bytes**, booked on the ledger by purpose: `wire_bytes` is this rank's payload, what one rank
  puts on the wire per hop. What a rank transmits in total depends on the collective:
  `(M − 1)·wire_bytes` for an all-gather, about `2(M − 1)/M·wire_bytes` for a ring all-reduce.
  `payload_bytes` is the uncompressed size, so their ratio is the codec's compression. The guard's
  weight or flag is booked as `nonfinite_guard`.
- **Time.** `wait()` books the time blocked on the collective under the purpose; the ledger's
  listeners (the trainer's profiler) count it as exposed communication. Decoding is not waiting.
- **Robust mean** (`robust`, see `comm.robust`): a mean of pseudo-gradients (`origin`: each worker's
  is `buf − origin`) has every worker's contribution clipped to κ × the median of their norms before
  it is sent; the norms travel first, one all-gather of M numbers booked as `robust_norms` (under
  fault tolerance over the quorum's members, each with its worker's number), and
  every clip is told to the `on_clip` listeners (the strategy's `robust_clip` events). The same
  contribution is where fault injection strikes (`fault`, tests only: a factor it is multiplied by).

- **Replica groups** (`replicas`, see `comm.replicas`): when a worker is R > 1 ranks holding the
  same parameters, the exchange is between workers only. The buffer's values are split into R
  contiguous shards (the side-band scalars ride on the last); local rank r averages shard r over
  its `across` group (one rank per worker: the guard, the codec and the division by the number
  of contributors are as above, per shard), then the worker's ranks all-gather the shards over
  `inside`. Each worker thus puts one model's worth of bytes on the wide-area link per exchange,
  whatever R is, every rank carrying 1/R of it; the all-gather is booked as `inside/<purpose>`
  (`comm.worker_shards`: the worker's side of it).
  A buffer with fewer values than R is not split (every local rank averages all of it).
  With the model sharded inside a worker (FSDP, `Replicas.shards`), each rank already holds only
  its own shard, the same one as the same local rank of every other worker: a mean runs on this
  rank's local values over `across` and nothing is split or gathered; the initial broadcast runs
  over `across` from the first worker. Values every rank must agree on whatever it holds (the
  schedule's, `REPLICATED`) are averaged over every rank instead, scalars that describe the
  worker's whole model (norms, the drift) are summed over its shards (`worker_sum`), and under
  "skip" a worker's contribution counts only when every one of its shards is finite.

- **Fault tolerance** (`quorum`, see `ft.quorum`): given at construction, an fp32 mean runs over
  torchft's quorum instead of `group` (the workers alive now, divided by the number of
  contributors), blocking: its wait is booked from the moment the mean was asked for; a sparse
  payload is all-gathered over the quorum's members, each with its validity flag (a worker healed in
  the slot sends a copy of its source's values, flagged 0). In a worker
  of several ranks (DDP inside) each rank averages its shard over its own rank's quorum group and
  the worker puts the whole together, as over `across`. Who takes
  part changes, so a strategy asks the exchange to `meet` before the exchanges of a step (a no-op
  for a fixed group): the workers agree on the members, a worker behind the others heals from a
  peer there, and the time is booked as `quorum`. `already_synced`: this worker healed into its
  peers' final synchronization and holds the result of the step's exchanges; `participants`: the
  size of the last exchange's quorum (None for a fixed group: every worker).

`mean` is a pipeline: prepare the payload (the values, the side band, the guard's verdict) → send
it (an fp32 all-reduce, a lossy all-gather or reduce-scatter, or the quorum's mean; sharded across replica groups)
→ book its bytes → a handle whose finish puts the mean together and checks it.

Without an initialized process group the "group" is this one rank, and the mean of a lossy codec
is `decode(encode(x))`, the same quantization a multi-rank run applies.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import ConfigError, NonFiniteError
from ..net import emulator_of
from .codecs import Codec, get_codec
from .ledger import CommLedger
from .lossy_mean import all_gather_mean, all_gather_rows, reduce_scatter_mean
from .mean_cost import lossy_path, mean_collectives, mean_seconds
from .norms import all_finite, exact_sq_norm, finite_norm
from .payload import Payload, Sent, contributors
from .replicas import Replicas
from .robust import ROBUST_NORMS, Clip, RobustMean, check_workers, scale_contribution
from .site_mean import SiteMean
from .weighted import weighted_mean
from .sparse import is_sparse
from .sparse_mean import sparse_mean
from .worker_shards import WorkerShards

GUARDED = ("params", "pseudo_grads", "optim_state", "momentum")
POLICIES = ("abort", "skip")
REPLICATED = ("schedule",)  # purposes whose values every rank must end with, whatever shard it holds
QUORUM = "quorum"  # ledger purpose: the time a worker waits to agree on who takes part (`meet`)
SENT_NONFINITE = " (a worker sent NaN/Inf; --on-nonfinite abort or skip stops it before the exchange)"


class MeanHandle:
    """An average in flight. `wait()` blocks until the collective is done, books that time on the
    ledger, finishes the mean and returns it; later calls return the same tensor. `blocked`: the
    exchange waited while sending (a quorum mean), so the wait is booked from `started_at`."""

    def __init__(
        self,
        ledger: CommLedger,
        purpose: str,
        work: Any,
        finish: Callable[[], torch.Tensor],
        wire_bytes: int,
        payload_bytes: int,
        started_at: float,
        blocked: bool = False,
    ):
        self.wire_bytes = wire_bytes  # this rank's payload on the wire
        self.payload_bytes = payload_bytes  # the buffer's own size
        self.started_at = started_at  # perf_counter() when the exchange was asked for
        self.waited_s = 0.0  # time blocked in wait()
        self.participants: int | None = None  # fault-tolerant: the workers in this exchange's quorum
        self.norm: float | None = None  # ‖mean‖₂ of the values, from the non-finite check (GUARDED
        # purposes, without `mean_sq`)
        self.mean_sq: float | None = None  # ‖mean‖₂² of the values in float64 (asked for with `mean_sq`)
        self._ledger, self._purpose, self._work, self._finish = ledger, purpose, work, finish
        self._blocked = blocked
        self._advance: Callable[[], None] | None = None
        self._result: torch.Tensor | None = None

    @classmethod
    def complete(cls, ledger: CommLedger, purpose: str, mean: torch.Tensor) -> "MeanHandle":
        """A handle whose mean is already known (received from a peer; nothing is on the wire)."""
        handle = cls(ledger, purpose, None, lambda: mean, 0, mean.numel() * mean.element_size(), time.perf_counter())
        handle._result, handle._finish = mean, None
        return handle

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._wait_first()
            self._result, self._finish, self._advance = self._finish(), None, None
        return self._result

    def advance(self) -> None:
        """A mean of two phases (a lossy reduce-scatter): wait for the first now and start the second
        in the background (every rank calls it at the same step); nothing for any other mean."""
        if self._finish is not None and self._advance is not None:
            self._wait_first()
            self._advance()
            self._advance = None

    def _wait_first(self) -> None:
        """Wait for the collective issued first, and book the time blocked on it."""
        t0 = self.started_at if self._blocked else time.perf_counter()
        if self._work is not None:
            self._work.wait()
            self._work = None
        waited = time.perf_counter() - t0
        self.waited_s += waited
        self._ledger.waited(self._purpose, waited)


class Exchange:
    """Averages and broadcasts of model state over `group` (see the module docstring).

    Args:
        group: the process group (None: the default group).
        nonfinite: None, "abort" or "skip": what to do with a NaN/Inf in this worker's model state.
        replicas: this rank's replica group (None: every rank is a worker of its own); with R > 1,
            averages run between workers, `group` must be the default group.
        quorum: this worker's membership in a fault-tolerant run (an `ft.quorum.Quorum`; None: the
            group is fixed); fp32 means then run over the workers alive now.
        robust: the robust mean of pseudo-gradients (`comm.robust.RobustMean`; None: a plain mean).
    """

    def __init__(
        self,
        group: Any = None,
        nonfinite: str | None = None,
        replicas: Replicas | None = None,
        quorum: Any = None,
        robust: RobustMean | None = None,
    ):
        if nonfinite is not None and nonfinite not in POLICIES:
            raise ConfigError(f"on_nonfinite must be abort or skip, got {nonfinite!r}")
        self.robust = robust
        self.on_clip: list[Callable[[list[Clip]], None]] = []  # told every mean's clips (robust)
        self.fault: Callable[[], float] | None = None  # fault injection: this worker's pseudo-gradient x it
        self.group = self.broadcast_group = group
        self.nonfinite = nonfinite
        self.replicas = replicas if replicas is not None else Replicas()
        self.ledger = CommLedger()
        self.worker = WorkerShards(self.replicas, self.ledger)
        self.quorum = quorum
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        if self.replicas.between_workers:
            if group is not None:
                raise ConfigError("an exchange between replica groups runs on the default group")
            self.group, self.world_size = self.replicas.across, self.replicas.workers
        if self.replicas.shards:  # each rank's shard comes from the first worker's
            self.broadcast_group = self.replicas.across
        emulator = emulator_of(self.broadcast_group) if quorum is None else None
        self.sites = SiteMean(emulator, self.group, self.world_size, self.replicas)  # flat or by sites
        # this worker's place among the group's contributions (the robust mean's norms)
        self.position = dist.get_rank(self.group) if dist.is_initialized() else 0
        if robust is not None:  # under fault tolerance each worker is a world of its own: the run's count
            check_workers(quorum.workers if quorum is not None else self.world_size, robust.kappa)

    def mean(
        self,
        buf: torch.Tensor,
        purpose: str,
        codec: str | Codec = "fp32",
        async_op: bool = False,
        inplace: bool = False,
        *,
        replay: bool = False,
        extra: int = 0,
        mean_sq: bool = False,
        collective: str = "auto",
        residual: torch.Tensor | None = None,
        weight: float | None = None,
        origin: torch.Tensor | float | None = None,
    ) -> MeanHandle:
        """Start averaging `buf` over the group; all ranks call it with the same purpose, codec
        and `buf.numel()`.

        Without `inplace`, `buf` is left as it is and may be reused at once; with it, the mean is
        written into `buf`. With `async_op` the collective runs in the background until `wait()`.
        `mean_sq`: the handle's `mean_sq` is ‖mean‖₂² of the values, in float64 (`exact_sq_norm`).
        `replay`: the ledger already holds this exchange (one relaunched after a resume), so its
        bytes and a dropped contribution are not counted again. `extra`: how many trailing elements
        of the 1-D `buf` are side-band scalars (see the module docstring). `collective`: how a lossy
        codec's mean travels (`lossy_collective`). `residual` (error feedback, a lossy codec): this
        worker's values plus `residual` are sent, and `residual` becomes what the codec dropped of
        them, so that what a worker sent over time plus its residual is what it had to send. `weight`:
        this worker's contribution weighs that much (the steps it computed, `strategies.pace`): the
        mean is Σ w·x / Σ w (`comm.weighted`); None: every worker alike. `origin`: this is a mean of
        pseudo-gradients, this worker's being `buf − origin` (a tensor every rank holds alike, or 0.0
        where `buf` is the pseudo-gradient), clipped first under a robust mean (`comm.robust`, before
        the weight and the error feedback); None: a mean of anything else."""
        started_at = time.perf_counter()
        codec = get_codec(codec)
        if origin is not None:
            buf = self._pseudo_gradient(buf, origin, extra, inplace, replay)
        if weight is not None:
            return weighted_mean(
                self,
                MeanHandle,
                buf,
                weight,
                purpose,
                codec=codec,
                async_op=async_op,
                inplace=inplace,
                extra=extra,
                mean_sq=mean_sq,
                collective=collective,
                residual=residual,
                replay=replay,
            )
        if residual is not None and codec.name != "fp32":  # buf's values are replaced by the mean anyway
            sending = buf if inplace else buf.detach().clone()
            sending.view(-1)[: buf.numel() - extra].add_(residual.view(-1))
            payload = self._prepare(sending, purpose, codec, extra, False)
            payload.dest, payload.residual = buf if inplace else None, residual
        else:
            payload = self._prepare(buf, purpose, codec, extra, inplace)
        payload.collective = self.lossy_collective(payload.codec, collective, buf.numel())
        sent = self._send(payload)
        if not replay:
            self._book(payload, sent)
        handle = MeanHandle(
            self.ledger,
            purpose,
            sent.work,
            lambda: self._finish(payload, sent, handle, mean_sq),
            sent.wire_bytes,
            payload.values_bytes,
            sent.started_at or started_at,
            blocked=sent.blocked,
        )
        handle.participants, handle._advance = sent.participants, sent.advance
        if not async_op or sent.blocked:
            handle.wait()
        return handle

    def _pseudo_gradient(
        self, buf: torch.Tensor, origin: torch.Tensor | float, extra: int, inplace: bool, replay: bool
    ) -> torch.Tensor:
        """This worker's contribution to a mean of pseudo-gradients as it is sent: multiplied by an
        injected fault's factor (tests), then clipped by the robust mean, whose clips the listeners
        hear (not again for an exchange replayed after a resume)."""
        factor = self.fault() if self.fault is not None else 1.0
        if factor != 1.0:
            buf = scale_contribution(buf, origin, factor, extra, inplace)
        if self.robust is None:
            return buf
        buf, clips = self.robust.clip(
            buf, origin, extra, inplace, worker=self.position, whole_norm=self.worker_norm, gather=self._gather_norms
        )
        if clips and not replay:
            for fn in self.on_clip:
                fn(clips)
        return buf

    def _gather_norms(self, norm: float) -> list[tuple[int, float]]:
        """Every contributing worker's (number, norm): one blocking all-gather of a float64 over the
        group, in worker order; under fault tolerance over the quorum's members, each with its number
        and its flag (a worker healed in this slot sends its source's values: its norm takes no part,
        NaN). Booked as `robust_norms`."""
        started = time.perf_counter()
        if self.quorum is not None:
            mine = torch.tensor([norm, float(self.quorum.worker)], dtype=torch.float64).view(torch.uint8)
            rows = self.quorum.gather(torch.cat([mine, torch.ones(1, dtype=torch.uint8)]))
            pairs = [
                (int(v[1]), float(v[0]) if int(r[-1]) else math.nan)
                for r in rows
                for v in [r[:16].clone().view(torch.float64)]
            ]
            sent = len(mine) + 1
        else:
            gathered, work = all_gather_rows(torch.tensor([norm], dtype=torch.float64), self.group, self.world_size)
            if work is not None:
                work.wait()
            pairs, sent = [(m, float(r)) for m, r in enumerate(gathered)], 8
        self.ledger.count(ROBUST_NORMS, sent, sent=sent * (len(pairs) - 1))
        self.ledger.waited(ROBUST_NORMS, time.perf_counter() - started)
        return pairs

    def lossy_collective(self, codec: Codec, choice: str = "auto", numel: int = 0) -> str:
        """How a lossy codec's mean of `numel` values travels over this exchange's workers
        (`lossy_path`): `auto` times both paths on the emulated link, when there is one (every
        rank of the group has the same link and buffer size, so all pick the same path)."""
        emulator = emulator_of(self.broadcast_group) if self.quorum is None else None
        return lossy_path(
            codec,
            choice,
            self.world_size,
            numel,
            emulator.topology if emulator else None,
            self.replicas.ranks_per_worker,
            shards=self.replicas.shards,
        )

    def _prepare(self, buf: torch.Tensor, purpose: str, codec: Codec, extra: int, inplace: bool) -> Payload:
        """The payload, with the guard's verdict on its values: NonFiniteError before a NaN/Inf
        leaves this worker under "abort", a zero weight under "skip"."""
        if extra and (buf.dim() != 1 or not 0 < extra <= buf.numel()):
            raise ValueError(f"extra={extra} needs a 1-D buffer of at least that many elements")
        values = buf[: buf.numel() - extra] if extra else buf
        guarded = self.nonfinite is not None and purpose in GUARDED
        valid = not guarded or all_finite(values)
        if guarded and self.nonfinite == "skip" and self.replicas.shards:  # the worker's shards alike
            valid = self.worker_sum([0.0 if valid else 1.0], "nonfinite_guard")[0] == 0.0
        if not valid and self.nonfinite == "abort":
            raise NonFiniteError(
                f"non-finite values in this worker's {purpose} before the exchange " f"(--on-nonfinite abort)"
            )
        return Payload(
            buf, purpose, codec, extra, buf if inplace else None, valid, guarded and self.nonfinite == "skip"
        )

    def _send(self, payload: Payload) -> Sent:
        """This rank's part (its shard between replica groups) through the quorum when there is one,
        else through the codec's collective over the group."""
        if self.replicas.shards and payload.purpose in REPLICATED:  # every rank's own values
            if self.quorum is not None:  # the worker's mean, then the workers'
                return self._quorum_mean(self.worker.mean(payload))
            return self._all_reduce(payload, None, dist.get_world_size())
        part = self.worker.shard(payload) if self.worker.splits(payload) else payload
        if self.quorum is not None and is_sparse(part.codec):  # every payload, flagged
            return sparse_mean(
                dataclasses.replace(part, weighted=True),
                None,
                self.quorum.participants or 1,
                gather=lambda wire: (self.quorum.gather(wire), None),
                blocked=True,
            )
        if self.quorum is not None:
            return self._quorum_mean(part)
        if part.codec.name == "fp32":
            return self._all_reduce(part)
        if is_sparse(part.codec):
            return sparse_mean(part, self.group, self.world_size)
        if part.collective == "allgather":
            return all_gather_mean(part, self.group, self.world_size)
        return reduce_scatter_mean(part, self.group, self.world_size, self.ledger)

    def _book(self, payload: Payload, sent: Sent) -> None:
        """The ledger's bytes by purpose: the values (a sparse payload's by kind), the side band as
        telemetry (no call of its own), the guard's weight or flag, and a contribution the guard dropped."""
        self.ledger.count(payload.purpose, sent.wire_bytes, sent=sent.sent, parts=sent.parts)
        if sent.side_bytes:
            self.ledger.count("telemetry", sent.side_bytes, calls=0)
        if sent.guard_bytes:
            self.ledger.count("nonfinite_guard", sent.guard_bytes)
        if not payload.valid:
            self.ledger.dropped += 1

    def _finish(self, payload: Payload, sent: Sent, handle: MeanHandle, mean_sq: bool) -> torch.Tensor:
        """The mean once it has arrived: the worker's shards put back together, then checked."""
        result = sent.finish()
        if self.worker.splits(payload):
            result = self.worker.reassemble(result, payload)
        self._measure(
            handle,
            result,
            payload.buf,
            payload.extra,
            payload.purpose,
            mean_sq,
            "" if self.quorum is not None else SENT_NONFINITE,
        )
        return result

    def meet(self, t: int, final: bool = False) -> None:
        """Before the exchanges of step t (`final`: of the final synchronization), agree on who takes
        part. Nothing to agree on for a fixed group; under a quorum, the workers alive now, and a
        worker behind them heals from a peer here (it may come back at another step, even past its
        exchanges: `already_synced`). The time is a wait on the ledger (`quorum`): exposed communication."""
        if self.quorum is None:
            return
        t0 = time.perf_counter()
        self.quorum.slot(t, finishing=final)
        self.ledger.waited(QUORUM, time.perf_counter() - t0)

    @property
    def already_synced(self) -> bool:
        """Does this worker already hold the result of the current step's exchanges? Only when it
        healed from peers in their final synchronization: it must not make those exchanges again."""
        return self.quorum is not None and self.quorum.finishing

    @property
    def participants(self) -> int | None:
        """The workers in the last exchange's quorum (None for a fixed group: every worker)."""
        return None if self.quorum is None else self.quorum.participants

    def broadcast(self, buf: torch.Tensor, purpose: str = "init") -> None:
        """Overwrite `buf` in place with the group's first rank's values (blocking; with replica
        groups, every rank of every worker gets rank 0's)."""
        self.ledger.count(purpose, buf.numel() * buf.element_size())
        if self.quorum is not None:
            return  # no group across workers: theirs start from the same seed, a restarted one heals
        group = self.broadcast_group
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast(buf, src=src, group=group)

    def modelled_seconds(self, numel: int, codec: str | Codec = "fp32", collective: str = "auto") -> float | None:
        """The emulated link's duration of one `mean` of `numel` float32 values between this group's
        workers (`comm.mean_cost`; None when the group is not emulated). Under a quorum, its own
        mean's (`ft.quorum`)."""
        if self.quorum is not None:
            return self.quorum.modelled_seconds(numel, shards=self.replicas.shards)
        emulator = emulator_of(self.broadcast_group)
        if emulator is None:
            return None
        return mean_seconds(
            numel,
            codec,
            emulator.topology,
            self.world_size,
            self.replicas.ranks_per_worker,
            shards=self.replicas.shards,
            collective=self.lossy_collective(get_codec(codec), collective, numel),
        )

    @staticmethod
    def _measure(
        handle: MeanHandle,
        result: torch.Tensor,
        whole: torch.Tensor,
        extra: int,
        purpose: str,
        mean_sq: bool,
        why: str = "",
    ) -> None:
        """The mean's non-finite check (model state) and norm: its float64 square with `mean_sq`
        (finite only where every value is, unless a square overflows), else its float32 norm."""
        mean = result.reshape(-1)[: whole.numel() - extra] if extra else result
        if mean_sq:
            handle.mean_sq = exact_sq_norm(mean)
            if math.isfinite(handle.mean_sq) or purpose not in GUARDED or bool(torch.isfinite(mean).all()):
                return
            raise NonFiniteError(f"the mean of the workers' {purpose} is non-finite{why}")
        if purpose in GUARDED:
            handle.norm = finite_norm(mean)
            if handle.norm is None:
                raise NonFiniteError(f"the mean of the workers' {purpose} is non-finite{why}")

    # ---- the worker's own ranks (`comm.worker_shards`) -----------------------------------------
    def worker_sum(self, values: list[float], purpose: str = "telemetry") -> list[float]:
        """Per-shard scalars summed over the worker's ranks (`WorkerShards.sum`)."""
        return self.worker.sum(values, purpose)

    def worker_norm(self, norm: float) -> float:
        """The L2 norm of a worker's whole tensor from this rank's shard's (`WorkerShards.norm`)."""
        return self.worker.norm(norm)

    # ---- the three ways a payload travels --------------------------------------------------------
    def _quorum_mean(self, payload: Payload) -> Sent:
        """The weighted mean over the workers in the quorum (`ft.quorum`), done when it returns."""
        if payload.codec.name != "fp32":
            raise ConfigError(f"--fault-tolerant exchanges fp32 only, not codec {payload.codec.name}")
        mean, _ = self.quorum.mean(payload.buf, payload.valid)
        if payload.dest is not None:
            mean = payload.dest.copy_(mean)
        item = payload.buf.element_size()
        return Sent(
            None,
            lambda: mean,
            payload.values_bytes,
            payload.extra * item,
            0,
            blocked=True,
            participants=self.quorum.participants,
        )

    def _all_reduce(self, payload: Payload, group: Any = ..., size: int | None = None) -> Sent:
        """fp32: SUM all-reduce of the values divided by the world size, into the destination (or a
        new tensor); weighted, of the values and the weight, divided by the weights' sum after.
        Over the exchange's group, or `group` of `size` ranks (None: every rank)."""
        buf, purpose, weighted, valid, dest = (
            payload.buf,
            payload.purpose,
            payload.weighted,
            payload.valid,
            payload.dest,
        )
        group, size = (self.group, self.world_size) if group is ... else (group, size)
        if weighted:
            values = buf.detach().reshape(-1) if valid else buf.new_zeros(buf.numel())
            wire = torch.cat([values, values.new_ones(1) if valid else values.new_zeros(1)])
        else:
            wire = dest if dest is not None else torch.empty_like(buf)
            if wire is not buf or size != 1:
                torch.div(buf.detach(), size, out=wire)
        if not dist.is_initialized():
            work = None
        elif group is self.group:  # between the workers: flat or by sites (`SiteMean`)
            work = self.sites.sum(wire, purpose, self.ledger)
        else:
            work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group, async_op=True)

        def finish() -> torch.Tensor:
            if not weighted:
                return wire
            total = wire[:-1].view_as(buf)
            return (dest.copy_(total) if dest is not None else total).div_(contributors(float(wire[-1]), purpose))

        item = buf.element_size()
        sent = mean_collectives(buf.numel() - payload.extra, "fp32", "", size, payload.extra, weighted, item)[0].sent
        return Sent(
            work, finish, (buf.numel() - payload.extra) * item, payload.extra * item, item if weighted else 0, sent=sent
        )
