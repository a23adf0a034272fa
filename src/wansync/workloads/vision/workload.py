"""The vision workload: the training loop's view of a model plus this rank's image shard."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..base import logits_of
from .augment import random_crop_flip
from .datasets import load_dataset
from .imagedata import ImageData
from .models import build_model
from .sampler import ShardSampler, _generator

Batch = tuple[torch.Tensor, torch.Tensor]


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP/DataParallel wrapper (evaluation must not trigger collectives)."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


class VisionWorkload:
    """Implements `wansync.workloads.base.Workload` for image classification."""

    kind = "vision"

    def __init__(
        self,
        model: nn.Module,
        data: ImageData,
        *,
        model_name: str = "custom",
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        batch_size: int = 64,
        eval_batches: int | None = None,
        augment: bool = True,
    ) -> None:
        self.model, self.data, self.model_name = model, data, model_name
        self.batch_size, self.eval_batches, self.augment = batch_size, eval_batches, augment
        self.sampler = ShardSampler(
            len(data.train_x), rank=rank, world_size=world_size, seed=seed, batch_size=batch_size
        )

    @property
    def shard_indices(self) -> torch.Tensor:
        """Indices into the training set that this rank owns (disjoint across ranks)."""
        return self.sampler.shard_indices

    def next_batch(self) -> Batch:
        """(images float32 N×C×H×W normalized, labels int64), on the CPU."""
        seed = self.sampler.batch_seed()
        idx = self.sampler.next_indices()
        x = self.data.train_x[idx]
        if self.augment:
            x = random_crop_flip(x, _generator(seed))
        return self.data.to_float(x), self.data.train_y[idx]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        dev = _device_of(_unwrap(model))
        return F.cross_entropy(logits_of(model(x.to(dev, non_blocking=True))), y.to(dev, non_blocking=True))

    def batch_size_items(self, batch: Batch) -> int:
        return int(batch[1].shape[0])

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Test loss and accuracy (percent) over the test set, or its first `eval_batches` batches."""
        net = _unwrap(model)
        was_training = net.training
        net.eval()
        dev = _device_of(net)
        n = len(self.data.test_x)
        if self.eval_batches is not None:
            n = min(n, self.eval_batches * self.batch_size)
        total_loss, correct = 0.0, 0
        try:
            for i in range(0, n, self.batch_size):
                x = self.data.to_float(self.data.test_x[i : min(i + self.batch_size, n)]).to(dev)
                y = self.data.test_y[i : min(i + self.batch_size, n)].to(dev)
                logits = logits_of(net(x))
                total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(1) == y).sum())
        finally:
            net.train(was_training)
        return {"test_loss": total_loss / n, "test_acc": 100.0 * correct / n}

    def epoch_progress(self) -> float:
        return self.sampler.epoch_progress()

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])

    def skip_to(self, steps: int) -> None:
        self.sampler.skip_to(steps)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "model": self.model_name,
            "params": sum(p.numel() for p in self.model.parameters()),
            "dataset": self.data.name,
            "classes": self.data.num_classes,
            "image_shape": list(self.data.image_shape),
            "train_size": len(self.data.train_x),
            "test_size": len(self.data.test_x),
            "shard_size": len(self.sampler),
            "batch_size": self.batch_size,
            "augment": self.augment,
        }


def build_vision_workload(
    model: str = "cnn",
    data: str = "fashion-mnist",
    *,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    batch_size: int = 64,
    eval_batches: int | None = None,
    augment: bool = True,
    width: float = 1.0,
    model_factory: Callable[[int, int, int], nn.Module] | None = None,
) -> VisionWorkload:
    """Load `data` (see DATASET_FORMS), build `model` sized for it, and shard it for `rank`.
    `model_factory(in_channels, num_classes, image_size)` builds a model of the user's instead, under
    `torch.manual_seed(seed)`."""
    ds = load_dataset(data)
    c, h, w = ds.image_shape
    if model_factory is None:
        net = build_model(
            model, in_channels=c, num_classes=ds.num_classes, image_size=min(h, w), width=width, seed=seed
        )
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = model_factory(c, ds.num_classes, min(h, w))
    return VisionWorkload(
        net,
        ds,
        model_name=model,
        rank=rank,
        world_size=world_size,
        seed=seed,
        batch_size=batch_size,
        eval_batches=eval_batches,
        augment=augment,
    )
