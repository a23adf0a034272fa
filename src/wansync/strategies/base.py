"""The base class every synchronization strategy is built on.

It owns what all algorithms share: the inner step, the step counter, the event stream
(sync events become records in metrics.jsonl), the exchange of model state (`self.exchange`,
whose ledger is `self.comm`), and the resumable state. A concrete strategy supplies only what
differs: what it exchanges after the inner step (`after_inner_step`), which module the user calls
(`model`), and its extra state.

The user loop is always::

    loss = loss_fn(sync.model(batch)); loss.backward(); sync.step(); sync.zero_grad()

with gradient accumulation inside `with sync.no_sync():` (every micro-batch but the last), and a
resume through `state_dict()` / `load_state_dict()`, before or after the model's and optimizer's
own (`broadcast_initial_state`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Any, Callable, ClassVar, Iterator, cast

import torch
import torch.distributed as dist
from torch import nn

from ..comm.codecs import get_codec
from ..comm.exchange import Exchange
from ..comm.norms import exact_sq_norm
from ..comm.flat import FlatTensors
from ..comm.ledger import INSIDE
from ..comm.replicas import Replicas, replicas_of
from ..errors import ConfigError
from .grad_sync import GradientSync, ShardedGradientSync, fsdp_gradient_sync_paused, hybrid_sharded
from .options import Options, robust_of
from .pace import Pace
from .timetable import Timetable


def sync_tensors(module: nn.Module) -> list[torch.Tensor]:
    """What every exchange of model state carries: the trainable parameters plus floating-point
    persistent buffers (BatchNorm statistics), so that averaged replicas are really identical.
    Frozen parameters (`requires_grad` False, read when the strategy is built) are left out: no
    optimizer moves them, and the initial broadcast (`model_tensors`) made them identical. A
    parameter sharded inside the worker (FSDP2's DTensor) is its local shard: the tensor this rank
    holds, updates and exchanges with the same local rank of the other workers."""
    return [local_shard(p) for p in module.parameters() if p.requires_grad] + model_buffers(module)


def model_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter, frozen ones included, plus the floating-point persistent buffers: what the
    initial broadcast makes identical (as DDP's constructor does)."""
    return [local_shard(p) for p in module.parameters()] + model_buffers(module)


def model_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The floating-point persistent buffers (never sharded): averaged, but no optimizer steps them."""
    persistent = set(module.state_dict(keep_vars=True).keys())
    return [b for name, b in module.named_buffers() if name in persistent and b.is_floating_point()]


def value_fingerprint(flat: torch.Tensor) -> tuple[float, float]:
    """The sum and the squared norm of a flat buffer in float64: equal for the same values, and in
    practice for no others (a loaded checkpoint)."""
    return float(torch.sum(flat, dtype=torch.float64)), exact_sq_norm(flat)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's local tensor (the very tensor FSDP2 keeps, so
    writing into it writes the parameter), any other tensor itself. The same object every time
    (`to_local()` returns a new alias per call), so tensors can be told apart by identity."""
    return cast(torch.Tensor, getattr(t, "_local_tensor")) if is_dtensor(t) else t


def is_dtensor(t: Any) -> bool:
    """Is `t` a DTensor (FSDP2's sharded parameter)? Asked without importing torch.distributed.tensor,
    0.7 s of a process's start-up: no DTensor exists before that module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def check_model_and_optimizer(name: str, model: Any, optimizer: Any) -> None:
    """What a strategy is given, checked where it is first met: a module, and an optimizer built on that
    module's parameters (one built on another model would train it, not this one, in silence)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{name}: the model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"{name}: the optimizer must be a torch.optim.Optimizer built on the model's parameters "
            f"(e.g. torch.optim.AdamW(model.parameters())), got {type(optimizer).__name__} "
            f"{str(optimizer)[:40]!r}"
        )
    mine = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in mine)
    if foreign:
        raise ConfigError(
            f"{name}: the optimizer holds {foreign} tensor(s) that are not this model's parameters (built "
            f"on another model, or on a copy of this one?): build it on model.parameters()"
        )


