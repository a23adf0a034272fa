"""Name → vision model, built deterministically from a seed without touching the global RNG."""

from __future__ import annotations

import torch
from torch import nn

from wansync.errors import ConfigError

from .cnn import SmallCNN
from .resnet import resnet18, resnet50
from .vit import vit_s

VISION_MODELS = ("cnn", "resnet18", "resnet50", "vit_s")


def build_model(
    name: str, *, in_channels: int, num_classes: int, image_size: int, width: float = 1.0, seed: int = 0
) -> nn.Module:
    """Build `name` for (in_channels, image_size, num_classes); every rank gets identical weights.

    `width` scales the CNN's and ResNets' channels; ViT-S keeps its standard size.
    """
    if name not in VISION_MODELS:
        raise ConfigError(f"unknown vision model {name!r}; choose one of {', '.join(VISION_MODELS)}")
    if not width > 0:
        raise ConfigError(f"model width must be positive, got {width}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "cnn":
            return SmallCNN(in_channels, num_classes, width)
        if name == "resnet18":
            return resnet18(in_channels, num_classes, width)
        if name == "resnet50":
            return resnet50(in_channels, num_classes, width)
        return vit_s(in_channels, num_classes, image_size)
