"""One rank's training loop: workload + strategy + profiler + evaluation + run files.

A worker is `ranks_per_worker` ranks (`comm.replicas`): each trains on its slice of the worker's
batch under DDP inside the worker, and the strategy exchanges between workers. Evaluation runs
on every rank (the same held-out batches) and reports the mean over workers of each worker's
*local* model; after the last step `sync.finish()` brings all ranks to the same parameters, so
the final numbers describe the one model every worker holds.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..rundir import checkpoint, jsonout
from .. import strategies
from ..ft.member import Member, quorum_for
from ..comm.ledger import INSIDE
from ..comm.exchange import lossy_path
from ..comm.mean_cost import mean_seconds
from ..comm.replicas import Replicas, replica_groups
from ..config import Config, fingerprint
from ..rundir.divergence import chance_level, diverged
from ..errors import ConfigError, NonFiniteError
from .faults import Faults
from ..net import emulator_of, exchange_seconds
from .optim import build_optimizer, lr_at, peak_lr, set_lr
from .sharding import autocast, shard_worker
from ..strategies.base import sync_tensors
from ..rundir.layout import write_summary
from ..rundir.target import given_target, target_record
from ..telemetry.memory import memory_per_rank
from ..telemetry.metrics import MetricsWriter
from ..telemetry.commtime import CommTimer, ddp_modules
from ..telemetry.peerwait import PROFILE
from ..telemetry.profiler import Profiler, build_profile
from ..telemetry.progress import Progress
from ..workloads import build_workload


def all_mean(values: dict[str, float]) -> dict[str, float]:
    """Mean of each metric over all workers (one small all-reduce)."""
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return {k: float(v) for k, v in zip(keys, t)}


def describe(facts: dict[str, Any]) -> str:
    """A one-line summary of a workload's describe() dict."""
    parts = [f"{facts.get('model', '?')} ({facts.get('params', 0) / 1e6:.2f}M params)", f"data {facts.get('data', facts.get('dataset', '?'))}"]
    for key in ("train_tokens", "train_size", "windows_per_rank", "shard_size", "batch_size", "seq_len"):
        if key in facts:
            parts.append(f"{key} {facts[key]}")
    return ", ".join(parts)