class StepGuard:
    """The strategy's claim on its inner optimizer: a step taken by anything but the strategy's own
    (`GradScaler.step`, accelerate's prepared optimizer, `optimizer.step()` in the loop) would train
    without a single synchronization, silently; it is refused in one line the moment it happens. The
    newest strategy built on an optimizer holds its guard (a test, a rebuilt run)."""

    ATTRIBUTE = "_wansync_step_guard"

    def __init__(self, strategy: str, optimizer: torch.optim.Optimizer):
        self.strategy, self.stepping = strategy, False
        older = getattr(optimizer, self.ATTRIBUTE, None)
        if older is not None:
            older.handle.remove()
        self.handle = optimizer.register_step_pre_hook(self._before_step)
        setattr(optimizer, self.ATTRIBUTE, self)

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        self.stepping = True
        try:
            yield
        finally:
            self.stepping = False

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if all(float(group.get("lr", 1.0)) == 0.0 for group in optimizer.param_groups):
            return  # a step that moves nothing: torch.distributed.checkpoint takes one to make the state
        if not self.stepping:
            raise ConfigError(
                f"{self.strategy}: the inner optimizer was stepped outside sync.step() (a GradScaler's "
                "scaler.step, an optimizer accelerate prepared, or optimizer.step() in the loop): the strategy "
                "would never synchronize; call sync.step() (fp16 with a GradScaler is not supported: use bf16 autocast)"
            )


