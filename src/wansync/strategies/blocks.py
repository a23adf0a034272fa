"""Where a model's repeated blocks are, for a model that does not name its stages (`stages()`).

A transformer (Hugging Face's `LlamaForCausalLM`: `model.layers`; GPT-2: `transformer.h`) or a
residual network keeps its blocks in one container. The rule, in order:

1. **Wrappers are looked through**: `torch.compile`'s `OptimizedModule` (`_orig_mod`), DDP and
   `DataParallel` (`module`), FSDP1 (`_fsdp_wrapped_module`), nested in any order. FSDP2's
   `fully_shard` wraps nothing: the tree stays the model's.
2. **The repeated blocks** are the children of the `nn.ModuleList` or `nn.Sequential`, anywhere in
   the tree, whose children that hold exchanged tensors are at least two, all of one type, and each
   a module of modules (a transformer block, a residual block; a plain `nn.Sequential` of `Linear`s
   is a layer stack, not blocks). Of several such containers the one whose blocks hold the most
   bytes wins (then the one with more blocks, then the first in the module tree): an MoE block's
   list of experts never beats the list of blocks it sits in.

What a block holds is what the strategies exchange (`base.sync_tensors`: trainable parameters and
floating-point persistent buffers); `fragments.py` attaches everything else to the first or the last
block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .base import local_shard, sync_tensors


@dataclass(frozen=True)
class Blocks:
    """The repeated blocks of a model: the container's name in the tree (`""`: the model itself)
    and the blocks, as (name, module) in order."""

    container: str
    blocks: tuple[tuple[str, nn.Module], ...]

    def holds(self, name: str) -> bool:
        """Is the module called `name` the container or inside it?"""
        return not self.container or name == self.container or name.startswith(self.container + ".")


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside torch.compile's, DDP's, DataParallel's and FSDP1's wrappers."""
    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            model = model._orig_mod
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_fsdp_wrapped_module", None), nn.Module):  # FSDP1
            model = model._fsdp_wrapped_module
        else:
            return model


def repeated_blocks(model: nn.Module) -> Blocks | None:
    """The largest container of repeated blocks in `model`'s tree (see the module docstring), or
    None when it has none. `model` is taken as it is: `unwrap` it first."""
    best: tuple[int, int] | None = None
    found: Blocks | None = None
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        members = [
            (child, module, whole_bytes(module, sync_tensors(module))) for child, module in container.named_children()
        ]
        members = [m for m in members if m[2] > 0]
        if len(members) < 2 or len({type(m) for _, m, _ in members}) != 1:
            continue
        if not all(any(True for _ in m.children()) for _, m, _ in members):
            continue
        key = (sum(b for _, _, b in members), len(members))
        if best is None or key > best:  # strictly larger: the first in the tree wins ties
            best = key
            found = Blocks(name, tuple((f"{name}.{child}" if name else child, m) for child, m, _ in members))
    return found


def whole_bytes(module: nn.Module, tensors: list[torch.Tensor]) -> int:
    """Bytes of `tensors` (some of `module`'s `sync_tensors`), each counted whole: a parameter
    sharded inside the worker (FSDP2) at its full size, so every rank of a worker weighs alike."""
    whole = {id(local_shard(p)): p for p in module.parameters()}
    return sum(w.numel() * w.element_size() for w in (whole.get(id(t), t) for t in tensors))
