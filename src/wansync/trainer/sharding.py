"""How a worker's ranks hold its model (`--inside`) and in what precision it computes (`--precision`).

- `ddp` (default): every rank holds the whole model; the strategy wraps it in PyTorch's DDP over
  the worker's ranks (`strategies.grad_sync`). `bf16` then is `torch.autocast`: bf16 compute, the
  parameters, gradients and optimizer in fp32.
- `fsdp`: PyTorch's FSDP2 shards the model over the worker's ranks (`fully_shard` on every block
  of the model, then the root, on the worker's `inside` mesh dimension; for DDP on the whole
  (across, inside) mesh: hybrid sharding, sharded inside and replicated across), so a rank holds
  1/R of the parameters, gradients and inner optimizer state, and the strategy's exchange and
  outer state work on its local shard.
  `bf16` then is FSDP2's `MixedPrecisionPolicy`: bf16 parameters for compute, gradients reduced
  in fp32, fp32 masters.

A model's blocks are its `stages()` between the first and the last (the LM's transformer blocks,
a ResNet's layers), else its repeated blocks (a Hugging Face model's `model.layers`), else its
top-level children that hold parameters.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
from torch import nn

from ..errors import ConfigError
from ..strategies.blocks import repeated_blocks

BF16 = "bf16"


def shard_worker(model: nn.Module, mesh: Any, precision: str, hybrid: bool = False) -> None:
    """`fully_shard` every block of `model`, then the model itself (in place), on the worker's ranks
    (`mesh["inside"]`): a strategy's gradient phase all-reduces the gradient shards across workers
    through FSDP2's all-reduce hook (`strategies.grad_sync`). `hybrid` (DDP: gradients across every
    step): on the whole 2-D mesh, FSDP2's own hybrid sharding."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = mesh if hybrid else mesh["inside"]
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == BF16
        else MixedPrecisionPolicy()
    )
    try:
        for block in blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    except (AssertionError, RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"--inside fsdp cannot shard this model with FSDP2 ({type(e).__name__}: {text}); " f"use --inside ddp"
        ) from None


def blocks(model: nn.Module) -> list[nn.Module]:
    """The units FSDP shards separately (one all-gather each): the model's middle stages when it
    names them, else its repeated blocks (`strategies.blocks`: a Hugging Face model's
    `model.layers`), else its parameter-holding children. The same blocks the fragments of
    Streaming DiLoCo and CoCoDC are cut over, so a fragment is a group of whole FSDP units."""
    stages = list(model.stages()) if callable(getattr(model, "stages", None)) else []
    if len(stages) >= 3:
        return stages[1:-1]
    found = repeated_blocks(model)
    if found is not None:
        return [m for _, m in found.blocks]
    return [m for m in model.children() if any(True for _ in m.parameters())]


def check_precision(precision: str, device_type: str) -> None:
    """bf16 needs an accelerator that computes in it (any CPU does, slowly where it lacks the instructions)."""
    if precision == BF16 and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("--precision bf16: this GPU does not support bfloat16 (use --precision fp32)")


def autocast(precision: str, sharded: bool, device_type: str) -> ContextManager[Any]:
    """The forward's precision context: bf16 autocast when the model itself stays fp32 (DDP inside);
    none when FSDP2's policy casts the parameters (sharded) or in fp32."""
    if precision != BF16 or sharded:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)
