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
- **The model.** `_wrap_model` hands the Trainer `StrategyModule`, whose forward is `sync.model`'s (a
  DDP wrapper for ddp, cpdp, post_local_sgd) and whose `no_sync()` is `sync.no_sync()`: accelerate's
  `no_sync(model)` looks that method up, so every micro-batch but the last runs without communication.
  Because the model handed back is not the Trainer's `model`, the Trainer prepares only the optimizer
  with accelerate, never the model: accelerate's own DDP wrapping (which torchrun's environment would
  trigger) does not happen, and the strategy owns all communication.
- **The end.** A callback's `on_train_end` calls `sync.finish()` (every rank the same model) and
  closes the `ws.Run`.
- **Logs.** `log()` adds `wansync/exposed_pct` (this rank's time blocked on the network, percent of the
  wall clock since training began, from `ws.Run`'s profiler) and `wansync/bytes` (bytes this rank sent
  between workers, `sync.comm.bytes`) to every logs dict, so they reach TensorBoard and `log_history`.
- **Checkpoints.** `_save_checkpoint` adds `wansync_rank<R>.pt` to the checkpoint folder on every rank:
  this rank's model, inner optimizer and `sync.state_dict()`. The Trainer's own files are rank 0's, but
  between syncs each worker's model and optimizer moments are its own. `_load_optimizer_and_scheduler`
  (the Trainer's last restore before the first step) loads them back, so a resumed run continues bit
  for bit.

Refused in one line (`ConfigError`): DeepSpeed, FSDP, tensor parallelism or DataParallel of the Trainer
(each communicates itself, over the strategy's head), fp16 (its loss scaler may skip a step on one rank
only, and the ranks' collectives would no longer match), `load_best_model_at_end` (it loads rank 0's
weights on every rank behind the strategy's back). `average_tokens_across_devices` is turned off: it
all-gathers token counts at every step, which a strategy that syncs every H steps exists to avoid.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

import wansync as ws
from ..errors import ConfigError
from ..rundir import files
from ..rundir.claim import claim
from ..telemetry.run import agreed, identity

try:
    import transformers
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
    """The module the Trainer calls in training: forward through `sync.model` (looked up at every call:
    post_local_sgd changes it at its switch), `no_sync()` the strategy's. The user's model is its only
    submodule, so `parameters()` (clipping) and `zero_grad()` reach the same tensors."""

    sync: Any

    def __init__(self, sync: Any):
        super().__init__()
        self.module = sync.module
        object.__setattr__(self, "sync", sync)  # not a submodule: its DDP wrapper holds the same model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.sync.model(*args, **kwargs)

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


class WansyncTrainer(transformers.Trainer):
    """`transformers.Trainer` whose optimizer step is the wansync strategy `strategy`'s.

    Args (besides the Trainer's own):
        strategy: a strategy name (`diloco`, `streaming`, `sparseloco`, `ddp`, ...: docs/strategies.md).
        strategy_options: its options (`{"sync_every": 50}`), as `ws.strategy` takes them.
        run_dir: a `ws.Run` directory (metrics.jsonl, profile.json, summary.json) besides the Trainer's
            output; None keeps the profiler in memory only (the logs still carry its figures).
    """

    def __init__(
        self,
        *args: Any,
        strategy: str,
        strategy_options: dict[str, Any] | None = None,
        run_dir: str | Path | None = None,
        **kwargs: Any,
    ):
        given = kwargs.get("args", args[1] if len(args) > 1 else None)  # before the Trainer's own checks
        refused = refusals(given) if given is not None else []
        if refused:
            raise ConfigError(
                f"WansyncTrainer: the strategy owns the communication; the Trainer's "
                f"{', '.join(refused)} cannot run under it"
            )
        super().__init__(*args, **kwargs)
        if not dist.is_initialized():
            raise ConfigError("WansyncTrainer: torch.distributed is not initialized: call wansync.init() first")
        self.args.average_tokens_across_devices = False  # an all-gather at every step: see the module's doc
        self.strategy_name, self.strategy_options, self.run_dir = strategy, dict(strategy_options or {}), run_dir
        self.sync: Any = None
        self.run: Any = None
        self.resuming = False  # train(resume_from_checkpoint=...): the run in run_dir is continued
        self.add_callback(_FinishAtTrainEnd(self))

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        self.resuming = bool(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ---- the step ---------------------------------------------------------------------------
    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        if isinstance(self.optimizer, StrategyStep):
            return self.optimizer
        inner = super().create_optimizer(model)
        self.sync = ws.strategy(self.strategy_name, self.model, inner, **self.strategy_options)
        run_dir = self.run_dir
        agreed(  # the rule of every writer of a run (`rundir.claim`), agreed by every rank
            self.sync.group,
            lambda: claim(
                run_dir,
                action="write the Trainer's run into",
                where="run_dir=",
                resume=self.resuming,
                identity=identity(self.sync, dist.get_world_size()),
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
        if not training or self.sync is None:  # evaluation: the local model, no communication
            return model.module if isinstance(model, StrategyModule) else model
        if isinstance(model, StrategyModule):
            return model
        return StrategyModule(self.sync)

    # ---- the end ----------------------------------------------------------------------------
    def finish(self) -> None:
        """The last sync (every rank the same model) and the run's close: once per training."""
        if self.run is None:
            return
        self.sync.finish()
        self.run.close()
        self.run = None

    # ---- logs -------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.run is not None:
            wall = self.run.profiler.wall()
            exposed = self.run.profiler.totals["exposed_comm"]
            logs["wansync/exposed_pct"] = round(100.0 * exposed / wall, 4) if wall > 0 else 0.0
            logs["wansync/bytes"] = float(self.sync.comm.bytes)
        super().log(logs, *args, **kwargs)

    # ---- checkpoints ------------------------------------------------------------------------
    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
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
        }
        path = folder / STATE_FILE.format(dist.get_rank())
        files.save_torch(path, state)
        dist.barrier()  # every rank's file is there before anyone goes on (or rotates it away)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.sync is None:
            return
        path = Path(checkpoint) / STATE_FILE.format(dist.get_rank())
        if not path.exists():
            raise ConfigError(
                f"WansyncTrainer: {checkpoint} has no {path.name}: it was not saved by a "
                f"WansyncTrainer of {dist.get_world_size()} ranks"
            )
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors, numbers, dicts: nothing unpickled
        self.sync.module.load_state_dict(state["model"])
        self.sync.optimizer.load_state_dict(state["optimizer"])
        self.sync.load_state_dict(state["strategy"])
