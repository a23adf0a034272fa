"""One training loop's run: the profiler, its run directory, TensorBoard and the progress bar, for a
user's own loop (`ws.Run`) and for the CLI's trainer alike (`trainer/loop.py` keeps its books here).

    sync = ws.strategy("diloco", model, optimizer, sync_every=50)
    with ws.Run(sync, out="runs/mine", steps=1000, tensorboard=True) as run:
        for x, y in loader:
            loss = F.cross_entropy(sync.model(x), y)
            loss.backward()
            sync.step()
            sync.zero_grad()
            run.log(loss, items=len(x))
        sync.finish()
        run.evaluate({"val_loss": validate(model)})     # every rank: the mean over ranks is kept

While it is open the run times the loop without changing a bit of its arithmetic: the first forward
of a step (a forward pre-hook on `sync.model`) ends the time charged to `data`; `sync.step()` and
`sync.finish()` (wrapped on this instance) end `compute` and are charged to `sync_math`, less the
inner optimizer step (`compute`) and the time blocked on the network (`exposed_comm`: the exchange's
waits, and DDP's, timed by the comm hook `telemetry.commtime` installs); `run.log` ends `other`,
`run.evaluate` ends `eval`. The categories add up to the wall clock (`telemetry.profiler`).

On closing (the `with` block's end, or `close()`), every rank writes its profile to
`logs/profile_rank<R>.json` and rank 0 writes profile.json and summary.json beside the metrics.jsonl
it kept (`rundir.layout`): the run directory `wansync report` reads. Closing is a collective (the
bytes and counts are means over ranks); a block left by an exception only closes the files.
"""

from __future__ import annotations

import weakref
import sys
import os
import dataclasses
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..comm.ledger import INSIDE
from ..comm.robust import Clip
from ..net import emulator_of
from ..rundir import files, jsonout
from ..rundir.divergence import quality_fields
from ..errors import ConfigError, StorageError, path_kind
from ..rundir.claim import claim
from ..rundir.layout import LOGS_DIR, METRICS_FILE, PROFILE_FILE, TENSORBOARD_DIR, write_summary
from .commtime import CommTimer, ddp_modules
from .memory import memory_per_rank
from .linkwatch import LinkWatch, link_fields
from .metrics import MetricsWriter
from .peerwait import PROFILE
from .profiler import Profiler, build_profile
from .progress import Progress, eval_line
from .tensorboard import Scalars, check_available


