"""Any wansync strategy under a Hugging Face `transformers.Trainer`: `WansyncTrainer` is the Trainer with
its optimizer step, its model wrapping, its checkpoints and its logs translated to `ws.strategy` and
`ws.Run`. It owns no training logic: the Trainer keeps its loop, data, loss, schedule, clipping and
accumulation; the strategy does the inner step and whatever synchronization is due.

    import wansync as ws
    from wansync.integrations.hf import WansyncTrainer
    ws.init()                                       # torchrun's environment, else one process
    trainer = WansyncTrainer(model=model, args=args, train_dataset=data,
                             strategy="diloco", strategy_options={"sync_every": 50})
    trainer.train()                                 # or train(resume_from_checkpoint=...)

Which hooks, and why these:

- **The step.** `create_optimizer` builds the Trainer's own optimizer (its `optim`, learning rate and
  weight decay), then the strategy around it, and hands the Trainer `StrategyStep`: an optimizer whose
  `step()` is `sync.step()` and whose state, groups and `state_dict` are the inner optimizer's. The
  Trainer calls `optimizer.step()` exactly once per optimizer step (after its last micro-batch and its
  clipping), so one `sync.step()` per optimizer step follows from its own accumulation logic, and its
  learning-rate scheduler, which steps the same param groups, drives the inner learning rate. Overriding
  the training loop instead would copy hundreds of lines that change between releases.
- **The world.** The Trainer shards the data by accelerate's world, which must be the process group's.
  On a machine with no accelerator, without `use_cpu=True`, accelerate sees one process per rank (every
  rank would train on every batch): the arguments are set up as `use_cpu=True` sets them (`cpu_world`);
  any other difference is refused (`same_world`).
- **The model.** `_wrap_model` hands the Trainer `StrategyModule`, whose forward is `sync.model`'s (a
  DDP wrapper for ddp, cpdp, post_local_sgd) and whose `no_sync()` is `sync.no_sync()`: accelerate's
  `no_sync(model)` looks that method up, so every micro-batch but the last runs without communication;
  for evaluation, one whose forward is the rank's own model's (no communication). Because the model
  handed back is not the Trainer's `model`, accelerate prepares only the optimizer, never the model:
  its own DDP wrapping (which torchrun's environment would trigger) does not happen, and the strategy
  owns all communication. What preparing the model would also have done is done here: under `bf16`
  the forward runs in the accelerator's autocast, its outputs returned in float32; under
  `torch_compile` the model's `forward` is compiled in place (so a strategy's DDP wrapper calls it
  too, while the hooks `ws.Run` times the step by stay eager), and put back when training ends.
- **The end.** At the last step, before its log, evaluation and checkpoint, `sync.finish()` (every rank
  the same model): the last checkpoint holds the final model. A callback's `on_train_end` finishes a
  run stopped earlier, evaluates the final model for `run_dir` (when there is an eval dataset and the
  last step had no evaluation) and closes the `ws.Run`.
- **Logs and evaluations.** `log()` adds `wansync/exposed_pct` (this rank's time blocked on the
  network, percent of the wall clock since training began, from `ws.Run`'s profiler) and
  `wansync/bytes` (bytes this rank sent between workers, `sync.comm.bytes`) to every logs dict, so they
  reach TensorBoard and `log_history`; a log of the training loss is a step record of the run
  (`Run.log`), an evaluation an evaluation record (`Run.evaluate`, `eval_loss` as `val_loss`), so
  `wansync report` reads the run directory. The Trainer's own collectives are booked as exposed
  communication: the loss and FLOs gathers of a log step (`_maybe_log_save_evaluate` up to `log()`),
  evaluation's gathers (`evaluation_loop`) and the checkpoint's barrier.
- **Checkpoints.** `_save_checkpoint` adds `wansync_rank<R>.pt` to the checkpoint folder on every rank:
  this rank's model, inner optimizer, `sync.state_dict()` and the run's identity (strategy, options,
  world: `telemetry.run.identity`). The Trainer's own files are rank 0's, but between syncs each
  worker's model and optimizer moments are its own. A resume checks the identity before anything is
  loaded, written or trained, with `rundir.claim.differs`, the comparison by which `run_dir=` and
  `ws.Run(append=True)` continue only the same run (every rank agreeing): another strategy, other
  options or another number of ranks is refused in one line, as `train --resume` refuses them. Then
  `_load_optimizer_and_scheduler` (the Trainer's last restore before the first step) loads the files
  back, so a resumed run continues bit for bit.

Refused in one line (`ConfigError`): DeepSpeed, FSDP, tensor parallelism or DataParallel of the Trainer
(each communicates itself, over the strategy's head), fp16 (its loss scaler may skip a step on one rank
only, and the ranks' collectives would no longer match), `load_best_model_at_end` (it loads rank 0's
weights on every rank behind the strategy's back). `average_tokens_across_devices` is turned off: it
all-gathers token counts at every step, which a strategy that syncs every H steps exists to avoid.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch import nn

import wansync as ws
from ..errors import ConfigError
from ..rundir import files
from ..rundir.claim import claim, differs
from ..telemetry.run import agreed, identity
from ..trainer.muon import muon_adamw

try:
    import transformers
    from accelerate.utils import convert_to_fp32
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ConfigError("wansync.integrations.hf needs transformers and accelerate: pip install 'wansync[hf]'") from e

STATE_FILE = "wansync_rank{}.pt"  # in each checkpoint folder, one per rank


class StrategyStep(torch.optim.Optimizer):
    """The optimizer the Trainer steps: `step()` is the strategy's (inner step, then synchronization),
    everything else (param groups, state, state_dict, zero_grad) the inner optimizer's. A subclass of
    `torch.optim.Optimizer` for the learning-rate schedulers' type check; its `__init__` is not called,
    as accelerate's `AcceleratedOptimizer` does, so it holds no state of its own."""

    def __init__(self, sync: Any):  # no Optimizer.__init__: the inner optimizer holds it all
        self.sync = sync
        self.inner = sync.optimizer
        self.defaults = self.inner.defaults

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sync.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ConfigError("a wansync strategy's step takes no closure (LBFGS-style optimizers are not supported)")
        self.sync.step()


