"""Asynchronous DiLoCo: learners on their own clocks, a syncer that merges whoever arrived.

`async_diloco` is DiLoCo (arXiv:2311.08105) with the lock step taken out, after Decoupled DiLoCo
(arXiv:2604.21428) and Asynchronous Local-SGD (Liu et al. 2024, arXiv:2401.09135). Each learner (a
worker) runs its H inner steps on its own clock from the version θ̃_b it last took, then::

    send  (θ_m or θ_m − θ̃_b through the codec, b, the steps and tokens of the round)  to the syncer
    take  the first version newer than b: at once if the syncer has one, else at its next merge
    θ_m ← θ̃_v

and goes on. With `sparse` what it sends is SparseLoCo's payload (arXiv:2508.15706, `sparseloco.py`) of
its pseudo-gradient Δ_m = θ̃_b − θ_m, error-fed: it keeps an error buffer e (zero at the start) and::

    e ← β·e + Δ_m;  send s = Q(TopK_chunk(e));  e ← e − s        (β: error_decay)

through the same `comm.sparse.SparseCodec` SparseLoCo's exchange uses; the syncer decodes s into the dense
pseudo-gradient it stands for and merges it as any contribution measured from its base.

No learner waits for another: a slow one's contribution arrives late and is merged
stale into whatever version is current then (`syncer.py`: quorum, grace window, token weighting, the
staleness bound; `staleness.py`: the staleness rule). A learner waits only when the syncer has
nothing newer than its own base, which is the merge its own contribution goes into; the profiler
books that wait as exposed communication.

The syncer is a role (`syncer_service.py`): threads of global rank 0's process, beside its learner,
reached over an admitted, sealed TCP connection per learner (`comm.p2p`), each message modelled on
the emulated link of its pair. Its θ̃, version history and outer state are its own; rank 0's
checkpoints hold them (`extra_state`), each learner's its own state, written without a barrier.

With every learner at one speed, a quorum of every learner (or an unbounded grace window) and
`staleness_rule none`, every merge takes every learner's fresh θ_m, and the run is lock-step DiLoCo
bit for bit (tested): the same exchange, the same outer Nesterov step, the same model. The sparse payload
at density 1, 32-bit values and β = 0 sends Δ_m whole, and trains the same model within rounding (tested).

`dynamic_h`: Dynamic Local Updates (Liu et al. 2024, Eq. 6), each learner's round H × its speed / the
fastest's after the first, speeds measured from the learners' own rounds (`_retime`). A learner started
into a running run (`JOIN_ENV`: a restart after it died) joins without a collective and takes the current
version from the syncer's welcome, and its step count (its data, under `wansync train`) goes on from the
steps its earlier lives sent.

Where it stands: one rank per learner (no `--inside`), no `--fault-tolerant` quorum, no `--adapt`,
no `--slow-policy` (a slow learner is what the syncer absorbs); each is refused in one line. A resumed
run (`load_extra_state`) restores the syncer on rank 0 and has every learner take its newest version. Under the command line's launcher a learner that dies
ends alone and the others finish (its figures reach rank 0's summary through `figures`, no collective),
or with `--max-restarts` the launcher starts it again into the run (`runner.launch`, `docs/async.md`).
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ..comm import p2p
from ..comm.codecs import get_codec
from ..comm.flat import FlatTensors
from ..comm.sparse import is_sparse
from ..errors import ConfigError, PeerError
from ..net import emulator_of
from ..trust.settings import current
from .base import Strategy, model_buffers, sync_tensors
from .catalog import AsyncDiLoCoOptions
from .options import sparse_codec
from .periodic import PeriodicTimetable
from .syncer import Settings, Syncer
from .syncer_service import SyncerService

JOIN_ENV = "WANSYNC_SYNCER_ADDRESS"  # set: this process joins a running run's syncer (HOST:PORT) ...
LEARNER_ENV = "WANSYNC_LEARNER"  # ... as this learner (0-based), e.g. a learner restarted after it died
ADDRESS_BYTES = 256  # the syncer's HOST:PORT, broadcast from rank 0 as a fixed-size byte tensor
SETTINGS = (
    "sync_every",
    "outer_lr",
    "outer_momentum",
    "merge_quorum",
    "grace",
    "max_staleness",
    "staleness_rule",
    "dn_period",
    "codec",
    "sparse",  # and the sparse payload's layout and error feedback: every learner sends the same kind
    "error_decay",
    "density",
    "topk",
    "chunk",
    "bits",
    "quant_range",
    "dct",
)


def joins_running_run() -> bool:
    """Is this process a learner started into a running run (`JOIN_ENV`)? Then it is a process group of
    its own (`runner.worker`): it meets no one, the syncer tells it where the run is."""
    return bool(os.environ.get(JOIN_ENV))


def learner_from_env() -> int:
    """The learner a joining process is (`LEARNER_ENV`), or a one-line ConfigError."""
    value = os.environ.get(LEARNER_ENV, "")
    if not value.isdigit():
        raise ConfigError(
            f"async_diloco: {JOIN_ENV} is set, so {LEARNER_ENV} must name the learner (0, 1, ...), got {value!r}"
        )
    return int(value)


def peer_timeout_s() -> float:
    """How long a learner waits for the syncer's answer: the process group's store timeout (the run's
    --peer-timeout), else torch's default for a group."""
    try:
        return float(getattr(dist.distributed_c10d._get_default_store(), "timeout").total_seconds())
    except (AttributeError, RuntimeError, ValueError):
        return float(dist.default_pg_timeout.total_seconds())