@dataclass
class Phase:
    """What the worker is doing now, for its one-line failure message ("failed during step 12")."""
    now: str = "start-up"


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, rank: int, world_size: int, resume: bool = False,
                 phase: Phase | None = None):
        self.cfg, self.run_dir, self.rank, self.world = cfg, Path(run_dir), rank, world_size
        self.phase = phase if phase is not None else Phase()
        self.device_type = "cuda" if cfg.backend == "nccl" else "cpu"
        sharded = cfg.inside == "fsdp"
        self.replicas = Replicas(1, rank, world_size, 0) if cfg.fault_tolerant else \
            replica_groups(cfg.ranks_per_worker, shard_inside=sharded, device_type=self.device_type)
        torch.manual_seed(cfg.seed)                     # same init on every rank
        self.workload = build_workload(cfg, self.replicas.worker, self.replicas.workers,
                                       self.replicas.local_rank, self.replicas.ranks_per_worker)
        if cfg.backend == "nccl":                       # one rank per GPU (worker.init_distributed chose it)
            self.workload.model.to(torch.device("cuda", torch.cuda.current_device()))
        if sharded:                                     # FSDP2 over the worker's ranks (trainer.sharding)
            shard_worker(self.workload.model, self.replicas.mesh, cfg.precision,
                         hybrid=not strategies.strategy_class(cfg.strategy).steps_inside_workers)
        self.optimizer = build_optimizer(cfg, self.workload.model)
        self.options = strategies.resolve_options(cfg.strategy, vars(cfg))
        link = link_cost(cfg, self.workload.model, self.options, world_size)     # before the first collective
        quorum = quorum_for(cfg, rank, world_size) if cfg.fault_tolerant else None
        self.sync = strategies.build(cfg.strategy, self.workload.model, self.optimizer, on_nonfinite=cfg.on_nonfinite,
                                     replicas=self.replicas, quorum=quorum, **self.options)
        self.skipped = 0
        self.fault = Faults.from_env()
        self.member = None if quorum is None else Member(quorum, rank, world_size, self.run_dir / "logs",
                                                         self.workload, self.optimizer, self.sync, self.fault)
        resumed = self.load_checkpoint() if resume else None
        restarted = self.member is not None and self.member.restarted     # appends to the run it rejoins
        self.writer = MetricsWriter(self.run_dir / "metrics.jsonl" if rank == 0 else None, append=resume or restarted)
        self.sync.on_event(self.writer.write)
        self.sync_events = 0
        self.sync.on_event(self._count_sync)
        self.profiler = Profiler()
        self._waited = 0.0
        self.exposed_inside_s = 0.0                       # the part of exposed_comm spent inside the worker
        self.step_times: list[tuple[float, float]] = []   # per step: (compute, the rest but communication)
        self.comm_timer = CommTimer(emulator_of())        # per-sync-event timing; DDP's hidden waits
        for ddp in ddp_modules(self.sync):
            self.comm_timer.instrument(ddp)
        self.sync.comm.on_wait.append(self._on_wait)
        self.progress = Progress(cfg.steps, every=cfg.log_every, quiet=cfg.quiet, enabled=rank == 0,
                                 prefix=f"[{cfg.strategy}] ")
        self.evals: list[dict[str, Any]] = []
        if link is not None:
            self.progress.log(link)
        if resumed is not None:
            self.restore_run_state(resumed)

    def _count_sync(self, record: dict[str, Any]) -> None:
        if record.get("type") == "sync":
            self.sync_events += 1

    def _on_wait(self, purpose: str, seconds: float) -> None:
        self._waited += seconds
        if purpose.startswith(INSIDE):
            self.exposed_inside_s += seconds

    # ---- one step ----------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, Any]:
        cfg, prof, sync = self.cfg, self.profiler, self.sync
        lr = lr_at(cfg, step, self.world)
        set_lr(self.optimizer, lr)
        batch = self.workload.next_batch()
        data_s = prof.lap("data")
        self.comm_timer.begin(step + 1, sync.comm.bytes)
        with autocast(cfg.precision, self.replicas.shards, self.device_type):
            loss = self.workload.loss(sync.model, batch)
        loss.backward()
        ddp_exposed = self.comm_timer.after_backward()   # DDP's waits inside forward/backward
        if self.replicas.shards:                         # FSDP's inside the worker (emulated runs)
            fsdp_s, fsdp_bytes = self.comm_timer.waited_on({self.replicas.inside.group_name})
            if fsdp_bytes:
                sync.comm.count(INSIDE + "fsdp", fsdp_bytes)
            self.exposed_inside_s += fsdp_s
            ddp_exposed += fsdp_s
        if self.fault is not None:
            self.fault.after_backward(self.rank, step + 1, self.workload.model)
        loss_value = float(loss.detach())
        skip = self.nonfinite_guard(loss_value, self.grad_norm(), step + 1)
        compute = prof.lap("compute")
        prof.move("compute", "exposed_comm", ddp_exposed)
        if sync.inside_sync is not None and sync.inside_step(step + 1):
            self.exposed_inside_s += ddp_exposed                  # the worker's own DDP
        self._waited = 0.0
        self.phase.now = f"step {step + 1} (synchronization)"
        sync.step(skip_inner=skip)
        sync.zero_grad()
        step_s = prof.lap("sync_math")
        prof.move("sync_math", "compute", sync.last_inner_s)
        prof.move("sync_math", "exposed_comm", self._waited)
        self.comm_timer.end(sync.comm.bytes, self._waited)
        self.step_times.append((compute - ddp_exposed + sync.last_inner_s,
                                data_s + max(0.0, step_s - sync.last_inner_s - self._waited)))
        items = self.workload.batch_size_items(batch) * self.world
        rec = {"type": "step", "step": sync.t, "loss": loss_value, "lr": lr,
               "items_per_s": items / max(1e-9, compute + step_s), "time": prof.wall()}
        if skip:
            rec["skipped"] = True
        return rec

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
            raise NonFiniteError(f"non-finite {what} on rank {self.rank} at step {step} "
                                 f"(--on-nonfinite abort; 'skip' drops such updates)")
        self.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)
        return True

    # ---- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> None:
        self.phase.now = f"checkpoint at step {step}"
        sharded = self.replicas.shards                   # model and optimizer: the worker's DCP checkpoint
        if sharded:
            checkpoint.save_sharded(self.run_dir, step, self.replicas.worker, self.workload.model, self.optimizer,
                                    self.replicas.inside)
        state = {"step": step, "world_size": self.world, "rank": self.rank, "inside": self.cfg.inside,
                 "model": None if sharded else self.workload.model.state_dict(),
                 "optimizer": None if sharded else self.optimizer.state_dict(),
                 "strategy": self.sync.state_dict(), "workload": self.workload.state_dict(),
                 "rng": torch.get_rng_state(), "evals": self.evals, "sync_events": self.sync_events,
                 "skipped": self.skipped, "comm": self.sync.comm.snapshot(),
                 "profile": dict(self.profiler.totals), "exposed_inside_s": self.exposed_inside_s}
        checkpoint.save_rank(self.run_dir, step, self.rank, state, config=fingerprint(self.cfg, self.options))
        dist.barrier()                                   # every rank's file is durable: the checkpoint is complete
        if self.fault is not None:
            self.fault.after_checkpoint(self.rank, step)
        first_on_host = os.environ.get("LOCAL_RANK", str(self.rank)) == "0"     # each host prunes its own files
        if first_on_host and self.member is None:      # fault-tolerant: no barrier, so nothing is pruned
            checkpoint.prune(self.run_dir, step)
        self.profiler.lap("checkpoint")

    def load_checkpoint(self) -> dict[str, Any]:
        state = checkpoint.load_rank(self.run_dir, self.rank, self.world)
        if self.replicas.shards:
            checkpoint.load_sharded(self.run_dir, self.replicas.worker, self.workload.model, self.optimizer,
                                    self.replicas.inside)
        else:
            self.workload.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.sync.load_state_dict(state["strategy"])
        self.workload.load_state_dict(state["workload"])
        torch.set_rng_state(state["rng"])
        self.sync.comm.restore(state["comm"])
        self.skipped = int(state["skipped"])
        if self.rank == 0:
            truncate_metrics(self.run_dir / "metrics.jsonl", int(state["step"]))
        return state

    def restore_run_state(self, state: dict[str, Any]) -> None:
        self.evals = list(state["evals"])
        self.sync_events = int(state["sync_events"])
        self.profiler.restore(state["profile"])
        self.exposed_inside_s += float(state.get("exposed_inside_s", 0.0))

    @property
    def epochs_evaluated(self) -> int:
        """Whole epochs already covered by an evaluation (every epoch end is evaluated)."""
        return max((int(e.get("epoch", 0)) for e in self.evals), default=0)

    def evaluate(self, step: int) -> dict[str, Any]:
        with autocast(self.cfg.precision, self.replicas.shards, self.device_type):
            metrics = all_mean(self.workload.evaluate(self.workload.model))
        record = {"type": "eval", "step": step, "time": self.profiler.wall(), **metrics,
                  "epoch": self.workload.epoch_progress()}
        self.evals.append(record)
        self.writer.write(record)
        self.profiler.lap("eval")
        bad = sorted(k for k, v in metrics.items() if not math.isfinite(v))
        if bad and self.cfg.on_nonfinite == "abort":
            raise NonFiniteError(f"the model diverged: {', '.join(bad)} is non-finite at step {step} "
                                 f"(--on-nonfinite abort; lower the learning rates)")
        return record

    # ---- the run ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any] | None:
        cfg = self.cfg
        r = self.replicas.ranks_per_worker
        ranks = f" of {r} ranks each ({cfg.inside.upper()} inside a worker)" if r > 1 or self.replicas.shards else ""
        self.progress.log(f"{cfg.strategy}: {self.replicas.workers} workers{ranks}, {describe(self.workload.describe())}")
        self.profiler.lap("other")
        unit = "tok/s" if self.workload.kind == "lm" else "img/s"
        if self.member is not None:
            self.member.join()                            # a restarted worker heals here
        while self.sync.t < cfg.steps:
            step = self.sync.t
            self.phase.now = f"step {step + 1}"
            rec = self.train_step(step)
            self.writer.write(rec)
            self.profiler.lap("other")
            self.progress.update(rec["step"], f"loss {rec['loss']:.3f} {rec['items_per_s']:.0f} {unit}")
            epoch_done = int(self.workload.epoch_progress()) > self.epochs_evaluated
            if (rec["step"] % cfg.eval_every == 0 or epoch_done) and rec["step"] != cfg.steps:
                self.phase.now = f"evaluation at step {rec['step']}"
                self.progress.log(self.format_eval(self.evaluate(rec["step"])))
            if cfg.checkpoint_every and rec["step"] % cfg.checkpoint_every == 0 and rec["step"] != cfg.steps:
                self.save_checkpoint(rec["step"])
        self.phase.now = "the final synchronization"
        self._waited = 0.0
        self.comm_timer.begin("finish", self.sync.comm.bytes)
        if self.member is not None:
            self.member.before_finish()                   # a worker still behind heals here
        self.sync.finish()
        self.profiler.lap("sync_math")
        self.profiler.move("sync_math", "exposed_comm", self._waited)
        self.comm_timer.end(self.sync.comm.bytes, self._waited)
        self._waited = 0.0
        self.phase.now = "the final evaluation"
        final = self.evaluate(cfg.steps)
        self.save_checkpoint(cfg.steps)
        self.progress.close()
        self.progress.log(self.format_eval(final))
        summary = self.summarize(final)
        if self.member is not None:
            self.member.shutdown()
        return summary

    def format_eval(self, e: dict[str, Any]) -> str:
        if "val_loss" in e:
            bpb = f" val_bpb {e['val_bpb']:.4f}" if "val_bpb" in e else ""
            return f"step {e['step']}: val_loss {e['val_loss']:.4f} val_ppl {e['val_ppl']:.2f}{bpb}"
        return f"step {e['step']}: test_loss {e['test_loss']:.4f} test_acc {e['test_acc']:.2f}%"

    def wan(self) -> dict[str, Any] | None:
        """The emulated link (None when nothing is emulated)."""
        if self.cfg.topology is None:
            return None
        return {"spec": self.cfg.wan, "link": self.cfg.topology.describe(), "emulated": self.comm_timer.emulated}

    def profile(self) -> dict[str, Any]:
        """profile.json: time categories summing to the wall clock, sync events, derived figures."""
        timer = self.comm_timer
        epochs = None
        if self.sync.t > 0:  # the epochs this process trained (not those before a resume)
            epochs = self.workload.epoch_progress() * timer.steps / self.sync.t
        return build_profile(self.profiler, timer, steps=timer.steps, epochs=epochs, wan=self.wan())

    def summarize(self, final: dict[str, Any]) -> dict[str, Any] | None:
        profile = self.profile()
        r = self.replicas.ranks_per_worker
        means = all_mean({"between": self.sync.comm.bytes, "inside": self.sync.comm.inside_bytes})
        per_worker = {"between": means["between"] * r, "inside": means["inside"] * r}   # a worker's ranks together
        exposed = profile["categories_s"]["exposed_comm"]
        inside_s = min(exposed, self.exposed_inside_s)
        summary: dict[str, Any] = {
            "strategy": self.cfg.strategy, "workers": self.replicas.workers, "ranks_per_worker": r,
            "inside": self.cfg.inside, "precision": self.cfg.precision, "steps": self.cfg.steps,
            "wall_clock_s": profile["wall_clock_s"], "model": self.cfg.model, "data": self.cfg.data,
            "seed": self.cfg.seed, "options": self.options,
            "lr_scaling": self.cfg.lr_scaling, "peak_lr": peak_lr(self.cfg, self.world),
            "bytes_sent": round(per_worker["between"]), "bytes_between_workers": round(per_worker["between"]),
            "bytes_inside_workers": round(per_worker["inside"]), "comm": self.sync.comm.snapshot(),
            "sync_events": self.sync_events,
            **{k: round(v * self.replicas.workers) for k, v in all_mean(     # summed over workers
                {"skipped_steps": self.skipped, "dropped_exchanges": self.sync.comm.dropped}).items()},
            "wan": profile["wan"], "time_s": profile["categories_s"],
            "exposed_comm_pct": profile["derived"]["exposed_comm_pct"],
            "exposed_comm_inside_s": inside_s, "exposed_comm_between_s": exposed - inside_s,
            # this rank's bytes by category at the end (telemetry.memory; rank 0's is the one written)
            "memory_per_rank": memory_per_rank(self.workload.model, self.optimizer, self.sync),
        }
        if "val_loss" in final:
            losses = [e["val_loss"] for e in self.evals]
            summary.update(final_val_loss=final["val_loss"], final_val_ppl=final["val_ppl"],
                           best_val_loss=min(losses), best_val_ppl=math.exp(min(losses)))
            if "val_bpb" in final:          # bits per byte: comparable across tokenizers
                summary.update(final_val_bpb=final["val_bpb"], best_val_bpb=min(e["val_bpb"] for e in self.evals if "val_bpb" in e))
        else:
            accs = [e["test_acc"] for e in self.evals]
            summary.update(final_test_acc=final["test_acc"], peak_test_acc=max(accs),
                           final_test_loss=final["test_loss"])
        key = "val_loss" if "val_loss" in final else "test_acc"
        chance = chance_level(self.workload.describe())
        summary.update(first_eval=self.evals[0][key], chance_level=chance, diverged=diverged(self.evals, chance))
        target = given_target(self.cfg.target_loss, self.cfg.target_acc, self.workload.kind)
        if target is not None:
            summary["target"] = target_record(self.evals, target)
        if self.rank == 0:
            write_summary(self.run_dir, summary)
            (self.run_dir / "profile.json").write_text(jsonout.dumps(profile, indent=2))
        # every rank's, for the launcher's comparison of ranks (telemetry.peerwait) and for replaying
        # its step times in the planner (`wansync plan --step-times RUN`)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        compute, rest = zip(*self.step_times) if self.step_times else ((), ())
        profile["steps_s"] = {"compute": [round(c, 6) for c in compute], "other": [round(o, 6) for o in rest]}
        (self.run_dir / "logs" / PROFILE.format(self.rank)).write_text(jsonout.dumps(profile, indent=2))
        self.writer.close()
        return summary if self.rank == 0 else None