class StrategyModule(nn.Module):
    """The module the Trainer calls: in training, forward through `sync.model` (looked up at every call:
    post_local_sgd changes it at its switch) and `no_sync()` the strategy's; in evaluation (`local`),
    forward through this rank's own model, with no communication. The user's model is its only
    submodule, so `parameters()` (clipping) and `zero_grad()` reach the same tensors. `autocast`, when
    given (the accelerator's, under `bf16=True`), is the context the forward runs in, its floating
    outputs returned in float32: what accelerate's `prepare_model` does to a model it prepares."""

    sync: Any

    def __init__(self, sync: Any, autocast: Callable[[], ContextManager[Any]] | None = None, local: bool = False):
        super().__init__()
        self.module = sync.module
        object.__setattr__(self, "sync", sync)  # not a submodule: its DDP wrapper holds the same model
        self.autocast, self.local = autocast, local

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self.module if self.local else self.sync.model
        if self.autocast is None:
            return model(*args, **kwargs)
        with self.autocast():
            out = model(*args, **kwargs)
        return convert_to_fp32(out)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.sync.no_sync():
            yield


class _FinishAtTrainEnd(transformers.TrainerCallback):
    def __init__(self, trainer: "WansyncTrainer"):
        self.trainer = trainer

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.finish()


