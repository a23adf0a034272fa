"""The contract between the training loop and a workload (LM or vision).

The loop knows nothing about tokens or pixels: it asks a workload for this rank's next
batch, for the loss of a batch under a model, and for an evaluation. The data position is
part of the workload's state so that a resumed run continues at the exact sample.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Workload(Protocol):
    kind: str                      # "lm" or "vision"
    model: nn.Module               # built on CPU, deterministic from the seed

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

    def describe(self) -> dict[str, Any]:
        """Facts for the run's log: parameter count, dataset sizes, shapes."""
