"""Any wansync strategy in a loop written with Hugging Face `accelerate`: `prepare` is
`Accelerator.prepare` for everything but the model and the optimizer, which the strategy owns.

    import wansync as ws
    from accelerate import Accelerator
    from wansync.integrations.accelerate import prepare
    accelerator = Accelerator(mixed_precision="bf16", cpu=not torch.cuda.is_available())
    ws.init()                                   # the group accelerate found, or torchrun's
    sync = ws.strategy("diloco", model, torch.optim.AdamW(model.parameters()), sync_every=50)
    (loader,) = prepare(accelerator, sync, loader)   # each rank its own shard of the data
    for batch in loader:
        with accelerator.autocast():            # bf16 compute, the model and its updates in fp32
            loss = sync.model(**batch).loss
        accelerator.backward(loss)
        sync.step()                             # inner step + whatever synchronization is due
        sync.zero_grad()
        scheduler.step()                        # yours, once per optimizer step
    sync.finish()

Why each piece is held back from `Accelerator.prepare`, and what is refused in one line (`ConfigError`):

- **The model.** `prepare(model)` wraps it in accelerate's own DistributedDataParallel whenever it sees
  several processes: an all-reduce of the gradients at every backward, under a strategy that exists to
  sync every H steps (and a second one beside `ddp`'s). Mixed precision, the other thing `prepare(model)`
  adds, is `accelerator.autocast()` around the forward.
- **The optimizer.** `AcceleratedOptimizer.step()` steps the inner optimizer itself: the strategy's step,
  and with it every synchronization, would never run. The step is `sync.step()`.
- **Learning-rate schedulers.** `AcceleratedScheduler` steps only after an optimizer accelerate prepared,
  and then once per process (`split_batches=False`): step yours after `sync.step()`.
- **fp16.** Its loss scaler steps the optimizer itself (`scaler.step`, bypassing `sync.step()`) and
  skips the step where a gradient overflowed, on that worker only. Use bf16.
- **Another world.** On a CPU machine `Accelerator()` without `cpu=True` sees one process per rank:
  every rank would train on the same batches while the strategy averages them. `prepare` compares the
  processes accelerate counts with the process group's before it shards anything.
- **DeepSpeed, FSDP, Megatron, XLA** communicate themselves, over the strategy's head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError

try:
    import accelerate
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ConfigError("wansync.integrations.accelerate needs accelerate: pip install 'wansync[hf]'") from e

__all__ = ["prepare"]

# accelerate's distributed types that only shard data and leave communication to the loop
_DATA_PARALLEL = frozenset(
    {
        "NO",
        "MULTI_CPU",
        "MULTI_GPU",
        "MULTI_MLU",
        "MULTI_SDAA",
        "MULTI_MUSA",
        "MULTI_NPU",
        "MULTI_XPU",
        "MULTI_HPU",
    }
)


def refusal(accelerator: Any, sync: Any, objects: tuple[Any, ...]) -> str | None:
    """Why `objects` cannot be prepared by `accelerator` under `sync` (module docstring), or None."""
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind not in _DATA_PARALLEL:
        return f"accelerate's {kind} communicates itself, over the strategy's head: launch plain data parallel"
    if accelerator.mixed_precision == "fp16":
        return "mixed_precision='fp16': its loss scaler skips a step on one worker only; use 'bf16'"
    world = dist.get_world_size(sync.group) if dist.is_initialized() else 1
    if accelerator.num_processes != world:
        return (
            f"accelerate sees {accelerator.num_processes} process(es) and the strategy's group {world}: every rank "
            "would train on the same batches; on a CPU machine give Accelerator(cpu=True)"
        )
    for obj in objects:
        if isinstance(obj, nn.Module):
            return "the model is the strategy's (accelerate would wrap it in its own DDP): give only the data; autocast with accelerator.autocast()"
        if isinstance(obj, torch.optim.Optimizer):
            return "the optimizer is the strategy's (accelerate's step would bypass sync.step()): give only the data"
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            return "a scheduler: accelerate steps it only after an optimizer it prepared, once per process; step it yourself after sync.step()"
    return None


def prepare(accelerator: "accelerate.Accelerator", sync: Any, *objects: Any) -> tuple[Any, ...]:
    """`accelerator.prepare(*objects)` for a loop whose model and optimizer `sync` owns: data loaders
    (each rank its own shard) and whatever else accelerate prepares that communicates nothing. Always a
    tuple, one prepared object per one given. Refused in one line: see the module docstring."""
    why = refusal(accelerator, sync, objects)
    if why is not None:
        raise ConfigError(f"wansync.integrations.accelerate.prepare: {why}")
    if not objects:
        return ()
    out = accelerator.prepare(*objects)
    return out if isinstance(out, tuple) else (out,)