def refusals(args: Any) -> list[str]:
    """What in `args` (TrainingArguments) conflicts with a strategy that owns the communication."""
    out = []
    if getattr(args, "deepspeed", None):
        out.append("DeepSpeed (deepspeed=...)")
    if getattr(args, "fsdp", None):
        out.append("FSDP (fsdp=...)")
    if getattr(args, "parallelism_config", None) is not None:
        out.append("a parallelism_config (tensor/context parallelism)")
    if getattr(args, "n_gpu", 1) > 1:
        out.append(f"DataParallel over {args.n_gpu} GPUs in one process (launch one process per GPU with torchrun)")
    if getattr(args, "fp16", False):
        out.append("fp16 (its loss scaler may skip a step on one rank only; use bf16)")
    if getattr(args, "load_best_model_at_end", False):
        out.append("load_best_model_at_end (it loads rank 0's weights on every rank behind the strategy)")
    return out


def cpu_world(args: Any) -> None:
    """On a machine with no accelerator, without `use_cpu=True`, accelerate resolves one process per
    rank (every rank its main one, all training on the same batches) although torchrun launched
    several: `args` is set up as `use_cpu=True` sets it, the ranks of the process group on the CPU.
    Before the Trainer makes its accelerator from the state `args` set up."""
    if dist.get_world_size() > 1 and getattr(args, "use_cpu", True) is False:
        if not torch.accelerator.is_available():  # a CUDA build on a machine without a GPU has none either
            args.use_cpu = True
            vars(args).pop("_setup_devices", None)  # TrainingArguments set its devices up once: again,
            args._setup_devices  # now, and accelerate's state with them, before the Trainer reads it