class Run:
    """What the CLI trainer has, for any loop around a strategy.

    Args:
        sync: the strategy (`ws.strategy(...)`); make the run before the first step, so that DDP's
            communication is timed from the start.
        out: the run directory (None: nothing is written; `profile()` and `close()` still answer).
        steps: the steps the loop will take (the progress bar's total and ETA); None if unknown.
        tensorboard: True for scalars in `out/tensorboard/`, or a directory (`telemetry.tensorboard`).
        info: more fields for summary.json (model, data, seed, ...: `wansync report` shows them).
        chance: the loss (or accuracy) at chance, for the summary's `diverged` flag.
        wan: the `--wan` spec the group's emulated link was made from, for the run files.
        unit: what `items` counts, for the progress line (`tok/s`, `img/s`).
        log_every, quiet: the progress line (`telemetry.progress`).
        append: continue a resumed run's metrics.jsonl (and TensorBoard events after its step).
        rank, world: this process's rank in the run and the run's processes, where the process group
            does not say (a fault-tolerant worker's group is its own); rank 0 writes the run's files.

    `out` follows the rule of every writer of a run (`rundir.claim`): a new or empty directory is
    taken; one of the user's files, or a run there without `append=True`, is refused in one line; with
    `append=True`, a run there is continued only when it is this run (strategy, options, world).
    """

    def __init__(
        self,
        sync: Any,
        out: str | Path | None = None,
        *,
        steps: int | None = None,
        tensorboard: bool | str | Path = False,
        info: dict[str, Any] | None = None,
        chance: float | None = None,
        wan: str | None = None,
        unit: str = "items/s",
        log_every: int = 10,
        quiet: bool = False,
        append: bool = False,
        rank: int | None = None,
        world: int | None = None,
        _claimed: bool = False,
    ):
        if not all(hasattr(sync, a) for a in ("step", "exchange", "model")):  # a strategy, by what it has
            raise ConfigError(
                f"Run: the first argument is the strategy ws.strategy(...) returned, got {type(sync).__name__}"
            )
        if out is not None and not isinstance(out, (str, os.PathLike)):
            raise ConfigError(f"Run: out= is a run directory's path (or None), got {type(out).__name__} {out!r}")
        if out is not None and not str(out).strip():  # Path("") is ".": the working directory
            raise ConfigError("Run: out= is empty; give a run directory, or out=None to write nothing")
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ConfigError(f"Run: log_every must be an integer >= 1, got {log_every!r}")
        self.sync, self.out = sync, Path(out) if out is not None else None
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size(sync.group) if world is None else world
        self.info, self.chance, self.wan_spec, self.unit = dict(info or {}), chance, wan, unit
        lead = self.rank == 0
        tb_dir = (
            self.out / TENSORBOARD_DIR
            if tensorboard is True and self.out is not None
            else Path(tensorboard)
            if tensorboard and tensorboard is not True
            else None
        )
        if tensorboard is True and self.out is None:
            raise ValueError(
                "Run(tensorboard=True) writes into the run directory: give out= (or a directory " "as tensorboard=)"
            )
        if tb_dir is not None:
            check_available()  # on every rank: none is left waiting for rank 0
        if not _claimed:  # the rule of every writer of a run (`rundir.claim`), agreed by every rank
            agreed(
                sync.group,
                lambda: claim(
                    self.out,
                    action="write ws.Run into",
                    where="out=",
                    resume=append,
                    identity=identity(sync, self.world),
                    hints="pass append=True to continue it (a new run would truncate its metrics.jsonl), ",
                )
                if self.out is not None
                else None,
                "Run: ",
            )
        if not _claimed and lead and steps and hasattr(sync, "warn_for_run"):
            sync.warn_for_run(steps)  # the regime guards that need the run's length, on rank 0
        if tb_dir is not None and tb_dir.exists() and not tb_dir.is_dir():
            raise ConfigError(f"Run: tensorboard= {tb_dir} is {path_kind(tb_dir)}, not a directory")
        if self.out is not None:
            try:
                self.out.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StorageError(f"Run: cannot create {self.out}: {e.strerror or e}") from None
        self.profiler = Profiler()
        self.evals: list[dict[str, Any]] = []
        self.sync_events = 0
        self.skipped = 0  # steps whose inner update was dropped (log(skipped=True))
        self.idle = 0  # steps this worker sat out (log(idle=True))
        self.exposed_inside_s = 0.0  # the part of exposed_comm spent inside the worker
        self.step_times: list[tuple[float, float]] = []  # per step: (compute, the rest but communication)
        self.computed_s: list[float] = []  # the compute of each step this worker computed
        self.eval_waits: dict[str, float] = {}  # per evaluation, the time blocked in its mean
        self.summary: dict[str, Any] | None = None
        self._waited = 0.0  # exchange waits since the step began
        self._armed = True  # the next forward with gradients ends `data`
        self._data_s = self._busy_s = self._exposed_s = 0.0
        self._closed = False
        # a run left open writes no summary: said once at exit (or when the run is collected), rank 0
        self._state = {"closed": False}
        if self.out is not None and self.rank == 0:
            weakref.finalize(self, _warn_unclosed, str(self.out), self._state)
        self.comm_timer = CommTimer(emulator_of(sync.group))
        self.link = LinkWatch(sync.group)
        self._logged_syncs = 0  # sync events at the last step record
        for ddp in ddp_modules(sync):  # before the first backward: DDP's comm hook
            self.comm_timer.instrument(ddp)
        self.writer = MetricsWriter(self.out / METRICS_FILE if lead and self.out is not None else None, append=append)
        self.scalars = None
        if lead and tb_dir is not None:
            if tensorboard is True:  # the run's own: a link there is refused, its files never removed or written
                files.directory(tb_dir)
            if not append:  # a fresh run's events only (a resumed one purges
                for old in tb_dir.glob("events.out.tfevents.*"):  # those after its step itself)
                    old.unlink()
            self.scalars = Scalars(tb_dir, purge_step=sync.t + 1 if append and sync.t else None)
        # an asynchronous learner takes its own count of steps, more or fewer than the run's: its line says both
        self.run_steps = None if sync.lock_step else steps
        own_total = steps if sync.lock_step else None
        self.progress = Progress(own_total, every=log_every, quiet=quiet, enabled=lead, prefix=f"[{sync.name}] ")
        sync.on_event(self._on_event)
        sync.comm.on_wait.append(self._on_wait)
        if not sync.lock_step:  # its learners carry what close() averages to rank 0 (no collective at the end)
            sync.figures = self._figures
        modules = {id(m): m for m in (*ddp_modules(sync), sync.module)}
        self._hooks = [m.register_forward_pre_hook(self._before_forward, prepend=True) for m in modules.values()]
        # this instance only; close() restores. What it times is the instance's own step and finish:
        # the class's, or a wrapper set at construction (a fault-tolerant sync's finish meets its quorum first)
        self._prior = {name: vars(sync)[name] for name in ("step", "finish") if name in vars(sync)}
        self._own_step, self._own_finish = sync.step, sync.finish
        sync.step, sync.finish = self._step, self._finish
        self.lap("other")  # the run's own start-up (TensorBoard's import)

    # ---- the hooks that time the loop ---------------------------------------------------------
    def _on_event(self, record: dict[str, Any]) -> None:
        if self._closed:
            return
        self.writer.write(record)
        if record.get("type") == "robust_clip":
            self.print(Clip.from_event(record).line(record["step"]))
        if record.get("type") == "sync":
            self.sync_events += 1
            if self.scalars is not None:
                self.scalars.sync(record, self.sync_events)

    def _on_wait(self, purpose: str, seconds: float) -> None:
        self._waited += seconds
        if purpose.startswith(INSIDE):
            self.exposed_inside_s += seconds

    def _before_forward(self, module: Any, args: Any) -> None:
        """The first forward of a training step (gradients on; not an evaluation's) ends `data`."""
        if self._armed and torch.is_grad_enabled():
            self._armed = False
            self._data_s = self.profiler.lap("data")
            if not self.comm_timer.in_step:
                self.comm_timer.begin(self.sync.t + 1, self.sync.comm.bytes)

    def _inside_waits(self) -> float:
        """A sharded worker's FSDP all-gathers and reduce-scatters waited for in forward and backward
        (emulated runs only), booked as traffic inside the worker."""
        replicas = self.sync.replicas
        if not replicas.shards:
            return 0.0
        seconds, nbytes = self.comm_timer.waited_on({replicas.inside.group_name})
        if nbytes:
            self.sync.comm.count(INSIDE + "fsdp", nbytes)
        self.exposed_inside_s += seconds
        return seconds

    def _step(self, *args: Any, **kwargs: Any) -> None:
        sync, prof, timer = self.sync, self.profiler, self.comm_timer
        if not timer.in_step:
            timer.begin(sync.t + 1, sync.comm.bytes)
        # DDP's waits inside forward and backward: the bucket all-reduces all completed before
        # backward returned, so measuring now gives what measuring right after backward would
        exposed = timer.after_backward() + self._inside_waits()
        compute = prof.lap("compute")
        prof.move("compute", "exposed_comm", exposed)
        if sync.inside_sync is not None and sync.inside_step(sync.t + 1):
            self.exposed_inside_s += exposed  # the worker's own DDP
        self._waited = 0.0
        self._own_step(*args, **kwargs)
        step_s = prof.lap("sync_math")
        inner, waited = sync.last_inner_s, self._waited
        prof.move("sync_math", "compute", inner)
        prof.move("sync_math", "exposed_comm", waited)
        timer.end(sync.comm.bytes, waited)
        self.step_times.append((compute - exposed + inner, self._data_s + max(0.0, step_s - inner - waited)))
        if not kwargs.get("idle"):
            self.computed_s.append(compute - exposed + inner)
        self._busy_s, self._exposed_s, self._data_s = compute + step_s, exposed + waited, 0.0
        self._waited = 0.0
        self._armed = True

    def _finish(self) -> None:
        sync, prof = self.sync, self.profiler
        self.comm_timer.begin("finish", sync.comm.bytes)
        self._own_finish()
        prof.lap("sync_math")
        prof.move("sync_math", "exposed_comm", self._waited)
        self.comm_timer.end(sync.comm.bytes, self._waited)
        self._waited = 0.0
        self._armed = True

    # ---- what the loop calls ------------------------------------------------------------------
    def lap(self, category: str) -> float:
        """Charge the time since the last mark to `category` (`telemetry.profiler.CATEGORIES`: a
        loop's own checkpoint, say); returns it. Evaluations and checkpoints are not training: a slow
        policy's clock leaves them out (`strategies.pace`)."""
        self._armed = True
        seconds = self.profiler.lap(category)
        if category in ("eval", "checkpoint"):
            self.sync.pace.pause(seconds)
        return seconds

    def print(self, line: str) -> None:
        """A line on rank 0's console (above the progress bar)."""
        self.progress.log(line)

    def log(
        self,
        loss: float | torch.Tensor,
        items: int | None = None,
        *,
        skipped: bool = False,
        idle: bool = False,
        **fields: Any,
    ) -> dict[str, Any]:
        """The step just taken: its loss (this rank's), the items (samples, tokens) of this rank's
        batch for the throughput over all ranks, any other numbers (`lr=`); `skipped`: the step's
        inner update was dropped; `idle`: the worker sat the step out (its slow policy's, `loss` is
        the last computed one). Writes the step record, with the step's exposed communication
        (`exposed_s`: the per-step timeline); returns it."""
        record: dict[str, Any] = {
            "type": "step",
            "step": self.sync.t,
            "loss": float(loss.detach()) if torch.is_tensor(loss) else float(loss),
            **fields,
        }
        if items is not None:
            record["items_per_s"] = items * self.world / max(1e-9, self._busy_s)
        record["time"] = self.profiler.wall()
        record["exposed_s"] = round(self._exposed_s, 6)
        if self.link.active and self.sync_events != self._logged_syncs:  # a step that exchanged:
            record.update(link_fields(self.link.current()))  # the link as it is now
        self._logged_syncs = self.sync_events
        if skipped:
            record["skipped"] = True
            self.skipped += 1
        if idle:
            record["idle"] = True
            self.idle += 1
        self.writer.write(record)
        if self.scalars is not None:
            wall = record["time"]
            exposed = self.profiler.totals["exposed_comm"]
            self.scalars.step(
                record, self._exposed_s, 100.0 * exposed / wall if wall > 0 else 0.0, self.sync.comm.bytes
            )
        self.lap("other")
        rate = f" {record['items_per_s']:.0f} {self.unit}" if "items_per_s" in record else ""
        if self.run_steps:
            rate += f", run at {self.sync.schedule_step(record['step'])}/{self.run_steps}"
        self.progress.update(record["step"], f"loss {record['loss']:.3f}{rate}")
        return record

    def evaluate(self, metrics: dict[str, float], *, step: int | None = None, **fields: Any) -> dict[str, Any]:
        """An evaluation: every rank calls it with its own `metrics` (a collective); the record keeps
        the mean over ranks (of each worker's own model, for the strategies that take local steps).
        Name the metric `val_loss` (or `test_acc`, in percent) for `wansync report` to judge the run
        by it; evaluate after the last step too, or the report calls the run cut short. Returns the record.

        The time blocked in the mean's all-reduce is exposed communication, not evaluation: a rank that
        evaluates first waits there for the later ones (a slower worker); profile.json's `eval_waits`
        keeps it per evaluation, from which `telemetry.peerwait` tells that wait apart."""
        if not isinstance(metrics, dict) or not all(
            isinstance(k, str) and hasattr(v, "__float__") and not isinstance(v, bool) for k, v in metrics.items()
        ):
            raise ConfigError(
                f"Run.evaluate: metrics is a dict of names to numbers, e.g. {{'val_loss': 3.0}}, got "
                f"{type(metrics).__name__} {str(metrics)[:80]}"
            )
        at = self.sync.t if step is None else step
        self.lap("eval")  # the evaluation's own work
        if self.sync.lock_step:
            means = self._means({k: float(v) for k, v in metrics.items()})
        else:  # learners on their own clocks (async_diloco) meet no one mid-run: this rank's own model
            means = {k: float(metrics[k]) for k in sorted(metrics)}
        waited = self.profiler.lap("exposed_comm")
        self.sync.pace.pause(waited)
        self.eval_waits[str(at)] = round(waited, 6)
        record = {"type": "eval", "step": at, "time": self.profiler.wall(), **means, **fields}
        self.evals.append(record)
        self.writer.write(record)
        if self.scalars is not None:
            self.scalars.evaluation(record)
        self.lap("eval")
        self.print(eval_line(record))
        return record

    # ---- resumable -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run continues from (with the strategy's own state)."""
        return {
            "evals": self.evals,
            "sync_events": self.sync_events,
            "skipped": self.skipped,
            "idle": self.idle,
            "profile": dict(self.profiler.totals),
            "exposed_inside_s": self.exposed_inside_s,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.evals = list(state["evals"])
        self.sync_events = int(state["sync_events"])
        self.skipped = int(state["skipped"])
        self.idle = int(state.get("idle", 0))
        self.profiler.restore(state["profile"])
        self.exposed_inside_s += float(state.get("exposed_inside_s", 0.0))

    # ---- the run's files ------------------------------------------------------------------------
    def wan(self) -> dict[str, Any] | None:
        """The emulated link (None when nothing is emulated)."""
        emulator = self.comm_timer.emulator
        if emulator is None and not self.wan_spec:
            return None
        if emulator is None:
            from ..net import parse_wan

            topology = parse_wan(self.wan_spec)
        else:
            topology = emulator.topology
        out = {
            "spec": self.wan_spec or topology.name or None,
            "link": topology.describe(),
            "emulated": emulator is not None,
        }
        if emulator is not None and topology.varies:  # where the links' schedules stood when training began
            out["schedule_s_at_start"] = round(emulator.run_time(self.profiler.start), 6)
        return out

    def profile(self) -> dict[str, Any]:
        """profile.json: time categories summing to the wall clock, sync events, derived figures."""
        timer = self.comm_timer
        epochs = None
        last = self.evals[-1] if self.evals else {}
        if self.sync.t > 0 and isinstance(last.get("epoch"), (int, float)):
            epochs = last["epoch"] * timer.steps / self.sync.t  # this process's (not before a resume)
        return {
            **build_profile(self.profiler, timer, steps=timer.steps, epochs=epochs, wan=self.wan()),
            "eval_waits": dict(self.eval_waits),
        }

    def _means(self, values: dict[str, float]) -> dict[str, float]:
        """The mean of each value over the strategy's group (one small all-reduce), keys sorted."""
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t, group=self.sync.group)
        t /= dist.get_world_size(self.sync.group)
        return {k: float(v) for k, v in zip(keys, t)}

    def _worker_step_s(self, workers: int, r: int) -> list[float]:
        """Each worker's median seconds of compute per step it computed (its ranks' mean): the speeds
        a run measured (a collective)."""
        import statistics

        computed = self.computed_s
        vector = torch.zeros(workers, dtype=torch.float64)
        vector[self.rank // r if self.world > 1 else 0] = (statistics.median(computed) if computed else 0.0) / r
        if self.world > 1:
            dist.all_reduce(vector, group=self.sync.group)
        return [round(float(v), 6) for v in vector]

    def _figures(self) -> dict[str, float]:
        """This rank's figures that `close` averages over workers (a learner of an asynchronous run sends
        them to rank 0 with each contribution)."""
        import statistics

        return {
            "between": float(self.sync.comm.bytes),
            "inside": float(self.sync.comm.inside_bytes),
            "skipped_steps": float(self.skipped),
            "dropped_exchanges": float(self.sync.comm.dropped),
            "idle_steps": float(self.idle),
            "step_s": statistics.median(self.computed_s) if self.computed_s else 0.0,
        }

    def _learner_means(self, workers: int) -> tuple[dict[str, float], dict[str, float], list[float]]:
        """`close`'s means for a run whose learners never meet (a learner may be gone by the end, so no
        collective): over each learner's last figures as the syncer received them (rank 0), with this
        rank's own as they are now. Elsewhere only this rank's: its summary is not written."""
        reported = dict(getattr(self.sync, "learner_figures", None) or {})
        reported[getattr(self.sync, "learner", self.rank)] = self._figures()

        def mean(key: str) -> float:
            return sum(f.get(key, 0.0) for f in reported.values()) / len(reported)

        means = {"between": mean("between"), "inside": mean("inside")}
        counts = {k: mean(k) for k in ("dropped_exchanges", "idle_steps", "skipped_steps")}
        step_s = [round(reported[w].get("step_s", 0.0), 6) if w in reported else 0.0 for w in range(workers)]
        return means, counts, step_s

    def close(self, **fields: Any) -> dict[str, Any] | None:
        """Write profile.json and summary.json (with `fields` added) and close the files: a
        collective. Returns the summary on rank 0, None elsewhere (and when already closed)."""
        if self._closed:
            return None
        sync = self.sync
        profile = self.profile()
        r = sync.replicas.ranks_per_worker
        workers = self.world // r
        if sync.lock_step:
            means = self._means({"between": sync.comm.bytes, "inside": sync.comm.inside_bytes})
            counts = self._means(
                {"skipped_steps": self.skipped, "dropped_exchanges": sync.comm.dropped, "idle_steps": self.idle}
            )
            worker_step_s = self._worker_step_s(workers, r)
        else:
            means, counts, worker_step_s = self._learner_means(workers)
        exposed = profile["categories_s"]["exposed_comm"]
        inside_s = min(exposed, self.exposed_inside_s)
        summary: dict[str, Any] = {
            "strategy": sync.name,
            "workers": workers,
            "ranks_per_worker": r,
            "steps": sync.t,
            "wall_clock_s": profile["wall_clock_s"],
            "options": dataclasses.asdict(sync.opts),
            **self.info,
            "bytes_sent": round(means["between"] * r),
            "bytes_between_workers": round(means["between"] * r),
            "bytes_inside_workers": round(means["inside"] * r),
            "comm": sync.comm.snapshot(),
            "sync_events": self.sync_events,
            **{k: round(v * workers) for k, v in counts.items()},  # summed over workers
            "wan": profile["wan"],
            "time_s": profile["categories_s"],
            "exposed_comm_pct": profile["derived"]["exposed_comm_pct"],
            "exposed_comm_inside_s": inside_s,
            "exposed_comm_between_s": exposed - inside_s,
            # this rank's bytes by category at the end (telemetry.memory; rank 0's is the one written)
            "memory_per_rank": memory_per_rank(sync.module, sync.optimizer, sync),
            "worker_step_s": worker_step_s,
            **(
                {"link_estimate": {**self.link.run().as_dict(), "now": self.link.current().as_dict()}}
                if self.link.active
                else {}
            ),
            **quality_fields(self.evals, self.chance),
        }
        summary.update(fields)
        self._detach()
        if self.out is not None:
            if self.rank == 0:
                write_summary(self.out, summary)
                files.write_text(self.out / PROFILE_FILE, jsonout.dumps(profile, indent=2))
            # every rank's, for the launcher's comparison of ranks (telemetry.peerwait) and for replaying
            # its step times in the planner (`wansync plan --step-times RUN`)
            logs = files.directory(self.out / LOGS_DIR)
            compute, rest = zip(*self.step_times) if self.step_times else ((), ())
            profile["steps_s"] = {"compute": [round(c, 6) for c in compute], "other": [round(o, 6) for o in rest]}
            files.write_text(logs / PROFILE.format(self.rank), jsonout.dumps(profile, indent=2))
        last = self.evals[-1]["step"] if self.evals else None
        if self.rank == 0 and self.out is not None and last != sync.t:
            warnings.warn(
                f"wansync: the run's last evaluation is {'missing' if last is None else f'at step {last}'}, "
                f"not at its last step {sync.t}: `wansync report` will call it cut short (call "
                f"run.evaluate(...) after the last step)",
                stacklevel=2,
            )
        self.summary = summary
        return summary if self.rank == 0 else None

    def _detach(self) -> None:
        """Stop timing: the strategy's own step and finish again, no hooks; the files closed."""
        if self._closed:
            return
        self._closed = True
        self._state["closed"] = True
        for h in self._hooks:
            h.remove()
        for name in ("step", "finish"):
            if name in self._prior:
                setattr(self.sync, name, self._prior[name])
            elif vars(self.sync).get(name) is not None:
                delattr(self.sync, name)
        if self._on_wait in self.sync.comm.on_wait:
            self.sync.comm.on_wait.remove(self._on_wait)
        self.progress.close()
        self.writer.close()
        if self.scalars is not None:
            self.scalars.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # other ranks may be gone: no collective, no summary
            self._detach()


def agreed(group: Any, check: Callable[[], Any], prefix: str = "", what: str = "its run directory") -> None:
    """Every rank of `group` runs `check` (a `rundir.claim`, or a checkpoint's `rundir.claim.differs`)
    before any of them writes, then they agree: a refusal on one rank is a refusal on all (no rank is
    left training beside a refused one). Every rank takes part, with or without a directory of its own
    (a loop may give `out=` on rank 0 only); `what` names what the others refused."""
    refused = ""
    try:
        check()
    except ConfigError as e:
        refused = f"{prefix}{e}"
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        flag = torch.tensor([1.0 if refused else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item() and not refused:
            refused = f"{prefix}another rank refused {what} (its own line says why)"
    if refused:
        raise ConfigError(refused)


def identity(sync: Any, world: int) -> dict[str, Any]:
    """What makes a run this run (`rundir.claim.IDENTITY`): the strategy, its options, the world."""
    r = sync.replicas.ranks_per_worker
    return {
        "strategy": sync.name,
        "workers": world // r,
        "ranks_per_worker": r,
        "options": dataclasses.asdict(sync.opts),
    }


def _warn_unclosed(out: str, state: dict[str, bool]) -> None:
    """A `Run` that was never closed: its summary.json and profile.json were never written, and
    `wansync report` will call the run cut short."""
    if not state["closed"]:
        print(
            f"wansync: warning: ws.Run(out={out}) was never closed: summary.json and profile.json were not "
            f"written; use `with ws.Run(...) as run:` or call run.close() after the last step",
            file=sys.stderr,
            flush=True,
        )
