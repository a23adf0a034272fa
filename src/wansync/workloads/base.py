"""The contract between the training loop and a workload (LM or vision), and what a factory of
the user's (`--model pkg.module:factory`, `--data pkg.module:factory`) is handed.

The loop knows nothing about tokens or pixels: it asks a workload for this rank's next
batch, for the loss of a batch under a model, and for an evaluation. The data position is
part of the workload's state so that a resumed run continues at the exact sample.
A workload of the user's needs only `model`, `next_batch`, `loss` and `evaluate`
(`workloads.user` supplies the rest); docs/your_model.md is the contract as a user reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..errors import ConfigError


@runtime_checkable
class Workload(Protocol):
    kind: str  # "lm" or "vision"
    model: nn.Module  # built on CPU, deterministic from the seed

    def next_batch(self) -> Any:
        """This rank's next training batch (its own disjoint shard; endless, reshuffled per epoch)."""

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Scalar training loss of `batch` under `model` (model may be a DDP wrapper)."""

    def batch_size_items(self, batch: Any) -> int:
        """Items in a batch for throughput: tokens for an LM, images for vision."""

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out metrics. LM: val_loss, val_ppl, val_bpb (bits per byte). Vision: test_loss, test_acc (percent)."""

    def epoch_progress(self) -> float:
        """Epochs of this rank's shard consumed so far (fractional)."""

    def state_dict(self) -> dict[str, Any]:
        """Data position and sampler RNG state: enough to continue at the exact next sample."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def skip_to(self, steps: int) -> None:
        """Serve next the batch a run that trained `steps` steps from the start would (a worker
        healed from a peer at that step goes on in its own shard where it would have been)."""

    def describe(self) -> dict[str, Any]:
        """Facts for the run's log: parameter count, dataset sizes, shapes."""


@dataclass(frozen=True)
class ModelSpec:
    """What a model factory (`--model pkg.module:factory`) is handed: the shape the built-in data
    asks of the model. LM data: tokens (B, T) in, logits (B, T, V >= vocab_size) out; image data:
    images (B, C, H, W) in, logits (B, num_classes) out. The factory runs under `torch.manual_seed(seed)`
    on every worker, so plain `nn.Module` initialisation gives every worker the same model."""

    kind: str  # "lm" (text) or "vision" (images): which data the run trains on
    seed: int
    config: Any  # the run's Config: every key (`config.width`, `config.lr`, ...)
    vocab_size: int | None = None  # LM: the tokenizer's vocabulary
    seq_len: int | None = None  # LM: tokens per training sequence
    in_channels: int | None = None  # vision: image channels, classes and side in pixels
    num_classes: int | None = None
    image_size: int | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """What a workload factory (`--data pkg.module:factory`) is handed: which part of the data this
    worker trains on (worker `rank` of `world_size`, each its own disjoint shard), and the keys that
    size it. `model` is the `--model` value as given, for the factory to interpret (or ignore)."""

    model: str
    rank: int
    world_size: int
    seed: int
    batch_size: int
    seq_len: int
    eval_batches: int
    config: Any


def logits_of(output: Any) -> torch.Tensor:
    """A model's logits: the output itself when it is a tensor, else its `.logits` (a Hugging Face
    model's output), else the first element of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ConfigError(
        f"the model returned {type(output).__name__}: expected a logits tensor, an output "
        f"with .logits, or a tuple whose first element is the logits"
    )


class RankSlice:
    """One rank's view of its worker's workload when a worker is R ranks (`comm.replicas`).

    The worker draws its batch of R × b items exactly as a one-rank worker with batch R × b
    would (same shard, same order, same augmentation), and local rank r trains on rows
    r·b … (r+1)·b − 1; so the samples a worker sees do not depend on R, and changing R changes
    only the order of the arithmetic. Everything else is the worker's workload's.
    """

    def __init__(self, workload: Workload, local_rank: int, ranks_per_worker: int):
        self.workload, self.local_rank, self.ranks_per_worker = workload, local_rank, ranks_per_worker

    def next_batch(self) -> Any:
        batch = self.workload.next_batch()
        n = int(batch[0].shape[0])
        if n % self.ranks_per_worker:
            raise ValueError(f"a worker batch of {n} items cannot be split over {self.ranks_per_worker} ranks")
        size = n // self.ranks_per_worker
        lo = self.local_rank * size
        return tuple(t[lo : lo + size] for t in batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.workload, name)