def same_world(args: Any, processes: int) -> None:
    """The Trainer shards the data by its own world (accelerate's): it must be the process group's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if (processes, args.world_size, args.process_index) != (world, world, rank):
        raise ConfigError(
            f"WansyncTrainer: the Trainer sees {args.world_size} process(es) (this one as rank {args.process_index}), "
            f"the process group {world} (this one as rank {rank}): the ranks would not share out the batches; "
            f"launch them with torchrun (or pass use_cpu=True to train on the CPU)"
        )


class WansyncTrainer(transformers.Trainer):
    """`transformers.Trainer` whose optimizer step is the wansync strategy `strategy`'s.

    Args (besides the Trainer's own):
        strategy: a strategy name (`diloco`, `streaming`, `sparseloco`, `ddp`, ...: docs/strategies.md).
        strategy_options: its options (`{"sync_every": 50}`), as `ws.strategy` takes them.
        run_dir: a `ws.Run` directory (metrics.jsonl, profile.json, summary.json) besides the Trainer's
            output; None keeps the profiler in memory only (the logs still carry its figures).
        inner_optimizer: None, the Trainer's own (`optim`); "muon": Muon on the model's hidden matrices and
            AdamW on the rest (`trainer.muon`, docs/muon.md), with the Trainer's learning rate, weight decay
            (not on its biases and norms), `adam_beta1`, `adam_beta2` and `adam_epsilon`.
    """

    def __init__(
        self,
        *args: Any,
        strategy: str,
        strategy_options: dict[str, Any] | None = None,
        run_dir: str | Path | None = None,
        inner_optimizer: str | None = None,
        **kwargs: Any,
    ):
        given = kwargs.get("args", args[1] if len(args) > 1 else None)  # before the Trainer's own checks
        if given is not None and dist.is_initialized():
            cpu_world(given)
        refused = refusals(given) if given is not None else []
        if refused:
            raise ConfigError(
                f"WansyncTrainer: the strategy owns the communication; the Trainer's "
                f"{', '.join(refused)} cannot run under it"
            )
        if not dist.is_initialized():
            raise ConfigError("WansyncTrainer: torch.distributed is not initialized: call wansync.init() first")
        super().__init__(*args, **kwargs)
        same_world(self.args, self.accelerator.num_processes)
        self.args.average_tokens_across_devices = False  # an all-gather at every step: see the module's doc
        self.strategy_name, self.strategy_options, self.run_dir = strategy, dict(strategy_options or {}), run_dir
        self.inner_optimizer = inner_optimizer
        if inner_optimizer not in (None, "muon"):
            raise ConfigError(f"WansyncTrainer: inner_optimizer must be None or 'muon', got {inner_optimizer!r}")
        default_optim = type(self.args).__dataclass_fields__["optim"].default
        if inner_optimizer and (self.args.optim != default_optim or self.args.optim_args):
            raise ConfigError(
                f"WansyncTrainer: inner_optimizer='muon' replaces the Trainer's optim, so optim="
                f"{str(getattr(self.args.optim, 'value', self.args.optim))!r}"
                f"{f' and optim_args={self.args.optim_args!r}' if self.args.optim_args else ''} would be ignored: "
                f"drop one of the two"
            )
        self.sync: Any = None
        self.resuming = False  # train(resume_from_checkpoint=...): the run in run_dir is continued
        self.checkpoint: str | None = None  # the folder it resumes from
        self._resume_state: dict[str, Any] | None = None  # this rank's file in it, checked
        self._wrapped: dict[bool, StrategyModule] = {}  # by training: the module trained, the one evaluated
        self._uncompile: Callable[[], None] | None = None
        self._synced = False  # sync.finish() was called
        self._gathering = False  # the Trainer is gathering its logs' loss (until the log() that follows)
        self.add_callback(_FinishAtTrainEnd(self))

    run: Any = None  # the ws.Run while training
    run_identity: dict[str, Any] | None = None  # the strategy, its options, the world (`telemetry.run.identity`)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        self.resuming = bool(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        self.checkpoint = resume_from_checkpoint  # the folder, train(resume_from_checkpoint=True)'s included
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    # ---- the step ---------------------------------------------------------------------------
    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        if isinstance(self.optimizer, StrategyStep):
            return self.optimizer
        if self.inner_optimizer == "muon":  # Muon on the hidden matrices, AdamW on the rest (trainer.muon)
            module: Any = self.model
            decay = set(self.get_decay_parameter_names(module))
            inner: torch.optim.Optimizer = muon_adamw(
                module,
                lr=self.args.learning_rate,
                weight_decay=self.args.weight_decay,
                no_decay=[p for n, p in module.named_parameters() if n not in decay],
                betas=(self.args.adam_beta1, self.args.adam_beta2),
                eps=self.args.adam_epsilon,
            )
        else:
            inner = super().create_optimizer(model)
        self.sync = ws.strategy(self.strategy_name, self.model, inner, **self.strategy_options)
        if dist.get_rank() == 0 and self.args.max_steps > 0:
            self.sync.warn_for_run(self.args.max_steps)  # the guards that need the run's length (docs/guards.md)
        self.run_identity = identity(self.sync, dist.get_world_size())
        if self.resuming and self.checkpoint is not None:  # before anything is loaded, written or trained
            self._resume_state = self._checked_state(self.checkpoint)
        self._synced = False
        run_dir = self.run_dir
        agreed(  # the rule of every writer of a run (`rundir.claim`), agreed by every rank
            self.sync.group,
            lambda: claim(
                run_dir,
                action="write the Trainer's run into",
                where="run_dir=",
                resume=self.resuming,
                identity=self.run_identity,
                hints="train(resume_from_checkpoint=...) continues it, ",
            )
            if run_dir is not None
            else None,
            "WansyncTrainer: ",
        )
        self.run = ws.Run(
            self.sync,
            out=self.run_dir,
            steps=self.args.max_steps if self.args.max_steps > 0 else None,
            quiet=True,
            append=self.resuming,
            _claimed=True,
        )
        self.optimizer = StrategyStep(self.sync)
        return self.optimizer

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if self.sync is None:  # an evaluation before training: the Trainer's own way
            return model
        if not self._wrapped:  # once per strategy: the same modules at every call
            if self.args.torch_compile:
                self._compile()
            autocast = self.accelerator.autocast if self.accelerator.native_amp else None
            self._wrapped = {
                True: StrategyModule(self.sync, autocast),
                False: StrategyModule(self.sync, autocast, local=True),  # no communication
            }
        return self._wrapped[training]

    def _compile(self) -> None:
        """`torch_compile`: the model's forward compiled with the Trainer's backend and mode, in place, so
        that a strategy's DDP wrapper calls it too; the module's call stays eager, with the hooks `ws.Run`
        times the step by. Undone when training ends (a plain Trainer leaves its `model` uncompiled)."""
        module, args = self.sync.module, self.args
        before = vars(module).get("forward")  # an instance's own forward, else the class's
        backend = args.torch_compile_backend or "inductor"  # TrainingArguments names one: torch's default else
        module.forward = torch.compile(module.forward, backend=backend, mode=args.torch_compile_mode)

        def undo() -> None:
            if before is None:
                del module.forward
            else:
                module.forward = before

        self._uncompile = undo

    # ---- the end ----------------------------------------------------------------------------
    def _final_sync(self) -> None:
        """`sync.finish()`, every rank the same model: once per training."""
        if self.run is not None and not self._synced:
            self._synced = True
            self.sync.finish()

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """After each optimizer step. At the last one, the final sync comes first, so that the last log,
        evaluation and checkpoint hold the final model. The Trainer's collectives here are booked as
        exposed communication: the loss and FLOs gathers of a log step (timed up to `log()`),
        evaluation's gathers (`evaluation_loop`), the checkpoint's barrier."""
        if self.run is not None:
            self.run.lap("other")  # since the step: the scheduler's step, the callbacks
            if self.state.global_step >= self.state.max_steps:
                self._final_sync()
            self._gathering = self.control.should_log and self.state.global_step > self._globalstep_last_logged
        super()._maybe_log_save_evaluate(*args, **kwargs)

    def finish(self) -> None:
        """The end of training (`on_train_end`): the final sync, unless the last step made it; with
        `run_dir` and an eval dataset, an evaluation of the final model unless the last step had one;
        the run's close (summary.json, profile.json); once per training."""
        if self.run is None:
            return
        self._final_sync()
        if self.run_dir is not None and self.eval_dataset is not None:
            last = self.run.evals[-1]["step"] if self.run.evals else None
            if last != self.sync.t:
                self.evaluate()
        with warnings.catch_warnings():
            if self.run_dir is not None and self.eval_dataset is None:
                if dist.get_rank() == 0:
                    warnings.warn(
                        f"WansyncTrainer: no eval_dataset, so the run in {self.run_dir} has no evaluation at its "
                        f"last step and `wansync report` calls it cut short: give the Trainer an eval_dataset",
                        stacklevel=2,
                    )
                warnings.simplefilter("ignore")  # ws.Run's own line, which speaks of run.evaluate()
            self.run.close()
        self.run = None
        if self._uncompile is not None:
            self._uncompile()
            self._uncompile = None

    # ---- logs and evaluations ---------------------------------------------------------------
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Adds `wansync/exposed_pct` and `wansync/bytes` to every log; a log of the training loss is a
        step record of the run (`Run.log`: metrics.jsonl, with the learning rate and gradient norm)."""
        trained = self.run is not None and isinstance(logs.get("loss"), (int, float))
        if self.run is not None:
            if self._gathering:  # the loss and FLOs gathers since _maybe_log_save_evaluate began
                self._gathering = False
                self.run.lap("exposed_comm")
            wall = self.run.profiler.wall()
            exposed = self.run.profiler.totals["exposed_comm"]
            logs["wansync/exposed_pct"] = round(100.0 * exposed / wall, 4) if wall > 0 else 0.0
            logs["wansync/bytes"] = float(self.sync.comm.bytes)
        if trained:
            fields = {k: logs[k] for k in ("learning_rate", "grad_norm") if isinstance(logs.get(k), (int, float))}
            batch = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
            self.run.log(logs["loss"], items=batch, **fields)
        super().log(logs, *args, **kwargs)
        if trained and self.run is not None:
            self.run.lap("other")  # the Trainer's on_log callbacks

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's evaluation, each of its gathers booked as exposed communication."""
        if self.run is None:
            return super().evaluation_loop(*args, **kwargs)
        gather, run = self.gather_function, self.run

        def timed(*a: Any, **k: Any) -> Any:
            run.lap("eval")
            try:
                return gather(*a, **k)
            finally:
                run.lap("exposed_comm")

        self.gather_function = timed
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.gather_function = gather

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """The Trainer's evaluation; while training, also an evaluation record of the run (`Run.evaluate`):
        its numbers, `eval_loss` as `val_loss`, the name `wansync report` judges a run by."""
        run = self.run
        if run is None or isinstance(eval_dataset if eval_dataset is not None else self.eval_dataset, dict):
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)  # a dict: one call per dataset
        run.lap("other")
        metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        numbers = {
            ("val_loss" if k == "eval_loss" else k): float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("wansync/")
        }
        run.evaluate(numbers)
        return metrics

    # ---- checkpoints ------------------------------------------------------------------------
    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        if self.run is not None:
            self.run.lap("other")
        super()._save_checkpoint(model, trial)
        folder = (
            Path(self._get_output_dir(trial=trial)) / f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-"
            f"{self.state.global_step}"
        )
        folder.mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.sync.module.state_dict(),
            "optimizer": self.sync.optimizer.state_dict(),
            "strategy": self.sync.state_dict(),
            **({"identity": self.run_identity} if self.run_identity is not None else {}),
        }
        path = folder / STATE_FILE.format(dist.get_rank())
        files.save_torch(path, state)
        if self.run is not None:
            self.run.lap("checkpoint")
        dist.barrier()  # every rank's file is there before anyone goes on (or rotates it away)
        if self.run is not None:
            self.run.lap("exposed_comm")

    def _checked_state(self, checkpoint: str) -> dict[str, Any]:
        """This rank's file in `checkpoint`, once every rank has found its own and the run it continues is
        this one: its strategy, options and world, compared by `rundir.claim.differs`, as `run_dir=`'s
        are (`rundir.claim`). A refusal on one rank is a refusal on all."""
        path = Path(checkpoint) / STATE_FILE.format(dist.get_rank())
        mine = self.run_identity if self.run_identity is not None else identity(self.sync, dist.get_world_size())
        state: dict[str, Any] = {}

        def check() -> None:
            if not path.exists():
                raise ConfigError(
                    f"{checkpoint} has no {path.name}: it was not saved by a WansyncTrainer of "
                    f"{dist.get_world_size()} ranks"
                )
            state.update(torch.load(path, map_location="cpu", weights_only=True))  # nothing unpickled
            why = differs(state.get("identity"), mine)
            if why is not None:
                raise ConfigError(
                    f"cannot resume from {checkpoint}: {why}; resume it with the strategy, options and "
                    f"number of ranks it was saved with, or start a new run"
                )

        agreed(self.sync.group, check, "WansyncTrainer: ", what="the checkpoint")
        return state

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or self.sync is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        state = self._resume_state if self._resume_state is not None else self._checked_state(checkpoint)
        self._resume_state = None
        super()._load_optimizer_and_scheduler(checkpoint)
        try:
            self.sync.module.load_state_dict(state["model"])
            self.sync.optimizer.load_state_dict(state["optimizer"])
            self.sync.load_state_dict(state["strategy"])
        except (KeyError, ValueError, RuntimeError) as e:  # a file of a run that did not record itself
            cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ConfigError(
                f"WansyncTrainer: {checkpoint} does not hold a state of this run's {self.sync.name} "
                f"({type(e).__name__}: {cause}): resume it with the strategy, options and number of ranks it "
                f"was saved with"
            ) from None
