"""One image dataset in memory: uint8 train/test tensors (N×C×H×W), labels and normalization.

Every loader (:mod:`.datasets`, :mod:`.imagefolder`) returns one; the workload converts a batch to
float only when it uses it, which keeps memory at one byte per pixel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from wansync.errors import DataError


@dataclass
class ImageData:
    """Train/test images (uint8, N×C×H×W) and labels (int64), with per-channel normalization."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    class_names: list[str] = field(default_factory=list)
    mean: torch.Tensor | None = None  # per channel, in [0, 1] units; computed from train_x if None
    std: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x, y = getattr(self, f"{split}_x"), getattr(self, f"{split}_y")
            if x.dtype != torch.uint8 or x.dim() != 4:
                raise DataError(
                    f"{self.name}: {split} images must be uint8 N×C×H×W, " f"got {x.dtype} {tuple(x.shape)}"
                )
            if len(x) != len(y) or len(x) == 0:
                raise DataError(f"{self.name}: {split} split has {len(x)} images and {len(y)} labels")
            setattr(self, f"{split}_y", y.to(torch.long))
        if self.train_x.shape[1:] != self.test_x.shape[1:]:
            raise DataError(
                f"{self.name}: train images {tuple(self.train_x.shape[1:])} and test images "
                f"{tuple(self.test_x.shape[1:])} differ in shape"
            )
        if self.mean is None or self.std is None:
            self.mean, self.std = channel_stats(self.train_x)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])  # type: ignore[return-value]

    def to_float(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 batch → normalized float32 (x/255 − mean) / std."""
        mean, std = self.mean.view(1, -1, 1, 1), self.std.view(1, -1, 1, 1)
        return (x.to(torch.float32).div_(255.0) - mean) / std


def channel_stats(x: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std of uint8 images in [0, 1] units, in chunks to bound memory."""
    c = x.shape[1]
    s = torch.zeros(c, dtype=torch.float64)
    s2 = torch.zeros(c, dtype=torch.float64)
    for i in range(0, len(x), chunk):
        part = x[i : i + chunk].to(torch.float64).div_(255.0).transpose(0, 1).reshape(c, -1)
        s += part.sum(1)
        s2 += (part * part).sum(1)
    n = x.numel() // c
    mean = s / n
    std = (s2 / n - mean * mean).clamp_min(1e-12).sqrt().clamp_min(1e-3)
    return mean.float(), std.float()
