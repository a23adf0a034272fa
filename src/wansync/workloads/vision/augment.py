"""Batch-vectorized training augmentation: random crop with zero padding + horizontal flip.

Works on uint8 N×C×H×W batches before normalization (padding is black, as in the usual
CIFAR recipe). All randomness comes from the generator passed in, so a batch's augmentation
is reproducible from its seed; the default pad is H // 8 (3 px at 28, 4 at 32, 8 at 64).
Horizontal flips are label-preserving for CIFAR, TinyImageNet and also Fashion-MNIST
(mirrored clothes and shoes stay in their class), so flipping is on for every dataset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def default_pad(image_size: int) -> int:
    return max(1, image_size // 8)


def random_crop_flip(
    x: torch.Tensor, generator: torch.Generator, pad: int | None = None, flip: bool = True
) -> torch.Tensor:
    """Pad by `pad` px, crop back to H×W at a random offset per image, then flip half the images."""
    n, c, h, w = x.shape
    pad = default_pad(min(h, w)) if pad is None else pad
    oy = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    ox = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    do_flip = torch.rand(n, generator=generator) < 0.5
    if pad > 0:
        padded = F.pad(x, (pad, pad, pad, pad)).permute(0, 2, 3, 1)  # N×H'×W'×C
        rows = (oy[:, None] + torch.arange(h))[:, :, None]  # N×H×1
        cols = (ox[:, None] + torch.arange(w))[:, None, :]  # N×1×W
        x = padded[torch.arange(n)[:, None, None], rows, cols].permute(0, 3, 1, 2)
    if flip:
        x = torch.where(do_flip[:, None, None, None], x.flip(3), x)
    return x.contiguous()