class Strategy:
    name: ClassVar[str] = ""
    Options: ClassVar[type[Options]] = Options
    Timetable: ClassVar[type[Timetable]] = Timetable  # when it communicates, from its options alone
    steps_inside_workers: ClassVar[bool] = True  # False: every step all-reduces over every rank (DDP)
    steps_optimizer: ClassVar[bool] = True  # False: its own update replaces the optimizer's (DeMo),
    # which only carries the learning rate and weight decay
    exchange_purpose: ClassVar[str] = "params"  # the ledger's purpose of its exchange between workers
    knobs: ClassVar[tuple[str, ...]] = ()  # what a tuner may turn between rounds (`retune`, --adapt)
    # False: its workers run on their own clocks and never meet mid-run (`async_diloco`): no collective
    # between them outside its own exchange (evaluations, checkpoints mid-run), no resume yet
    lock_step: ClassVar[bool] = True
    # set by a run (`telemetry.run`) of a strategy that is not lock-step: this rank's figures that the
    # run's summary averages over workers, which such a strategy carries to rank 0 with its own messages
    figures: Callable[[], dict[str, float]] | None = None

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        options: Any = None,
        *,
        group: Any = None,
        on_nonfinite: str | None = None,
        replicas: Replicas | None = None,
        quorum: Any = None,
        mesh: Any = None,
    ):
        """`on_nonfinite`: None, "abort" or "skip", what the exchange does with a NaN/Inf in this
        worker's model state (see `comm.exchange`). `replicas`: this rank's place in a worker of
        several ranks (`comm.replicas`; None: every rank is a worker); its ranks train one model
        with DDP over the worker's own group, and the exchange runs between workers; for a model the
        user sharded with FSDP2 it is found from the model's mesh (`mesh`: the 2-D one when it cannot
        be, `comm.replicas.replicas_of`). `quorum`: the exchange averages over the workers alive now
        instead of a fixed group (`ft.quorum`)."""
        if not dist.is_initialized():
            raise ConfigError(
                "torch.distributed is not initialized: call wansync.init() or "
                "torch.distributed.init_process_group() first"
            )
        check_model_and_optimizer(self.name, model, optimizer)
        self.module = model
        self.optimizer = optimizer
        self.opts = options if options is not None else self.Options()
        self.timetable = self.Timetable(self.opts)
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.t = 0  # inner steps taken
        self.last_inner_s = 0.0  # time of the last inner optimizer step (profiler: compute)
        self.since_last_step_s: float | None = None  # end of the previous step() to this one's start
        self._left_step_at: float | None = None
        self.replicas = replicas if replicas is not None else replicas_of(model, mesh) or Replicas()
        self.exchange = Exchange(group, on_nonfinite, self.replicas, quorum=quorum, robust=robust_of(self.opts))
        self.comm = self.exchange.ledger
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self.exchange.on_clip.append(self._clipped)
        # what the initial broadcast replaced on this rank, until the first step (`broadcast_initial_state`)
        self._replaced: list[tuple[FlatTensors, torch.Tensor, tuple[float, float]]] = []
        policy, between = getattr(self.opts, "slow_policy", "wait"), self.replicas.between_workers
        self.pace = Pace(
            policy,
            getattr(self.opts, "sync_every", 1),
            getattr(self.opts, "deadline", 0.0),
            self.replicas,
            worker=self.replicas.worker if between else self.rank,
            workers=self.replicas.workers if between else self.world_size,
            group=None if between else group,
        )
        self.tuner: Any = None  # turns `knobs` before each round (`trainer.adapt`; None: they stay)
        self.inside_sync = None
        if self.replicas.ddp_inside and self.steps_inside_workers:
            self.inside_sync = GradientSync(model, self.replicas.inside, self.comm, purpose=INSIDE + "grads")
        if self.replicas.shards and self.steps_inside_workers and hybrid_sharded(model):
            raise ConfigError(
                f"{self.name} takes local steps, but the model is sharded on a 2-D mesh (hybrid "
                f"sharding), which all-reduces gradients across workers at every step: shard it "
                f"on the worker's ranks only (fully_shard(..., mesh=mesh[<its second dimension>]))"
            )
        self._guard = StepGuard(self.name, optimizer)  # last: a strategy refused above leaves no hook

    # ---- the user's view -------------------------------------------------------------
    def warn_for_run(self, steps: int | None, stacklevel: int = 3) -> None:
        """The regime guards that need the run's length (`guards.NEEDS_STEPS`: `ws.strategy` warned of the
        rest), as `RegimeWarning`s in Python's words; `ws.Run(steps=)` and the Trainer call it."""
        import warnings

        from .guards import RegimeWarning, regime_warnings

        for line in regime_warnings(self.name, dataclasses.asdict(self.opts), steps, python=True, only_steps=True):
            warnings.warn(line, RegimeWarning, stacklevel=stacklevel)

    @property
    def model(self) -> nn.Module:
        """The module to call forward on (a DDP wrapper for gradient-synchronizing strategies, and
        inside a worker of several ranks)."""
        return self.inside_sync.ddp if self.inside_sync is not None and self.inside_step(self.t + 1) else self.module

    def inside_step(self, t: int) -> bool:
        """Does step t (1-based) all-reduce gradients inside the worker only? (Not when the
        strategy all-reduces them over every rank then.)"""
        return self.timetable.inside_step(t)

    def step(self, skip_inner: bool = False, idle: bool = False) -> None:
        """Inner optimizer step, then whatever synchronization is due at the new step count.

        `skip_inner` drops this worker's inner update (a non-finite gradient under
        `--on-nonfinite skip`) while keeping the schedule, so every rank issues the same
        collectives. `idle`: this worker sat the step out (no forward, no backward: its slow policy
        said so, `computes_next`); the exchanges due are made all the same. Records the time spent
        outside `step()` since the previous one (forward, backward, data: `since_last_step_s`, None
        on the first) and in the inner step."""
        entered = time.perf_counter()
        self._replaced = []  # training has begun: the initial broadcast stands
        if self._left_step_at is not None:
            self.since_last_step_s = entered - self._left_step_at
        self.inner_step(skip_inner or idle)
        self.last_inner_s = time.perf_counter() - entered
        if self.inside_sync is not None and self.inside_step(self.t + 1) and not idle:
            self.inside_sync.book()
        self.t += 1
        if self.exchanges_at(self.t):
            self.exchange.meet(self.t)  # who takes part; a worker behind may heal here
        took = None if self.since_last_step_s is None else self.since_last_step_s + self.last_inner_s
        self.sync_due()
        self.pace.after_step(self.t, not (skip_inner or idle), took)

    def continues(self, steps: int) -> bool:
        """Does a run of `steps` steps take another? Until this rank has taken them (an asynchronous
        strategy's learners go on until the run's budget is merged: `async_diloco.py`)."""
        return self.t < steps

    def schedule_step(self, step: int) -> int:
        """Where step `step` stands in the run's learning-rate schedule: the step itself (an
        asynchronous learner's is the run's progress, merged by every learner: `async_diloco.py`)."""
        return step

    def computes_next(self) -> bool:
        """Does this worker compute the next step, or sit it out (`step(idle=True)`)? Always, unless a
        slow policy (`slow_policy` deadline or balanced, `strategies.pace`) says otherwise::

            if sync.computes_next():
                loss_fn(sync.model(batch)).backward()
                sync.step()
            else:
                sync.step(idle=True)
        """
        return self.pace.computes(self.t + 1)

    def sync_due(self) -> None:
        """The synchronization due at step `self.t`, after its inner step: none when this worker
        already holds its result (it healed from peers who had made it, `Exchange.already_synced`).
        Public for a worker that comes into a run at the others' step (`ft.member`)."""
        if not self.exchange.already_synced:
            self.after_inner_step()
        self._left_step_at = time.perf_counter()

    def exchanges_at(self, t: int) -> bool:
        """Does step t (after its inner step) exchange between workers? The exchange meets there
        (`Exchange.meet`: under a quorum, the workers agree on who takes part)."""
        return self.timetable.exchanges_at(t)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: the forward and backward of every micro-batch but the last run
        inside, without communication; the last one's, outside, all-reduces the accumulated
        gradients when the strategy's next step does, then `step()`::

            with sync.no_sync():
                for mb in micro_batches[:-1]:
                    loss_fn(sync.model(mb)).backward()
            loss_fn(sync.model(micro_batches[-1])).backward()
            sync.step()

        Whatever `sync.model` is: DDP's `no_sync()` on every DDP wrapper the strategy holds (its
        gradient phase, a worker's own DDP), FSDP2's `set_requires_gradient_sync(False)` on a
        sharded model (restored to True, FSDP's default, on leaving), nothing on a plain module (a
        periodic strategy's local step communicates nothing). Without it every micro-batch's
        backward all-reduces, which the ledger counts (`GradientSync.book`)."""
        phases = [p for p in (self.inside_sync, getattr(self, "grad_sync", None)) if p is not None]
        with contextlib.ExitStack() as paused:
            for phase in phases:
                paused.enter_context(phase.paused())
            if self.replicas.shards and not any(isinstance(p, ShardedGradientSync) for p in phases):
                paused.enter_context(fsdp_gradient_sync_paused(self.module))  # FSDP's reduce-scatter inside
            yield

    def finish(self) -> None:
        """Bring every rank to the same final parameters (a last sync if one is due)."""

    @classmethod
    def wire_codec(cls, opts: Any, shapes: Any) -> Any:
        """What this strategy's exchanges of model state send, from its options and its tensors'
        shapes: the options' codec (`comm.codecs`), or a sparse payload's (`comm.sparse`); the
        planner books the same."""
        return get_codec(getattr(opts, "codec", "fp32"))

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The state it holds beyond the anchors, by memory category (`telemetry.memory`)."""
        return {}

    # ---- for subclasses ----------------------------------------------------------------
    def inner_step(self, skip: bool) -> None:
        """The inner optimizer's step (none when this worker's update is dropped, `skip`)."""
        if not skip:
            with self._guard.inside():
                self.optimizer.step()

    def after_inner_step(self) -> None:
        """Synchronize if step `self.t` calls for it."""

    @property
    def inner_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def tensors_movable(self) -> bool:
        """May the model's tensors be re-pointed into a flat buffer of ours (`FlatTensors.adopt`,
        as torch's averager does)? Not when FSDP holds them sharded inside the worker: it
        all-gathers from the storage it allocated, so values are copied in instead."""
        return not self.replicas.shards

    def broadcast_initial_state(self) -> None:
        """Start every replica from rank 0's parameters and buffers (one flat broadcast per dtype;
        frozen parameters too).

        The broadcast is for an identical start; it must not overwrite a restored run. A rank whose
        values it changed keeps them, with a fingerprint of what it wrote, until its first `step()`:
        `load_state_dict` before then (a resume) puts them back if the model still holds what the
        broadcast wrote (the user restored model and optimizer *before* building the strategy; had
        they loaded the model after, it no longer does). So restoring before or after `ws.strategy()`
        gives the same run; a fresh run's first step drops them. Nothing is kept where the broadcast
        changed nothing (every rank seeded alike, or a restore at a synchronization)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in model_tensors(self.module):
            by_dtype.setdefault(t.dtype, []).append(t)
        for tensors in by_dtype.values():
            flat = FlatTensors(tensors)
            buf = flat.gather()
            mine = buf.clone()
            self.exchange.broadcast(buf)
            if not torch.equal(mine, buf):
                self._replaced.append((flat, mine, value_fingerprint(buf)))
            flat.scatter(buf)

    def _restore_replaced(self) -> None:
        """This rank's own values back where the initial broadcast replaced them and nothing wrote
        since (see `broadcast_initial_state`)."""
        for flat, mine, written in self._replaced:
            if value_fingerprint(flat.gather()) == written:
                flat.scatter(mine)
        self._replaced = []

    # ---- events --------------------------------------------------------------------------
    def on_event(self, fn: Callable[[dict[str, Any]], None]) -> None:
        self._listeners.append(fn)

    def _clipped(self, clips: list[Any]) -> None:
        """The robust mean clipped these workers' pseudo-gradients (`comm.robust.Clip`): an event each."""
        for clip in clips:
            self.emit("robust_clip", **dataclasses.asdict(clip))

    def emit(self, record_type: str, /, **fields: Any) -> None:
        record = {"type": record_type, "step": self.t, "strategy": self.name, **fields}
        if record_type == "sync" and self.exchange.participants is not None:  # fewer than every worker?
            record.setdefault("participants", self.exchange.participants)
        for fn in self._listeners:
            fn(record)

    # ---- resumable state -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The strategy's resumable state, with this rank's communication counters (`comm`): a loop
        that saves it beside the model's and optimizer's resumes with nothing else to restore."""
        return {
            "t": self.t,
            "options": dataclasses.asdict(self.opts),
            **self.extra_state(),
            "comm": self.comm.snapshot(),
            **({"pace": self.pace.state_dict()} if self.pace.active else {}),
            **({"tuner": self.tuner.state_dict()} if self.tuner is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`, before or after loading the model and optimizer (see
        `broadcast_initial_state`); the counters continue from the state's (a state without them,
        a peer's heal state, leaves them as they are)."""
        self._restore_replaced()
        self.t = int(state["t"])
        self.pace.load_state_dict(state.get("pace"))
        self.load_extra_state(state)
        if "comm" in state:
            self.comm.restore(state["comm"])
        if self.tuner is not None and "tuner" in state:
            self.tuner.load_state_dict(state["tuner"])

    def heal_state(self) -> dict[str, Any]:
        """What a worker healing from this one receives (fault-tolerant runs): the resumable state,
        without the counters (the healed worker keeps its own)."""
        return {k: v for k, v in self.state_dict().items() if k != "comm"}

    def load_heal_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state)

    def extra_state(self) -> dict[str, Any]:
        return {}

    # ---- rounds whose knobs change (`--adapt`) ------------------------------------------------
    def round_boundary(self) -> None:
        """A round's end: the tuner, if any, turns the knobs for the exchange about to run (from what
        every rank agreed), then the boundary, then the tuner shares what this rank saw of it."""
        if self.tuner is not None:
            self.tuner.before_round(self)
        self.boundary()
        if self.tuner is not None:
            self.tuner.after_round(self)

    def boundary(self) -> None:
        raise NotImplementedError(f"{self.name} has no rounds")

    def retune(self, **knobs: Any) -> None:
        """Turn `knobs` (names from `knobs`) at a boundary, before its exchange: every rank alike."""
        unknown = sorted(set(knobs) - set(self.knobs))
        if unknown:
            raise ConfigError(
                f"{self.name} has no knob {', '.join(unknown)} to turn"
                + (f" (it has {', '.join(self.knobs)})" if self.knobs else "")
            )
        if "sync_every" in knobs and knobs["sync_every"] != self.opts.sync_every:
            self.timetable.retime(self.t, int(knobs["sync_every"]))
        self.retune_exchange({k: v for k, v in knobs.items() if k != "sync_every"})

    def retune_exchange(self, knobs: dict[str, Any]) -> None:
        """What the exchange sends from the next one on (the codec, a sparse payload's density)."""

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass
