"""One rank's training loop: workload + strategy + profiler + evaluation + run files.

A worker is `ranks_per_worker` ranks (`comm.replicas`): each trains on its slice of the worker's
batch under DDP inside the worker, and the strategy exchanges between workers. Evaluation runs
on every rank (the same held-out batches) and reports the mean over workers of each worker's
*local* model; after the last step `sync.finish()` brings all ranks to the same parameters, so
the final numbers describe the one model every worker holds.
"""

from __future__ import annotations

import warnings
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..rundir import checkpoint, files
from .. import strategies
from ..ft.member import Member, quorum_for
from ..comm.mean_cost import lossy_path, mean_seconds
from ..comm.replicas import Replicas, place, replica_groups
from ..comm.sparse import is_sparse
from ..config import Config, fingerprint
from ..rundir.divergence import chance_level
from ..errors import ConfigError, NonFiniteError
from .adapt import Tuner, parse_adapt
from .faults import Faults
from ..net import exchange_seconds
from .optim import build_optimizer, lr_at, peak_lr, set_lr
from .sharding import autocast, shard_worker
from ..strategies.async_diloco import joins_running_run
from ..rundir.layout import SYNCER_ADDRESS_FILE
from ..strategies.base import local_shard, sync_tensors
from ..rundir.target import given_target, target_record
from ..telemetry.run import Run
from ..workloads import build_workload


def describe(facts: dict[str, Any]) -> str:
    """A one-line summary of a workload's describe() dict."""
    parts = [
        f"{facts.get('model', '?')} ({facts.get('params', 0) / 1e6:.2f}M params)",
        f"data {facts.get('data', facts.get('dataset', '?'))}",
    ]
    for key in ("train_tokens", "train_size", "windows_per_rank", "shard_size", "batch_size", "seq_len"):
        if key in facts:
            parts.append(f"{key} {facts[key]}")
    return ", ".join(parts)


@dataclass
class Phase:
    """What the worker is doing now, for its one-line failure message ("failed during step 12"), and
    the part of a step the stall watchdog bounds (`trainer.stall`): `part` is (data or compute, the
    step, when it began on time.monotonic(), whether it is this process's first step), None elsewhere."""

    now: str = "start-up"
    part: tuple[str, int, float, bool] | None = None

    def begin(self, part: str, step: int, first: bool = False) -> None:
        """`part` of `step` begins now: one assignment, so the watchdog's thread reads it whole."""
        self.part = (part, step, time.monotonic(), first)

    def end(self) -> None:
        """Out of the parts the watchdog bounds (the exchange, evaluation, checkpoints)."""
        self.part = None


class Trainer:
    def __init__(
        self, cfg: Config, run_dir: Path, rank: int, world_size: int, resume: bool = False, phase: Phase | None = None
    ):
        self.cfg, self.run_dir, self.rank, self.world = cfg, Path(run_dir), rank, world_size
        self.phase = phase if phase is not None else Phase()
        self.device_type = "cuda" if cfg.backend == "nccl" else "cpu"
        sharded = cfg.inside == "fsdp"
        self.replicas = (
            ft_replicas(cfg.ranks_per_worker, rank, world_size, sharded, self.device_type)
            if cfg.fault_tolerant or joins_running_run()
            else replica_groups(cfg.ranks_per_worker, shard_inside=sharded, device_type=self.device_type)
        )
        torch.manual_seed(cfg.seed)  # same init on every rank
        self.workload = build_workload(
            cfg, self.replicas.worker, self.replicas.workers, self.replicas.local_rank, self.replicas.ranks_per_worker
        )
        if cfg.backend == "nccl":  # one rank per GPU (worker.init_distributed chose it)
            self.workload.model.to(torch.device("cuda", torch.cuda.current_device()))
        if sharded:  # FSDP2 over the worker's ranks (trainer.sharding)
            shard_worker(
                self.workload.model,
                self.replicas.mesh,
                cfg.precision,
                hybrid=not strategies.strategy_class(cfg.strategy).steps_inside_workers,
            )
        self.optimizer = build_optimizer(cfg, self.workload.model)
        self.options = strategies.resolve_options(cfg.strategy, vars(cfg))
        link = link_cost(cfg, self.workload.model, self.options, world_size)  # before the first collective
        quorum = quorum_for(cfg, rank, world_size) if cfg.fault_tolerant else None
        self.sync = strategies.build(
            cfg.strategy,
            self.workload.model,
            self.optimizer,
            on_nonfinite=cfg.on_nonfinite,
            replicas=self.replicas,
            quorum=quorum,
            **self.options,
        )
        service = getattr(self.sync, "service", None)  # an asynchronous run's syncer, in this process
        if service is not None:  # where the launcher sends a learner it restarts (`runner.launch`)
            files.write_text(self.run_dir / "logs" / SYNCER_ADDRESS_FILE, service.address + "\n")
        spec = parse_adapt(cfg.adapt, cfg.strategy, self.options)
        if spec is not None:  # before a resume loads the tuner's state
            self.sync.tuner = Tuner(
                spec,
                self.sync,
                cfg.topology,
                lambda: self.run_files.step_times,
                inside=cfg.inside,
                say=lambda line: self.run_files.print(line),
            )
        self.fault = Faults.from_env()
        if (fault := self.fault) is not None:  # `scale`: strikes this rank's pseudo-gradient in the exchange
            self.sync.exchange.fault = lambda: fault.pseudo_gradient_scale(self.rank, self.sync.t)
            if quorum is not None:  # `flip_heal`: payloads this rank's heal server corrupts on the way
                quorum.transport.corrupt_next = fault.heal_flips(self.rank)
        self.slowdown = cfg.topology.slowdown(self.replicas.worker) if cfg.topology is not None else 1.0
        self.last_loss = math.nan  # an idle step's record repeats the last computed loss
        self.first_step = 0  # the first step this process trains (`run`)
        self.member = (
            None
            if quorum is None
            else Member(
                quorum,
                rank,
                self.replicas.workers,
                self.run_dir / "logs",
                self.workload.model,
                self.optimizer,
                self.sync,
                self.fault,
                skip_to=self.workload.skip_to,
            )
        )
        resumed = self.load_checkpoint() if resume else None
        if self.sync.t and resumed is None and self.member is None:  # an asynchronous learner restarted
            self.workload.skip_to(self.sync.t)  # into its run: its data goes on where its last life's ended
        restarted = (self.member is not None and self.member.restarted) or joins_running_run()  # appends to its run
        # the profiler, DDP's timing, metrics.jsonl, the run files, TensorBoard and the progress line:
        # the same `Run` a user's own loop opens (telemetry.run)
        self.run_files = Run(
            self.sync,
            self.run_dir,
            steps=cfg.steps,
            tensorboard=cfg.tensorboard,
            info=self.summary_info(),
            chance=chance_level(self.workload.describe()),
            wan=cfg.wan or None,
            unit="tok/s" if self.workload.kind == "lm" else "img/s",
            log_every=cfg.log_every,
            quiet=cfg.quiet,
            append=resume or restarted,
            rank=rank,
            world=world_size,
            _claimed=True,  # `train` claimed the directory before any worker started (`runner.run`)
        )
        if link is not None:
            self.run_files.print(link)
        if self.sync.tuner is not None:
            self.run_files.link = self.sync.tuner.watch  # one watch of the link: the timeline reads the tuner's
        if resumed is not None:
            self.run_files.load_state_dict(resumed)

    def summary_info(self) -> dict[str, Any]:
        """What summary.json says of the run beyond what its `Run` measures."""
        cfg = self.cfg
        return {
            "inside": cfg.inside,
            "precision": cfg.precision,
            "model": cfg.model,
            "data": cfg.data,
            "seed": cfg.seed,
            "options": self.options,
            "lr_scaling": cfg.lr_scaling,
            "peak_lr": peak_lr(cfg, self.world),
        }

    # ---- one step ----------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, Any]:
        """One step; the run (`self.run_files`) times it through its hooks on the model's forward
        and on `sync.step()`, and writes its record. A step the worker's slow policy has it sit out
        (`Strategy.computes_next`) is an idle one: no batch, no forward, the exchanges due made."""
        cfg, sync = self.cfg, self.sync
        lr = lr_at(cfg, sync.schedule_step(step), self.world)
        set_lr(self.optimizer, lr)
        if not sync.computes_next():
            self.phase.now = f"step {step + 1} (synchronization)"
            sync.step(idle=True)
            return self.run_files.log(self.last_loss, lr=lr, idle=True)
        began, first = time.perf_counter(), step == self.first_step
        self.phase.begin("data", step + 1, first)
        batch = self.workload.next_batch()
        self.phase.begin("compute", step + 1, first)
        with autocast(cfg.precision, self.replicas.shards, self.device_type):
            loss = self.workload.loss(sync.model, batch)
        loss.backward()
        self.emulate_speed(began)
        if self.fault is not None:
            self.fault.after_backward(self.rank, step + 1, self.workload.model)
        loss_value = self.last_loss = float(loss.detach())
        skip = self.nonfinite_guard(loss_value, self.grad_norm(), step + 1)
        self.phase.now = f"step {step + 1} (synchronization)"
        self.phase.end()  # the exchange: its collectives time out by themselves
        sync.step(skip_inner=skip)
        sync.zero_grad()
        return self.run_files.log(loss_value, self.workload.batch_size_items(batch), lr=lr, skipped=skip)

    def emulate_speed(self, began: float) -> None:
        """An emulated run's compute speed (the topology's `speeds`, `net.topology`): the step padded to
        the topology's step time for this worker when it gives one, else this worker's own forward and
        backward stretched by its slowdown (sharing cores, the workers' own times vary with what the
        others do: a step time keeps their ratio). Booked as compute, as the work it stands for."""
        topology = self.cfg.topology
        if topology is None:
            return
        elapsed = time.perf_counter() - began
        target = topology.emulated_step_s(self.replicas.worker)
        if target:
            time.sleep(max(0.0, target - elapsed))
        elif self.slowdown > 1:
            time.sleep((self.slowdown - 1) * elapsed)

    def grad_norm(self) -> float:
        """Total local gradient norm (clipping it when --grad-clip is set)."""
        params = [p for p in self.workload.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        if self.cfg.grad_clip > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip))
        return float(torch.nn.utils.get_total_norm([p.grad for p in params]))

    def nonfinite_guard(self, loss: float, grad_norm: float, step: int) -> bool:
        """True to skip this worker's inner update; raises under --on-nonfinite abort."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return False
        what = "loss" if not math.isfinite(loss) else "gradient"
        if self.cfg.on_nonfinite == "abort":
            raise NonFiniteError(
                f"non-finite {what} on rank {self.rank} at step {step} "
                f"(--on-nonfinite abort; 'skip' drops such updates)"
            )
        self.optimizer.zero_grad(set_to_none=True)
        return True

    # ---- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> None:
        self.phase.now = f"checkpoint at step {step}"
        sharded = self.replicas.shards  # model and optimizer: the worker's DCP checkpoint
        digests = (
            checkpoint.save_sharded(
                self.run_dir, step, self.replicas.worker, self.workload.model, self.optimizer, self.replicas.inside
            )
            if sharded
            else None
        )
        state = {
            "step": step,
            "world_size": self.world,
            "rank": self.rank,
            "inside": self.cfg.inside,
            "model": None if sharded else self.workload.model.state_dict(),
            "optimizer": None if sharded else self.optimizer.state_dict(),
            "strategy": self.sync.state_dict(),
            "workload": self.workload.state_dict(),
            "rng": torch.get_rng_state(),
            "comm": self.sync.comm.snapshot(),
            **self.run_files.state_dict(),
        }  # evals, sync_events, skipped, profile, exposed_inside_s
        checkpoint.save_rank(
            self.run_dir, step, self.rank, state, config=fingerprint(self.cfg, self.options), sharded=digests
        )
        if self.sync.lock_step:  # asynchronous learners never meet: one that died must not hold the others
            dist.barrier()  # every rank's file is durable: the checkpoint is complete
        if self.fault is not None:
            self.fault.after_checkpoint(self.rank, step)
        first_on_host = os.environ.get("LOCAL_RANK", str(self.rank)) == "0"  # each host prunes its own files
        if first_on_host and not self.sync.lock_step:  # asynchronous learners save their steps when they reach them
            checkpoint.prune_unmarked(self.run_dir)
        elif first_on_host and self.member is None:  # fault-tolerant: no barrier, so nothing is pruned
            checkpoint.prune(self.run_dir, step)
        self.run_files.lap("checkpoint")

    def load_checkpoint(self) -> dict[str, Any]:
        step_dir, passed = checkpoint.resume_dir(self.run_dir, self.rank, lowest_over_ranks)
        for why in passed:  # a damaged newer checkpoint: one line each
            print(f"wansync: rank {self.rank}: {why}; resuming from {step_dir.name}", file=sys.stderr, flush=True)
        state = checkpoint.load_rank(self.run_dir, self.rank, self.world, step_dir)
        if self.replicas.shards:
            checkpoint.load_sharded(
                self.run_dir, self.replicas.worker, self.workload.model, self.optimizer, self.replicas.inside, step_dir
            )
        else:
            self.workload.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.sync.load_state_dict(state["strategy"])
        self.workload.load_state_dict(state["workload"])
        torch.set_rng_state(state["rng"])
        self.sync.comm.restore(state["comm"])
        if self.rank == 0:  # an asynchronous learner's final checkpoint is the run's step, after its own count
            truncate_metrics(self.run_dir / "metrics.jsonl", max(int(state["step"]), self.sync.t))
        return state

    @property
    def epochs_evaluated(self) -> int:
        """Whole epochs already covered by an evaluation (every epoch end is evaluated)."""
        return max((int(e.get("epoch", 0)) for e in self.run_files.evals), default=0)

    def evaluate(self, step: int) -> dict[str, Any]:
        """Every rank evaluates its own model; the run keeps (and prints) the mean over ranks."""
        with autocast(self.cfg.precision, self.replicas.shards, self.device_type):
            metrics = self.workload.evaluate(self.workload.model)
        record = self.run_files.evaluate(metrics, step=step, epoch=self.workload.epoch_progress())
        bad = sorted(k for k in metrics if not math.isfinite(record[k]))
        if bad and self.cfg.on_nonfinite == "abort":
            raise NonFiniteError(
                f"the model diverged: {', '.join(bad)} is non-finite at step {step} "
                f"(--on-nonfinite abort; lower the learning rates)"
            )
        return record

    # ---- the run ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any] | None:
        cfg, run = self.cfg, self.run_files
        r = self.replicas.ranks_per_worker
        ranks = f" of {r} ranks each ({cfg.inside.upper()} inside a worker)" if r > 1 or self.replicas.shards else ""
        run.print(f"{cfg.strategy}: {self.replicas.workers} workers{ranks}, {describe(self.workload.describe())}")
        run.lap("other")
        if self.member is not None:
            self.member.join()  # a restarted worker heals here
        self.first_step = self.sync.t  # its warm-up gets a longer bound (trainer.stall)
        while self.sync.continues(cfg.steps):
            step = self.sync.t
            self.phase.now = f"step {step + 1}"
            rec = self.train_step(step)
            epoch_done = int(self.workload.epoch_progress()) > self.epochs_evaluated
            if (rec["step"] % cfg.eval_every == 0 or epoch_done) and rec["step"] != cfg.steps:
                self.phase.now = f"evaluation at step {rec['step']}"
                self.evaluate(rec["step"])
            if cfg.checkpoint_every and rec["step"] % cfg.checkpoint_every == 0 and rec["step"] != cfg.steps:
                self.save_checkpoint(rec["step"])
        self.phase.now = "the final synchronization"
        if self.member is not None:
            self.member.before_finish()  # a worker still behind heals here
        self.sync.finish()
        self.phase.now = "the final evaluation"
        self.evaluate(self.sync.t)  # cfg.steps, but an asynchronous learner's own count (`continues`)
        self.save_checkpoint(cfg.steps)
        target = given_target(cfg.target_loss, cfg.target_acc, self.workload.kind)
        fields = {} if target is None else {"target": target_record(run.evals, target)}
        if getattr(self.sync, "run_summary", None) is not None:
            fields["asynchronous"] = self.sync.run_summary
        summary = run.close(**fields)
        if self.member is not None:
            self.member.shutdown()
        return summary


def lowest_over_ranks(value: int) -> int:
    """The lowest of every rank's `value` (an all-reduce MIN over the default group)."""
    t = torch.tensor([value], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t[0])