class AsyncTimetable(PeriodicTimetable):
    """A round every H steps, each ending in the learner's own exchange with the syncer: no collective
    between workers, so no step meets the others (`exchanges_at` is False)."""

    def exchanges_at(self, t: int) -> bool:
        return False

    def final_sync(self, t: int) -> bool:
        return True


class AsyncDiLoCo(Strategy):
    name = "async_diloco"
    Options = AsyncDiLoCoOptions
    Timetable = AsyncTimetable
    exchange_purpose = "pseudo_grads"
    lock_step = False  # the run's evaluations and gathers stay on this rank (`telemetry.run`)

    def __init__(self, model, optimizer, options=None, **kw):
        super().__init__(model, optimizer, options, **kw)
        if self.replicas.ranks_per_worker > 1 or self.replicas.shards:
            raise ConfigError(
                "async_diloco runs one rank per learner: workers of several ranks (--inside) are not supported"
            )
        if self.exchange.quorum is not None:
            raise ConfigError("async_diloco does not take a fault-tolerant quorum: its learners never wait for one")
        self.flat = FlatTensors(sync_tensors(self.module))
        self.shapes = [p.shape for p in self.module.parameters() if p.requires_grad]  # the flat's head
        self.codec = self.wire_codec(self.opts, self.shapes)
        self.lossless = self.codec.name == "fp32"
        self.sparse = is_sparse(self.codec)
        # e_m, the error buffer of the sparse payload (SparseLoCo's): over the trainable parameters
        self.error = torch.zeros(self.codec.layout.numel, device=self.flat.device) if self.sparse else None
        self.settings = {k: getattr(self.opts, k) for k in SETTINGS}
        self.settings["grace"] = "inf" if math.isinf(self.opts.grace) else self.opts.grace
        self.service: SyncerService | None = None
        self.wait_bound_s = peer_timeout_s()
        trust, emulator = current(), emulator_of(self.group)
        joining = os.environ.get(JOIN_ENV)
        if joins_running_run():  # a learner (re)started into a running run: no collective, the syncer tells it all
            self.learner = learner_from_env()
            address, ranks, world = joining, None, None
        else:
            self.learner = self.rank
            address, ranks, world = self._start(trust, emulator)
        self.trust, self.syncer_address = trust, address
        channel, welcome = self._hello(join=bool(joining))
        ranks, world = ranks or welcome["ranks"], world or int(welcome["world"])
        channel.link = p2p.LinkModel(emulator, ranks[self.learner], ranks[0], world)
        self.channel = channel
        self.learners = len(ranks)
        self.round_h = self.opts.sync_every  # a round's length (`dynamic_h`: by its speed)
        self.step_s = 0.0
        self.run_steps: int | None = None
        self.stopped = False
        self.finished = False
        self.run_summary: dict[str, Any] | None = None  # rank 0's, at the end: goodput, staleness, syncer idle
        self.learner_figures: dict[int, dict[str, float]] | None = None  # rank 0's, at the end (`figures`)
        # a restarted learner goes on counting (and, in `wansync train`, drawing its data) from the steps
        # its earlier lives sent; this life's contributions report its own (`computed`)
        self.t = int(welcome.get("computed", 0))
        self._take_welcome(welcome)

    def _hello(self, join: bool, resume: bool = False) -> tuple[p2p.Channel, dict[str, Any]]:
        """A connection to the syncer, admitted: (the channel, the syncer's welcome). `join`: this learner
        enters a running run; `resume`: every learner of a resumed run (the syncer's state restored)."""
        channel = p2p.Channel(
            p2p.connect(self.syncer_address, self.trust),
            p2p.key(self.trust),
            p2p.LinkModel(None, 0, 0, 1),
            "the syncer",
        )
        channel.send(
            {"kind": "hello", "learner": self.learner, "settings": self.settings, "join": join, "resume": resume}
        )
        welcome = channel.recv(self.wait_bound_s)
        if welcome["kind"] == "refused":
            channel.close()
            raise ConfigError(f"async_diloco: the syncer refused this learner: {welcome.get('why')}")
        return channel, welcome

    def _take_welcome(self, welcome: dict[str, Any]) -> None:
        """Start a round from the version the syncer's welcome gives (its values when the run has moved on,
        else the model every learner holds), at step `t`."""
        self.base = int(welcome["version"])  # the version this learner's round started from
        if "values" in welcome:
            self.flat.scatter(welcome["values"])
        self.base_value = None if self.lossless else self.flat.gather().float()  # θ̃_b, where the model is
        self.life_start = self.round_start = self.t  # the step this life, and its round, started at
        self.round_began = time.perf_counter()  # when it started: a round's steps over its time, its speed
        self.progress_base = int(welcome.get("merged_steps", 0)) // self.learners  # merged steps per learner

    @classmethod
    def wire_codec(cls, opts: Any, shapes: Any) -> Any:
        """The codec's dense payload, or with `sparse` SparseLoCo's of the trainable tensors (`sparse_codec`)."""
        return sparse_codec(opts, shapes, dct=opts.dct) if opts.sparse else get_codec(opts.codec)

    def _start(self, trust: Any, emulator: Any) -> tuple[str, list[int], int]:
        """A run's start, every learner together: the same initial model everywhere (a broadcast), the
        syncer started by rank 0, its address broadcast. (address, each learner's global rank, world)."""
        learners = self.world_size
        if self.opts.merge_quorum > learners:
            raise ConfigError(
                f"async_diloco: merge_quorum {self.opts.merge_quorum} is more than the {learners} learners of the run"
            )
        self.broadcast_initial_state()
        ranks = [dist.get_global_rank(self.group, i) if self.group is not None else i for i in range(learners)]
        world = dist.get_world_size()
        address = torch.zeros(ADDRESS_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            syncer = Syncer(
                sync_tensors(self.module),
                model_buffers(self.module),
                Settings(
                    learners=learners,
                    quorum=self.opts.merge_quorum,
                    grace_s=self.opts.grace,
                    max_staleness=self.opts.max_staleness,
                    rule=self.opts.staleness_rule,
                    outer_lr=self.opts.outer_lr,
                    outer_momentum=self.opts.outer_momentum,
                    dn_period=self.opts.dn_period,
                ),
            )
            self.service = SyncerService(
                syncer,
                trust=trust,
                host=os.environ.get("MASTER_ADDR") or "127.0.0.1",  # rank 0's host, as torchrun names it
                rank=ranks[0],
                ranks=ranks,
                world=world,
                emulator=emulator,
                settings=self.settings,
                codec=self.wire_codec(self.opts, self.shapes),  # its own: its threads decode with it
                log=lambda line: print(f"wansync: {line}", file=sys.stderr, flush=True),
                resume_wait_s=self.wait_bound_s,
            )
            raw = self.service.address.encode()
            address[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        dist.broadcast(address, src=ranks[0], group=self.group)
        return bytes(address[address != 0].tolist()).decode(), ranks, world

    # ---- the learner's loop ---------------------------------------------------------------------
    def continues(self, steps: int) -> bool:
        """Does the loop take another step? Until the syncer says the run's budget (learners × `steps`
        learner steps) is merged: a fast learner takes more than `steps`, a slow one fewer."""
        self.run_steps = steps
        return not self.stopped

    def schedule_step(self, step: int) -> int:
        """The run's progress: the learner steps merged into the version this learner took, per learner,
        plus its steps since (a fast learner's schedule does not run ahead of the run's)."""
        progress = self.progress_base + self.t - self.round_start
        return min(progress, self.run_steps) if self.run_steps is not None else progress

    def after_inner_step(self) -> None:
        if self.t - self.round_start >= self.round_h:
            self.round_boundary()

    def _retime(self, fastest_s: Any) -> None:
        """`dynamic_h`: the next round's length, H × this learner's speed / the fastest's (Liu et al.
        2024, Eq. 6, with speeds measured: its own last round's step time against the fastest the syncer
        has seen), at least one step."""
        if not self.opts.dynamic_h or not fastest_s or not self.step_s:
            return
        self.round_h = max(1, round(self.opts.sync_every * float(fastest_s) / self.step_s))

    def boundary(self) -> None:
        self._exchange(final=False)

    def finish(self) -> None:
        """The last contribution (the steps after the last round, possibly none) and the last version,
        the same on every learner; rank 0 then closes the syncer."""
        if self.finished:
            return
        self._exchange(final=True)
        self.finished = True
        if self.service is not None:
            self.service.wait_ended()
            for merge in self.service.drain():
                self.emit("merge", **merge)
            self.run_summary = self.service.summary()
            self.learner_figures = self.service.learner_figures()
            self.comm.count("versions", self.service.sent_bytes, calls=self.service.sent)  # the syncer's sends
            self.emit("syncer", **self.run_summary)
            self.service.close()
        self.channel.close()

    def _exchange(self, final: bool) -> None:
        steps = self.t - self.round_start
        if steps:
            self.step_s = (time.perf_counter() - self.round_began) / steps  # compute, data and padding: no wait
        message: dict[str, Any] = {
            "kind": "contribution",
            "base": self.base,
            "steps": steps,
            "tokens": steps,  # a round's tokens are its steps × the batch, the same on every learner
            "final": final,
            "run_steps": self.run_steps,
            "computed": self.t - self.life_start,  # this life's tokens: steps, as above
            "step_s": self.step_s,
        }
        if self.figures is not None:  # what its run averages over workers (`telemetry.run`), for rank 0's summary
            message["figures"] = self.figures()
        if steps:
            if self.lossless:
                message["values"] = self.flat.gather().cpu()
            elif self.sparse:
                message.update(self._sparse_payload())
            else:
                assert self.base_value is not None
                enc = self.codec.encode(self.flat.gather().float() - self.base_value)
                message["data"], message["numel"] = enc.data.cpu(), enc.numel
        began = time.perf_counter()
        self.channel.send(message)
        # its tensors, as the codec puts them on the wire
        sent = sum(v.numel() * v.element_size() for v in message.values() if isinstance(v, torch.Tensor))
        reply = self.channel.recv(self.wait_bound_s)
        waited = time.perf_counter() - began
        if self.channel.link.last is not None:  # the profiler's event: the contribution sent, the version awaited
            self.channel.link.last.waited = waited
        if reply["kind"] != "version":
            raise PeerError(f"async_diloco: the syncer answered {reply['kind']!r}: {reply.get('why', '')}")
        values = reply["values"]  # None: the version this learner holds already (the run's last reply)
        if values is not None:
            self.flat.scatter(values)
            if not self.lossless:
                self.base_value = values.to(self.flat.device, torch.float32)
        based, self.base, self.round_start = self.base, int(reply["version"]), self.t
        self._retime(reply.get("fastest_step_s"))
        self.round_began = time.perf_counter()
        self.stopped = self.stopped or bool(reply["stop"])
        self.progress_base = int(reply["merged_steps"]) // self.learners
        received = 0 if values is None else values.numel() * values.element_size()
        self.comm.count(self.exchange_purpose, sent)  # what it sent; the version it took is the syncer's to send
        self.comm.waited(self.exchange_purpose, waited)
        if reply["dropped"]:
            print(
                f"wansync: learner {self.learner}: its {steps} steps based on version {based} were dropped "
                f"(more than max_staleness {self.opts.max_staleness} versions old); it goes on from version {self.base}",
                file=sys.stderr,
                flush=True,
            )
        self.emit(
            "sync",
            kind="async",
            version=self.base,
            based_on=based,
            behind=max(0, self.base - based - 1),  # versions merged while it trained, its own merge aside
            dropped=bool(reply["dropped"]),
            final=final,
            bytes=sent,
            received_bytes=received,
            waited_s=round(waited, 6),
            codec=self.codec.name,
            **({"kept": self.codec.kept} if self.sparse else {}),
        )
        if self.service is not None and not final:
            for merge in self.service.drain():
                self.emit("merge", **merge)

    def _sparse_payload(self) -> dict[str, torch.Tensor]:
        """SparseLoCo's send, against this round's base: e ← β·e + Δ_m (Δ_m = θ̃_b − θ_m), the payload of
        e's largest values per chunk (`comm.sparse`), e ← e − what the payload decodes to. The flat's tail,
        the float buffers (BatchNorm statistics), goes as it is, θ_m − θ̃_b in fp32: not a pseudo-gradient,
        it is averaged as every strategy averages it."""
        assert self.base_value is not None and self.error is not None
        delta = self.base_value - self.flat.gather().float()  # Δ_m
        n = self.codec.layout.numel
        sending = delta[:n].add_(self.error.mul_(self.opts.error_decay))  # β·e + Δ_m
        data = torch.empty(self.codec.wire_bytes(), dtype=torch.uint8, device=sending.device)
        self.codec.encode_into(sending, data, residual=self.error)  # e: what the payload did not carry
        return {"data": data.cpu(), "buffers": delta[n:].neg().cpu()}

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"outer_state": [self.error]} if self.error is not None else {}  # SparseLoCo's error buffer

    # ---- resumable state: the syncer's, on rank 0 ----------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {
            "base": self.base,
            "round_start": self.round_start,
            "life_start": self.life_start,  # a restarted learner's steps in its earlier lives
            "round_h": self.round_h,
            **({"error": self.error.detach().clone()} if self.error is not None else {}),
            **({"syncer": self.service.state_dict()} if self.service is not None else {}),
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """A resumed run (every learner restarted from its own checkpoint, `t` restored): rank 0 restores the
        syncer's state, then every learner enters it again and takes its newest version, as a learner
        restarted alone does; what a learner trained since its last exchange is not in its model any more
        (the steps stay counted). Load the model and optimizer first: the version replaces the model."""
        if self.service is not None:
            if "syncer" not in state:
                raise ConfigError("async_diloco: rank 0's checkpoint holds no syncer state: it cannot resume the run")
            self.service.load_state_dict(state["syncer"])
        if self.error is not None and "error" in state:
            self.error.copy_(state["error"])
        self.round_h = int(state.get("round_h", self.round_h))
        old = self.channel
        self.channel, welcome = self._hello(join=True, resume=True)
        self.channel.link = old.link
        old.close()
        self._take_welcome(welcome)