def link_cost(cfg: Config, model: torch.nn.Module, options: dict[str, Any], world: int) -> str | None:
    """What one step's exchange costs on the emulated link, as a line to print (None without
    --wan); a ConfigError when it would outlast --peer-timeout (a typo such as bw=1kbit for 1gbit
    would otherwise stall the run). The exchange is a mean in the strategy's codec (`comm.mean_cost`,
    what CoCoDC's T_s is), or for DDP the gradients' all-reduce over every rank, hierarchical
    between workers of several ranks (`net.cost.exchange_seconds`)."""
    if cfg.topology is None:
        return None
    numel, codec, r = exchange_numel(model, options), options.get("codec", "fp32"), cfg.ranks_per_worker
    if strategies.strategy_class(cfg.strategy).steps_inside_workers:
        path = lossy_path(codec, options.get("codec_collective", "auto"), world // r)
        seconds = mean_seconds(numel, codec, cfg.topology, world // r, r, shards=cfg.inside == "fsdp", collective=path)
    else:
        seconds = exchange_seconds("allreduce", 4 * numel, cfg.topology, world // r, r,
                                   inside=cfg.topology.intra_link, reduce_inside=True)
    size = f"{4 * numel / 1e6:.3g} MB" + ("" if codec == "fp32" else f" in {codec}")
    line = f"link {cfg.wan}: one exchange of {size} takes ~{seconds * 1e3:.3g} ms (modelled)"
    if seconds > cfg.peer_timeout:
        raise ConfigError(f"{line}, beyond --peer-timeout {cfg.peer_timeout:g} s: check the link's bandwidth "
                          f"unit (kbit, mbit, gbit) and rtt, or raise --peer-timeout")
    return line


def exchange_numel(model: torch.nn.Module, options: dict[str, Any]) -> int:
    """Values of one exchange: the whole model (parameters and float buffers), or for the strategies
    that exchange fragments a mean-sized fragment (as CoCoDC's T_s)."""
    return round(sum(t.numel() for t in sync_tensors(model)) / max(1, int(options.get("fragments") or 1)))


def truncate_metrics(path: Path, step: int) -> None:
    """Drop records after `step` (a resumed run rewrites them identically)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    checkpoint.atomic_write_bytes(path, ("\n".join(keep) + ("\n" if keep else "")).encode())


def train_worker(cfg: Config, run_dir: str | Path, rank: int, world_size: int,
                 resume: bool = False, phase: Phase | None = None) -> dict[str, Any] | None:
    """Run one worker's training; the process group must already be initialized."""
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    torch.set_num_threads(threads)
    return Trainer(cfg, Path(run_dir), rank, world_size, resume=resume, phase=phase).run()