def ft_replicas(
    ranks_per_worker: int, rank: int, world: int, sharded: bool = False, device_type: str = "cpu"
) -> Replicas:
    """A fault-tolerant rank's place: its worker's ranks are this process's whole process group
    (`runner.worker`), and its exchanges between workers run over the quorum, not a group.
    `sharded` (FSDP inside): the model is sharded over a 1-D mesh of the worker's ranks."""
    worker, workers, local = place(rank, world, ranks_per_worker)
    inside = dist.group.WORLD if ranks_per_worker > 1 or sharded else None
    if not sharded:
        return Replicas(ranks_per_worker, worker, workers, local, inside=inside)
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(inside, device_type, mesh_dim_names=("inside",))
    return Replicas(ranks_per_worker, worker, workers, local, inside=inside, shards=True, mesh=mesh)


def link_cost(cfg: Config, model: torch.nn.Module, options: dict[str, Any], world: int) -> str | None:
    """What one step's exchange costs on the emulated link, as a line to print (None without
    --wan); a ConfigError when it would outlast --peer-timeout (a typo such as bw=1kbit for 1gbit
    would otherwise stall the run). The exchange is a mean in the strategy's codec (`comm.mean_cost`,
    what CoCoDC's T_s is), or for DDP the gradients' all-reduce over every rank, hierarchical
    between workers of several ranks (`net.cost.exchange_seconds`)."""
    if cfg.topology is None:
        return None
    cls, r = strategies.strategy_class(cfg.strategy), cfg.ranks_per_worker
    codec = cls.wire_codec(
        strategies.make_options(cfg.strategy, **options),
        [local_shard(p).shape for p in model.parameters() if p.requires_grad],
    )
    numel = codec.layout.numel if is_sparse(codec) else exchange_numel(model, options)
    if cls.steps_inside_workers:
        shards = cfg.inside == "fsdp"
        path = lossy_path(codec, options.get("codec_collective", "auto"), world // r, numel, cfg.topology, r, shards)
        seconds = mean_seconds(numel, codec, cfg.topology, world // r, r, shards=shards, collective=path)
    else:
        seconds = exchange_seconds("allreduce", 4 * numel, cfg.topology, world // r, r, reduce_inside=True)
    size = f"{4 * numel / 1e6:.3g} MB" + (
        "" if codec.name == "fp32" else f" as {codec.wire_bytes(numel) / 1e6:.3g} MB in {codec.name}"
    )
    line = f"link {cfg.wan}: one exchange of {size} takes ~{seconds * 1e3:.3g} ms (modelled)"
    if seconds > cfg.peer_timeout:
        raise ConfigError(
            f"{line}, beyond --peer-timeout {cfg.peer_timeout:g} s: check the link's bandwidth "
            f"unit (kbit, mbit, gbit) and rtt, or raise --peer-timeout"
        )
    return line


def exchange_numel(model: torch.nn.Module, options: dict[str, Any]) -> int:
    """Values of one exchange: the whole model (parameters and float buffers), or for the strategies
    that exchange fragments a mean-sized fragment (as CoCoDC's T_s)."""
    return round(sum(t.numel() for t in sync_tensors(model)) / max(1, int(options.get("fragments") or 1)))


def truncate_metrics(path: Path, step: int) -> None:
    """Drop records after `step` (a resumed run rewrites them identically)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    files.write_bytes(path, ("\n".join(keep) + ("\n" if keep else "")).encode(), durable=True)


# torch's warnings a worker of the CLI leaves out, each harmless where it arises here, and each 3-8 lines a
# rank: DDP's reducer compares a gradient's strides with its bucket view's on size-1 dimensions too (a
# convolution of 1 input channel, the vision CNN's first: [9, 1, 3, 1] against [9, 9, 3, 1]), where the
# layouts are the same memory, and it copies the gradient into the bucket either way.
QUIET_TORCH_WARNINGS = ("Grad strides do not match bucket view strides",)


def quiet_torch_warnings() -> None:
    """The worker process (the CLI's, not a user's own loop) leaves out QUIET_TORCH_WARNINGS."""
    for message in QUIET_TORCH_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def train_worker(
    cfg: Config, run_dir: str | Path, rank: int, world_size: int, resume: bool = False, phase: Phase | None = None
) -> dict[str, Any] | None:
    """Run one worker's training; the process group must already be initialized."""
    quiet_torch_warnings()
    threads = cfg.threads or max(
        1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    )
    torch.set_num_threads(threads)
    return Trainer(cfg, Path(run_dir), rank, world_size, resume=resume, phase=phase).run()
